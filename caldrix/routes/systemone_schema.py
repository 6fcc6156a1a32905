"""POST /v1/systemone's part of the OpenAPI document (routes/openapi.py), built from the names
and limits its validator reads (systemone/request.py), so the two cannot drift apart.

What JSON Schema cannot say stays with the validator: duplicate keys (JSON Schema sees parsed
objects), the decider reading's own limits (2..max_options options, 2-10 levels; the document
states the loosest bounds: a decider takes up to 255 options), prompts that must fit the
context, and labels that must be one token each.
"""

from __future__ import annotations

from typing import Any

from caldrix.routes.fields import ModelLimits
from caldrix.systemone.request import NOUL_KEYS, QUESTION_FIELDS, TOP_FIELDS, Limits

MAX_DECIDER_OPTIONS = 255  # http-api.md "The decider reading": labels A..Z, then two-letter ones

_JSON = {"type": ["string", "object", "array"]}
_JSON_OR_NULL = {"type": ["string", "object", "array", "null"]}


def body_schema(ctx: ModelLimits) -> dict[str, Any]:
    limits = Limits()
    lo_q, hi_q = limits.questions

    def question(kind: str, criteria: dict[str, Any], required: tuple[str, ...]) -> dict[str, Any]:
        props = {"type": {"const": kind}, "instructions": _JSON_OR_NULL, "criteria": criteria}
        assert set(props) == set(QUESTION_FIELDS)
        return {"type": "object", "required": ["type", *required], "properties": props,
                "additionalProperties": False}

    choice = question("choice", {"type": "object", "minProperties": limits.choice[0],
                                 "maxProperties": max(limits.choice[1], MAX_DECIDER_OPTIONS),
                                 "additionalProperties": _JSON_OR_NULL}, ("criteria",))
    score = question("score", {"type": "array", "minItems": limits.score[0], "maxItems": limits.score[1],
                               "items": _JSON}, ("criteria",))
    noul = question("noul", {"anyOf": [{"type": "null"}, {
        "type": "object", "properties": {k: _JSON_OR_NULL for k in NOUL_KEYS}, "additionalProperties": False}]}, ())
    props = {"model": {"type": "string", "enum": [ctx.served_name]}, "state": _JSON,
             "questions": {"type": "object", "minProperties": lo_q, "maxProperties": hi_q,
                           "additionalProperties": {"oneOf": [choice, score, noul]}}}
    assert set(props) == set(TOP_FIELDS)
    return {"type": "object", "required": list(TOP_FIELDS), "properties": props, "additionalProperties": False,
            "description": "Typed decisions read from next-token logits (http-api.md, POST /v1/systemone). "
                           "Duplicate keys are refused; numbers keep their spelling."}


_PROBS = {"type": "object", "additionalProperties": {"type": "number", "minimum": 0, "maximum": 1}}
_ANSWER = {"oneOf": [
    {"type": "object", "required": ["type", "choice", "probabilities", "confidence"],
     "properties": {"type": {"const": "choice"}, "choice": {"type": "string"}, "probabilities": _PROBS,
                    "confidence": {"type": "number", "minimum": 0, "maximum": 1}}, "additionalProperties": False},
    {"type": "object", "required": ["type", "score", "legend", "probabilities", "confidence"],
     "properties": {"type": {"const": "score"}, "score": {"type": "number", "minimum": 0},
                    "legend": {"type": "object"}, "probabilities": _PROBS,
                    "confidence": {"type": "number", "minimum": 0, "maximum": 1}}, "additionalProperties": False},
    {"type": "object", "required": ["type", "noul"],
     "properties": {"type": {"const": "noul"}, "noul": {"type": "number", "minimum": 0, "maximum": 1}},
     "additionalProperties": False},
]}
REPLY = {"type": "object", "required": ["model", "answers", "usage"],
         "properties": {"model": {"type": "string"}, "answers": {"type": "object", "additionalProperties": _ANSWER},
                        "usage": {"type": "object", "required": ["input_tokens", "output_tokens"],
                                  "properties": {"input_tokens": {"type": "integer", "minimum": 0},
                                                 "output_tokens": {"const": 0}}}}}
