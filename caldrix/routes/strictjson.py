"""JSON request bodies read strictly: a duplicate key is an error naming its path, NaN and
Infinity are not JSON, and a string may not hold an unpaired UTF-16 surrogate. Shared by the
completions validator (routes/schemas.py) and /v1/systemone's lexeme-keeping parser
(systemone/jsonlex.py), which differ only in how they read numbers (`bounded_int` is the
validator's reading of integers)."""

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
    RecursionError for nesting deeper than the interpreter allows. Surrogates are checked
    apart (`lone_surrogate`), so a caller can order its refusals."""
    hooks = {**hooks, "parse_constant": _reject_constant}
    try:
        return json.loads(text, object_pairs_hook=_strict_object, **hooks)
    except _Dup:
        found = _first_duplicate(json.loads(text, object_pairs_hook=_Pairs, **hooks), "")
        assert found is not None, "the strict parse saw a duplicate the pairs parse does not"
        raise DuplicateKey(*found) from None


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


def _has_lone_surrogate(node: Any) -> bool:
    if isinstance(node, str):
        try:
            node.encode("utf-8")
        except UnicodeEncodeError:
            return True
        return False
    if isinstance(node, dict):
        return any(_has_lone_surrogate(k) or _has_lone_surrogate(v) for k, v in node.items())
    if isinstance(node, list):
        return any(_has_lone_surrogate(v) for v in node)
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
