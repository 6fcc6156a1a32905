"""GET /healthz, /health and /v1/models."""

from __future__ import annotations

from quart import Blueprint, Response, current_app

from caldrix.routes.errors import ApiError
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


@bp.get("/v1/models")
async def models():
    rt = runtime()
    return json_response({"data": [{"id": rt.served_name, "object": "model", "owned_by": "caldrix"}], "object": "list"})
