"""GET /healthz, /health and /v1/models."""

from __future__ import annotations

from quart import Blueprint, Response, current_app

from caldrix.routes.responses import json_response

bp = Blueprint("health", __name__)


def runtime():
    return current_app.extensions["caldrix"][0]


@bp.get("/healthz")
@bp.get("/health")
async def healthz():
    return Response("ok", mimetype="text/plain")


@bp.get("/v1/models")
async def models():
    rt = runtime()
    return json_response({"data": [{"id": rt.served_name, "object": "model", "owned_by": "caldrix"}], "object": "list"})
