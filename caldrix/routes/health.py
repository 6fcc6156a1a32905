"""GET /healthz, /health and /v1/models."""

from __future__ import annotations

from quart import Blueprint, Response, current_app

from caldrix.routes.errors import ApiError, clip
from caldrix.routes.responses import json_response

bp = Blueprint("health", __name__)


def runtime():
    return current_app.extensions["caldrix"][0]


@bp.get("/healthz")
@bp.get("/health")
async def healthz():
    # A failed engine answers every request 503; say so here too, so a load balancer takes
    # the server out rather than keep sending it traffic.
    if runtime().scheduler.failed:
        return json_response(ApiError.engine_unavailable().body(), 503)
    return Response("ok", mimetype="text/plain")


def _model_object(rt) -> dict:
    # `created` (Unix seconds) is when this server loaded the model: OpenAI's Model type
    # requires the field, and vLLM and llama-server send it the same way.
    created = current_app.extensions.get("caldrix.created", 0)
    return {"id": rt.served_name, "object": "model", "created": created, "owned_by": "caldrix"}


@bp.get("/v1/models")
async def models():
    return json_response({"data": [_model_object(runtime())], "object": "list"})


@bp.get("/v1/models/<path:model>")
async def model(model: str):
    """OpenAI's retrieve-model route (`client.models.retrieve`): the served model, or a 404 in
    OpenAI's words for any other name. A repo id's slash may come as it is or as %2F."""
    rt = runtime()
    if model != rt.served_name:
        return json_response({"error": {"message": f"The model '{clip(model)}' does not exist", "type": "invalid_request_error",
                                        "param": "model", "code": "model_not_found"}}, 404)
    return json_response(_model_object(rt))
