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
from typing import Any, Union

import attrs

from caldrix.routes import strictjson
from caldrix.routes.strictjson import DuplicateKey  # noqa: F401 (the parser's error, re-exported)


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


def _number(lexeme: str) -> Number:
    return Number(lexeme)


def loads(text: str) -> Value:
    """Parse JSON text into Values: `Number` for numbers, dicts in document order.

    Raises `DuplicateKey` (with the path of the first duplicate, depth first in document order),
    `json.JSONDecodeError` for malformed text, `ValueError` for NaN/Infinity literals or an
    unpaired UTF-16 surrogate escape in a string (neither is JSON text a tokenizer can take), and
    `RecursionError` for nesting deeper than the interpreter allows (routes/strictjson.py).
    """
    value = strictjson.loads(text, parse_float=_number, parse_int=_number)
    if strictjson.lone_surrogate(text, value):
        raise ValueError("a string holds an unpaired UTF-16 surrogate escape")
    return value


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
