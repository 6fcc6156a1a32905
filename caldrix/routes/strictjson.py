"""JSON request bodies read strictly: a duplicate key is an error naming its path, NaN and
Infinity are not JSON, a string may not hold an unpaired UTF-16 surrogate, and nothing may nest
deeper than MAX_NESTING. Shared by the completions validator (routes/schemas.py) and
/v1/systemone's lexeme-keeping parser (systemone/jsonlex.py), which differ only in how they read
numbers (`bounded_int` is the validator's reading of integers)."""

from __future__ import annotations

import json
import re
from typing import Any


class DuplicateKey(ValueError):
    """An object holds `key` twice; `path` is where ("questions.q.type", "messages[0].role")."""

    def __init__(self, path: str, key: str) -> None:
        super().__init__(f'duplicate key "{key}"')
        self.path = path
        self.key = key


# Arrays and objects nested deeper than this are refused. No request needs a tenth of it; the
# bound keeps every walk over a body (the routes' and systemone's, most of them recursive) far
# from Python's recursion limit, which the parser itself nearly reaches (a body 500 deep holding
# an emoji escape was a 500 RecursionError in a recursive walk after the parse).
MAX_NESTING = 128
TOO_DEEP = f"the request body is nested too deeply: arrays and objects at most {MAX_NESTING} levels deep"


class TooDeep(RecursionError):
    """Arrays and objects nested deeper than MAX_NESTING. A RecursionError, as the parser's own
    for nesting past the interpreter's limit is: the callers refuse both alike."""

    def __init__(self) -> None:
        super().__init__(f"nested deeper than {MAX_NESTING} levels")


class _Dup(Exception):
    pass


class _Pairs(list):
    """An object's (key, value) pairs in document order: the duplicate finder's view."""


def _strict_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        raise _Dup
    return obj


def _reject_constant(name: str) -> Any:
    # Python's json reads NaN and Infinity; JSON has neither.
    raise ValueError(f"{name} is not a JSON value")


# Python's int() refuses a literal of more than 4300 digits (quadratic time to convert).
INT_DIGITS = 4300
HUGE = 10**INT_DIGITS


def bounded_int(text: str) -> int:
    """A parse_int hook: an integer literal exactly, or, past INT_DIGITS digits, HUGE with its
    sign: past every bound a field of a request has, so the field's own rule clamps or refuses
    it, where int() would have failed the whole body as "not valid JSON"."""
    if len(text) - text.startswith("-") <= INT_DIGITS:
        return int(text)
    return -HUGE if text.startswith("-") else HUGE


def loads(text: str, **hooks: Any) -> Any:
    """Parse `text` with json.loads (`hooks`: parse_float, parse_int), objects as dicts in
    document order. Raises DuplicateKey (the first duplicate, depth first in document order),
    json.JSONDecodeError for malformed text, ValueError for NaN/Infinity literals, and
    RecursionError for nesting deeper than MAX_NESTING (TooDeep) or than the interpreter lets
    the parser go. Surrogates are checked
    apart (`lone_surrogate`), so a caller can order its refusals."""
    hooks = {**hooks, "parse_constant": _reject_constant}
    try:
        value = json.loads(text, object_pairs_hook=_strict_object, **hooks)
    except _Dup:
        pairs = json.loads(text, object_pairs_hook=_Pairs, **hooks)
        _check_depth(text, pairs)
        found = _first_duplicate(pairs, "")
        assert found is not None, "the strict parse saw a duplicate the pairs parse does not"
        raise DuplicateKey(*found) from None
    _check_depth(text, value)
    return value


def _check_depth(text: str, value: Any) -> None:
    """Raise TooDeep when `value` nests deeper than MAX_NESTING. Text with fewer brackets than
    that cannot, and is not walked (nearly every request: a long token-id prompt has one)."""
    if text.count("[") + text.count("{") <= MAX_NESTING or not isinstance(value, (list, dict)):
        return
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        children = node.values() if isinstance(node, dict) else (v for _, v in node) if isinstance(node, _Pairs) else node
        for child in children:
            if isinstance(child, (list, dict)):
                if depth >= MAX_NESTING:
                    raise TooDeep
                stack.append((child, depth + 1))


def _first_duplicate(node: Any, path: str) -> tuple[str, str] | None:
    if isinstance(node, _Pairs):
        seen: set[str] = set()
        for key, value in node:
            child = f"{path}.{key}" if path else key
            if key in seen:
                return child, key
            seen.add(key)
            found = _first_duplicate(value, child)
            if found:
                return found
    elif isinstance(node, list):
        for i, value in enumerate(node):
            found = _first_duplicate(value, f"{path}[{i}]")
            if found:
                return found
    return None


_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def lone_surrogate(text: str, value: Any) -> bool:
    """Whether a string (or key) in `value`, parsed from `text`, holds an unpaired surrogate.
    Cheap first: only text with a \\uD800-\\uDFFF escape can."""
    return bool(_SURROGATE_ESCAPE.search(text)) and _has_lone_surrogate(value)


def _has_lone_surrogate(value: Any) -> bool:
    # A walk with a stack of its own, not recursion: the parser takes nesting deeper than
    # Python's recursion limit allows a recursive walk (a body 500 arrays deep holding an emoji
    # escape was a 500 RecursionError here).
    stack = [value]
    while stack:
        node = stack.pop()
        if isinstance(node, str):
            try:
                node.encode("utf-8")
            except UnicodeEncodeError:
                return True
        elif isinstance(node, dict):
            stack.extend(node.keys())
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return False


def kind(value: Any) -> str:
    """A parsed JSON value's type as an error message names it. Numbers are whatever the
    parser's hooks made of them (int, float, or systemone's lexeme-keeping Number)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    return "number"
