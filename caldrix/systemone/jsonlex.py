"""JSON for /v1/systemone: a parser that keeps each number as it was spelled, and the compact
writer that puts objects and arrays into prompts.

Why not the body parser the other routes use: http-api.md has the score legend echo a level
exactly as the request spelled it (`1.50` stays `1.50`, a 30-digit integer stays exact), and
has objects and arrays written into the prompt with numbers in one canonical form. A parser
that turns numbers into floats has already lost both.

The parser is the standard library's scanner with hooks: numbers become `Number` (the lexeme,
untouched), objects keep their keys in document order (plain dicts), and a duplicate key at any
depth is found and named by its path. Everything else (strings, escapes, errors) is the standard
module's, so a body this parser refuses is one `json.loads` refuses too, with the same error
class, apart from the additions named in `loads`.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, Union

import attrs


@attrs.frozen
class Number:
    """A JSON number as the request spelled it. `lexeme` is valid JSON number text."""

    lexeme: str

    @property
    def is_integer(self) -> bool:
        """Written without `.`, `e` or `E` (JSON's integer form)."""
        return not any(c in self.lexeme for c in ".eE")

    def value(self) -> int | float:
        """The number as Python reads it (an int exactly; a float may overflow to inf)."""
        return int(self.lexeme) if self.is_integer else float(self.lexeme)


Value = Union[None, bool, str, Number, list, dict]


class DuplicateKey(ValueError):
    """A key appears twice in one object. `path` names it ("questions.q.type", "state[2].a")."""

    def __init__(self, path: str, key: str) -> None:
        super().__init__(f'duplicate key "{key}"')
        self.path = path
        self.key = key


class _Dup(Exception):
    pass


class _Pairs(list):
    """An object's (key, value) pairs in document order, for finding a duplicate's path."""


def _strict_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        raise _Dup
    return obj


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value")


def _number(lexeme: str) -> Number:
    return Number(lexeme)


_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def loads(text: str) -> Value:
    """Parse JSON text into Values: `Number` for numbers, dicts in document order.

    Raises `DuplicateKey` (with the path of the first duplicate, depth first in document order),
    `json.JSONDecodeError` for malformed text, `ValueError` for NaN/Infinity literals or an
    unpaired UTF-16 surrogate escape in a string (neither is JSON text a tokenizer can take), and
    `RecursionError` for nesting deeper than the interpreter allows.
    """
    hooks = dict(parse_float=_number, parse_int=_number, parse_constant=_reject_constant)
    try:
        value = json.loads(text, object_pairs_hook=_strict_object, **hooks)
    except _Dup:
        found = _first_duplicate(json.loads(text, object_pairs_hook=_Pairs, **hooks), "")
        assert found is not None, "the strict parse saw a duplicate the pairs parse does not"
        raise DuplicateKey(*found) from None
    if _SURROGATE_ESCAPE.search(text) and _has_lone_surrogate(value):
        raise ValueError("a string holds an unpaired UTF-16 surrogate escape")
    return value


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


def plain(value: Value) -> Any:
    """The same value with each Number read as Python reads it: what `json.loads` gives."""
    if isinstance(value, Number):
        return value.value()
    if isinstance(value, list):
        return [plain(v) for v in value]
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    return value


# --- the canonical number and the compact writer ---------------------------------------------


class NumberRange(ValueError):
    """A number with `.`, `e` or `E` past the 64-bit float range: it has no canonical form."""


def canonical_number(lexeme: str) -> str:
    """http-api.md's canonical form of a JSON number.

    An integer (no `.`, `e`, `E`) is written exactly at any size (only `-0` changes, to `0`:
    JSON forbids leading zeros and `+`, so every other integer lexeme is already canonical).
    Any other number is the shortest decimal that reads back to the same 64-bit float,
    positional for decimal exponents -4 to 15 and otherwise with a signed exponent of at least
    two digits; a whole number keeps `.0`. Python's `repr(float)` is exactly that form.
    Raises NumberRange for a number that overflows a 64-bit float.
    """
    if not any(c in lexeme for c in ".eE"):
        return "0" if lexeme == "-0" else lexeme
    x = float(lexeme)
    if not math.isfinite(x):
        raise NumberRange(f"{lexeme} is outside the range of a 64-bit float")
    return repr(x)


def compact(value: Value) -> str:
    """`value` as compact JSON: keys in the order received, no space after `,` or `:`, numbers
    in canonical form, strings as UTF-8 text (non-ASCII characters are not escaped)."""
    out: list[str] = []
    _write(value, out)
    return "".join(out)


def _write(value: Value, out: list[str]) -> None:
    if isinstance(value, Number):
        out.append(canonical_number(value.lexeme))
    elif isinstance(value, dict):
        out.append("{")
        for i, (k, v) in enumerate(value.items()):
            if i:
                out.append(",")
            out.append(json.dumps(k, ensure_ascii=False))
            out.append(":")
            _write(v, out)
        out.append("}")
    elif isinstance(value, list):
        out.append("[")
        for i, v in enumerate(value):
            if i:
                out.append(",")
            _write(v, out)
        out.append("]")
    else:  # str, bool, None
        out.append(json.dumps(value, ensure_ascii=False))


def first_out_of_range(value: Value, path: str) -> str | None:
    """The path of the first number in `value` that has no canonical form, or None."""
    if isinstance(value, Number):
        try:
            canonical_number(value.lexeme)
        except NumberRange:
            return path
        return None
    if isinstance(value, dict):
        for k, v in value.items():
            found = first_out_of_range(v, f"{path}.{k}")
            if found:
                return found
    elif isinstance(value, list):
        for i, v in enumerate(value):
            found = first_out_of_range(v, f"{path}[{i}]")
            if found:
                return found
    return None


def echo(value: Value) -> Any:
    """`value` ready for orjson with each Number written back as its own lexeme."""
    import orjson

    if isinstance(value, Number):
        return orjson.Fragment(value.lexeme)
    if isinstance(value, list):
        return [echo(v) for v in value]
    if isinstance(value, dict):
        return {k: echo(v) for k, v in value.items()}
    return value
