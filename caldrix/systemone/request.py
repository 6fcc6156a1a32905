"""A /v1/systemone body, validated into typed records, or an `ApiError` naming the field.

Pure and synchronous. The values a prompt is built from (the state, instructions, descriptions,
levels) are kept as parsed (`jsonlex.Value`: numbers as their lexemes, keys in order), because
each reading writes them its own way: the zero-shot reading as compact JSON, the decider's
with spaces. What differs between readings in validation (the size limits, the wording prefix,
required instructions) comes in through `Limits` and `Reading.check_question`; the shape checks
here are the same for both.

Order, so a body with several problems always names the same one: the fields refused by name
(assets, images, chat_template_kwargs), unknown top-level fields, model, state, then each
question in order (its unknown fields, type, instructions, criteria), then the question count.
"""

from __future__ import annotations

from typing import Iterable

import attrs

from caldrix.routes import strictjson
from caldrix.routes.errors import ApiError
from caldrix.systemone import jsonlex
from caldrix.systemone.jsonlex import Number, Value

TYPES = ("choice", "score", "noul")
REFUSED_FIELDS = ("assets", "images", "chat_template_kwargs")  # named in http-api.md
TOP_FIELDS = ("model", "state", "questions")
QUESTION_FIELDS = ("type", "instructions", "criteria")
NOUL_KEYS = ("true", "false")


@attrs.frozen
class Limits:
    """The sizes a reading accepts, and the prefix of its count refusals ("this model is a
    decider: " for the decider reading; none for the zero-shot one)."""

    questions: tuple[int, int] = (1, 64)
    choice: tuple[int, int] = (1, 26)  # options
    score: tuple[int, int] = (1, 26)  # levels
    prefix: str = ""


@attrs.frozen
class Option:
    """One allowed answer as the request gave it.

    choice: `name` is the option's name, `text` its description (None for null).
    score: `name` is the level's index as a string ("0", "1", ...), `text` the level.
    noul: `name` is "true" or "false", `text` its criterion; `given` is False when the request
    has no such key (then `text` is None).
    """

    name: str
    text: Value
    given: bool = True


@attrs.frozen
class Question:
    name: str
    kind: str  # one of TYPES
    path: str  # "questions.<name>", the param of refusals about this question
    instructions: Value  # None when absent or null
    instructions_given: bool  # the key is present (even as null)
    options: tuple[Option, ...]


@attrs.frozen
class SystemOneRequest:
    model: str
    state: Value
    questions: tuple[Question, ...]


def parse_body(raw: bytes) -> dict:
    """The body as a JSON object of `jsonlex` values, or a 400: not UTF-8, not JSON, a
    duplicate key (param: its path), not an object."""
    if not raw.strip():
        raise ApiError.invalid("the request body is empty; send a JSON object")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ApiError.invalid(f"the request body is not UTF-8: {e.reason} at byte {e.start}") from None
    try:
        body = jsonlex.loads(text)
    except jsonlex.DuplicateKey as e:
        raise ApiError.invalid(f'duplicate key "{e.key}" in the request body', e.path) from None
    except RecursionError:  # past MAX_NESTING, or past what the parser can go
        raise ApiError.invalid(strictjson.TOO_DEEP) from None
    except ValueError as e:  # JSONDecodeError, NaN/Infinity, a lone surrogate
        raise ApiError.invalid(f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise ApiError.invalid(f"the request body must be a JSON object, got {kind(body)}")
    return body


def parse_request(body: dict, served_name: str, limits: Limits) -> SystemOneRequest:
    """Validate a parsed body (see `parse_body`) into a SystemOneRequest."""
    for name in REFUSED_FIELDS:
        if name in body:
            raise ApiError.invalid(f"{name} is not supported by this server", name)
    _no_unknown(body, TOP_FIELDS, "")
    model = _model(body.get("model"), served_name)
    if "state" not in body:
        raise ApiError.invalid("state is required: a string, an object or an array", "state")
    state = body["state"]
    if not isinstance(state, (str, list, dict)):
        raise ApiError.invalid(f"must be a string, an object or an array, got {kind(state)}", "state")
    _in_range(state, "state")
    raw = body.get("questions")
    if raw is None:
        raise ApiError.invalid("questions is required: an object mapping names to questions", "questions")
    if not isinstance(raw, dict):
        raise ApiError.invalid(f"must be an object mapping names to questions, got {kind(raw)}", "questions")
    lo, hi = limits.questions
    if not lo <= len(raw) <= hi:
        raise ApiError.invalid(f"{limits.prefix}questions must hold {lo} to {hi} questions, got {len(raw)}",
                               "questions")
    questions = tuple(_question(name, q, limits) for name, q in raw.items())
    return SystemOneRequest(model=model, state=state, questions=questions)


def _model(model: Value, served_name: str) -> str:
    if model is None:
        raise ApiError.invalid(f'model is required; this server serves "{served_name}"', "model")
    if not isinstance(model, str):
        raise ApiError.invalid(f"must be a string, got {kind(model)}", "model")
    if model != served_name:
        shown = model if len(model) <= 64 else model[:63] + "…"
        raise ApiError.invalid(f'model "{shown}" is not served here; this server serves "{served_name}"', "model")
    return model


def _question(name: str, q: Value, limits: Limits) -> Question:
    path = f"questions.{name}"
    if not isinstance(q, dict):
        raise ApiError.invalid(f"must be an object with a type, got {kind(q)}", path)
    _no_unknown(q, QUESTION_FIELDS, path)
    qtype = q.get("type")
    if qtype == "box":
        raise ApiError.invalid("box questions are not supported by this server", f"{path}.type")
    if qtype not in TYPES:
        got = kind(qtype) if not isinstance(qtype, str) else f'"{qtype[:64]}"'
        if "type" not in q:
            raise ApiError.invalid('type is required: "choice", "score" or "noul"', f"{path}.type")
        raise ApiError.invalid(f'must be "choice", "score" or "noul", got {got}', f"{path}.type")
    instructions = q.get("instructions")
    if not _is_text(instructions, null=True):
        raise ApiError.invalid(f"must be a string, an object, an array or null, got {kind(instructions)}",
                               f"{path}.instructions")
    _in_range(instructions, f"{path}.instructions")
    criteria = q.get("criteria")
    cpath = f"{path}.criteria"
    if qtype == "choice":
        options = _choice(criteria, cpath, limits)
    elif qtype == "score":
        options = _score(criteria, cpath, limits)
    else:
        options = _noul(criteria, cpath)
    return Question(name=name, kind=qtype, path=path, instructions=instructions,
                    instructions_given="instructions" in q, options=options)


def _choice(criteria: Value, cpath: str, limits: Limits) -> tuple[Option, ...]:
    if not isinstance(criteria, dict):
        why = "criteria is required" if criteria is None else f"must be an object, got {kind(criteria)}"
        raise ApiError.invalid(f"{why}: a choice question maps option names to descriptions", cpath)
    lo, hi = limits.choice
    if not lo <= len(criteria) <= hi:
        raise ApiError.invalid(f"{limits.prefix}a choice question takes {lo} to {hi} options, got {len(criteria)}",
                               cpath)
    options = []
    for name, desc in criteria.items():
        if not _is_text(desc, null=True):
            raise ApiError.invalid(f"must be a string, an object, an array or null, got {kind(desc)}",
                                   f"{cpath}.{name}")
        _in_range(desc, f"{cpath}.{name}")
        options.append(Option(name, desc))
    return tuple(options)


def _score(criteria: Value, cpath: str, limits: Limits) -> tuple[Option, ...]:
    if not isinstance(criteria, list):
        why = "criteria is required" if criteria is None else f"must be an array, got {kind(criteria)}"
        raise ApiError.invalid(f"{why}: a score question lists its levels", cpath)
    lo, hi = limits.score
    if not lo <= len(criteria) <= hi:
        raise ApiError.invalid(f"{limits.prefix}a score question takes {lo} to {hi} levels, got {len(criteria)}",
                               cpath)
    options = []
    for i, level in enumerate(criteria):
        if not _is_text(level, null=False):
            raise ApiError.invalid(f"must be a string, an object or an array, got {kind(level)}", f"{cpath}[{i}]")
        _in_range(level, f"{cpath}[{i}]")
        options.append(Option(str(i), level))
    return tuple(options)


def _noul(criteria: Value, cpath: str) -> tuple[Option, ...]:
    if criteria is None:
        criteria = {}
    if not isinstance(criteria, dict):
        raise ApiError.invalid(f'must be an object with "true" and "false" descriptions, got {kind(criteria)}', cpath)
    _no_unknown(criteria, NOUL_KEYS, cpath)
    options = []
    for key in NOUL_KEYS:
        desc = criteria.get(key)
        if not _is_text(desc, null=True):
            raise ApiError.invalid(f"must be a string, an object, an array or null, got {kind(desc)}",
                                   f"{cpath}.{key}")
        _in_range(desc, f"{cpath}.{key}")
        options.append(Option(key, desc, given=key in criteria))
    return tuple(options)


def _no_unknown(obj: dict, known: Iterable[str], path: str) -> None:
    for key in obj:
        if key not in known:
            raise ApiError.invalid(f'unknown field "{key[:64]}"', f"{path}.{key}" if path else key)


def _is_text(value: Value, *, null: bool) -> bool:
    """A string, an object or an array (or null when `null`): what a prompt can be given."""
    return isinstance(value, (str, list, dict)) or (null and value is None)


def _in_range(value: Value, path: str) -> None:
    """Refuse a number that has no canonical form (past a 64-bit float's range)."""
    bad = jsonlex.first_out_of_range(value, path)
    if bad is not None:
        raise ApiError.invalid("this number is outside the range of a 64-bit float", bad)


kind = strictjson.kind  # a value's JSON type, as the refusals name it
