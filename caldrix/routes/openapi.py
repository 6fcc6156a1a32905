"""GET /openapi.json: an OpenAPI 3.1 document of every route, built from routes/fields.py.

The request bodies come from the same `Field` declarations the validator reads, so the document
and the validator cannot drift apart; tests/test_openapi.py checks that the fields the validator
reads are exactly the document's properties.

Each route contributes an `Operation`: its path, method, request body schema (a function of the
served model, since the model name and the vocabulary bound the values) and its responses. To
document a new route, build an `Operation` next to its parser and add it to `operations()`
(or pass it to `document(..., extra=...)`).
"""

from __future__ import annotations

from typing import Any, Callable

import attrs
from quart import Blueprint, current_app

from caldrix.routes import fields, systemone_schema
from caldrix.routes.fields import ModelLimits

bp = Blueprint("openapi", __name__)

ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {"error": {
        "type": "object",
        "required": ["message", "type", "param", "code"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}},
    }},
}

# What each refusal means on this server (http-api.md "Errors").
REFUSALS = {
    400: "a malformed request, an unknown model, a prompt too long for the context, or a field the "
         "server does not implement; param names the field",
    404: "no such route",
    405: "method not allowed on this route",
    413: "the request body is over the server's limit (4 MiB; 32 MiB with a vision tower)",
    429: "the request queue is full; Retry-After says when to try again",
    500: "the engine failed during the request",
    503: "the engine is unavailable (it failed or the server is stopping)",
}


def error_responses(*statuses: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for status in statuses:
        resp: dict[str, Any] = {"description": REFUSALS[status],
                                "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
        if status == 429:
            resp["headers"] = {"Retry-After": {"description": "seconds to wait before retrying",
                                               "schema": {"type": "string", "pattern": "^[0-9]+$"}}}
        out[str(status)] = resp
    return out


@attrs.frozen
class Operation:
    """One route's part of the document. `body` is None for a route without a request body."""

    path: str
    method: str
    summary: str
    responses: Callable[[ModelLimits], dict[str, Any]]
    body: Callable[[ModelLimits], dict[str, Any]] | None = None
    operation_id: str = ""


_USAGE = {"type": "object", "required": ["completion_tokens", "prompt_tokens", "total_tokens"],
          "properties": {"completion_tokens": {"type": "integer", "minimum": 0},
                         "prompt_tokens": {"type": "integer", "minimum": 1},
                         "total_tokens": {"type": "integer", "minimum": 1}}}
_FINISH = {"enum": ["stop", "length"]}


def _reply(obj: str, choice: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "required": ["id", "object", "created", "model", "choices", "usage"],
            "properties": {"id": {"type": "string"}, "object": {"const": obj}, "created": {"type": "integer"},
                           "model": {"type": "string"}, "usage": _USAGE,
                           "choices": {"type": "array", "minItems": 1, "maxItems": 1, "items": choice}}}


_TOKEN_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}}
_COMPLETION_REPLY = _reply("text_completion", {
    "type": "object", "required": ["index", "text", "finish_reason"],
    "properties": {"index": {"const": 0}, "text": {"type": "string"}, "finish_reason": _FINISH,
                   "token_ids": _TOKEN_IDS}})
_CHAT_REPLY = _reply("chat.completion", {
    "type": "object", "required": ["index", "message", "finish_reason"],
    "properties": {"index": {"const": 0}, "finish_reason": _FINISH, "token_ids": _TOKEN_IDS,
                   "message": {"type": "object", "required": ["role", "content"],
                               "properties": {"role": {"const": "assistant"}, "content": {"type": "string"}}}}})
_CHUNK = {"type": "object", "required": ["id", "object", "created", "model", "choices"],
          "properties": {"id": {"type": "string"}, "created": {"type": "integer"}, "model": {"type": "string"},
                         "object": {"enum": ["text_completion", "chat.completion.chunk"]}, "usage": _USAGE,
                         "choices": {"type": "array", "maxItems": 1, "items": {
                             "type": "object", "required": ["index", "finish_reason"],
                             "properties": {"index": {"const": 0}, "finish_reason": {"enum": [None, "stop", "length"]},
                                            "text": {"type": "string"}, "token_ids": _TOKEN_IDS,
                                            "delta": {"type": "object",
                                                      "properties": {"content": {"type": "string"}}}}}}}}
# OpenAPI 3.1 has a text/event-stream `schema` describe one event: its data is a chunk, the error
# object (a failure after the 200 went out), or the closing [DONE].
_SSE = {"text/event-stream": {"schema": {
    "type": "object", "required": ["data"],
    "description": "data: <chunk JSON> events, then data: [DONE]",
    "properties": {"data": {"anyOf": [
        {"const": "[DONE]"},
        {"type": "string", "contentMediaType": "application/json", "contentSchema": {"anyOf": [_CHUNK, ERROR]}},
    ]}},
}}}


def _generating(reply: dict[str, Any]) -> Callable[[ModelLimits], dict[str, Any]]:
    def responses(ctx: ModelLimits) -> dict[str, Any]:
        ok = {"description": "the reply, or with stream: true server-sent events",
              "content": {"application/json": {"schema": reply}, **_SSE}}
        return {"200": ok, **error_responses(400, 413, 429, 500, 503)}
    return responses


def _plain(description: str, media: str, schema: dict[str, Any], *errors: int):
    return lambda ctx: {"200": {"description": description, "content": {media: {"schema": schema}}},
                        **error_responses(*errors)}


_MODEL = {"type": "object", "required": ["id", "object", "created", "owned_by"],
          "properties": {"id": {"type": "string"}, "object": {"const": "model"}, "created": {"type": "integer"},
                         "owned_by": {"type": "string"}}}
_MODELS = {"type": "object", "required": ["object", "data"],
           "properties": {"object": {"const": "list"}, "data": {"type": "array", "items": _MODEL}}}
_MODEL_ID = {"name": "model", "in": "path", "required": True, "description": "the served name (a repo id's slash as it is)",
             "schema": {"type": "string"}}
_HEALTH = {"description": "ok while the engine can serve", "content": {"text/plain": {"schema": {"const": "ok"}}}}
_LAST = {"name": "last", "in": "query", "required": False, "description": "keep only the N most recent requests",
         "schema": {"type": "integer", "minimum": 1}}


def _health(ctx: ModelLimits) -> dict[str, Any]:
    unavailable = error_responses(503)["503"]
    return {"200": _HEALTH, "503": {**unavailable, "description": "the engine has failed: take the server out"}}


def operations() -> list[Operation]:
    """Every route this server serves. A new route's Operation is added here."""
    return [
        Operation("/v1/completions", "post", "OpenAI Completions", _generating(_COMPLETION_REPLY),
                  body=lambda ctx: fields.body_schema(fields.COMPLETION, ("model", "prompt"), ctx),
                  operation_id="completions"),
        Operation("/v1/chat/completions", "post", "OpenAI Chat Completions", _generating(_CHAT_REPLY),
                  body=lambda ctx: fields.body_schema(fields.CHAT, ("model", "messages"), ctx),
                  operation_id="chat_completions"),
        Operation("/v1/systemone", "post", "System One: typed decisions read from next-token logits",
                  lambda ctx: {"200": {"description": "the answers, under the request's names and in its order",
                                       "content": {"application/json": {"schema": systemone_schema.REPLY}}},
                               **error_responses(400, 413, 429, 500, 503)},
                  body=systemone_schema.body_schema, operation_id="systemone"),
        Operation("/v1/models", "get", "The one model served", _plain("the model list", "application/json", _MODELS),
                  operation_id="models"),
        Operation("/v1/models/{model}", "get", "OpenAI's retrieve-model route: the served model, 404 for any other",
                  lambda ctx: {"200": {"description": "the model", "content": {"application/json": {"schema": _MODEL}}},
                               "404": {"description": "no model of that id is served (code model_not_found)",
                                       "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}},
                  operation_id="models_retrieve"),
        Operation("/healthz", "get", "Liveness for a load balancer", _health, operation_id="healthz"),
        Operation("/health", "get", "Same as /healthz", _health, operation_id="health"),
        Operation("/metrics", "get", "Prometheus text",
                  _plain("the metrics", "text/plain", {"type": "string"}), operation_id="metrics"),
        Operation("/debug/requests", "get", "The replay ring: recent requests' telemetry, never text",
                  _plain("the ring", "application/json",
                         {"type": "object", "required": ["object", "ring", "data"],
                          "properties": {"object": {"const": "list"}, "ring": {"type": "integer"},
                                         "data": {"type": "array", "items": {"type": "object"}}}}, 400),
                  operation_id="debug_requests"),
        Operation("/debug/trace", "get", "The ring as a trace, JSON lines",
                  _plain("the trace", "application/x-ndjson", {"type": "string"}, 400),
                  operation_id="debug_trace"),
        Operation("/openapi.json", "get", "This document",
                  _plain("the document", "application/json", {"type": "object"}), operation_id="openapi"),
    ]


def document(ctx: ModelLimits, *, extra: tuple[Operation, ...] = ()) -> dict[str, Any]:
    """The OpenAPI 3.1 document for a server of this model."""
    paths: dict[str, Any] = {}
    for op in [*operations(), *extra]:
        item: dict[str, Any] = {"summary": op.summary, "operationId": op.operation_id or op.path,
                                "responses": op.responses(ctx)}
        if op.body is not None:
            item["requestBody"] = {"required": True,
                                   "content": {"application/json": {"schema": op.body(ctx)}}}
        if op.path.startswith("/debug/"):
            item["parameters"] = [_LAST]
        if "{model}" in op.path:
            item["parameters"] = [_MODEL_ID]
        paths.setdefault(op.path, {})[op.method] = item
    return {
        "openapi": "3.1.0",
        "info": {"title": "caldrix", "version": _version(),
                 "description": f"OpenAI-compatible server for {ctx.served_name}; no API key."},
        "paths": paths,
        "components": {"schemas": {"Error": ERROR}},
    }


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("caldrix")
    except Exception:  # not installed: run from a checkout
        return "0"


@bp.get("/openapi.json")
async def openapi_json():
    from caldrix.routes.responses import json_response
    from caldrix.routes.completions import limits

    rt = current_app.extensions["caldrix"][0]
    return json_response(document(limits(rt)))
