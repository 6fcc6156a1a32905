"""JSON responses for the routes and the app's error handlers (kept out of app.py, which imports
the routes, so that the routes need not import it back)."""

from __future__ import annotations

import orjson
from quart import Response

from caldrix.routes.errors import ApiError


def json_response(obj: dict, status: int = 200) -> Response:
    return Response(orjson.dumps(obj), status=status, mimetype="application/json")


def error_response(err: ApiError) -> Response:
    resp = json_response(err.body(), err.status)
    resp.headers.update(err.headers)  # e.g. Retry-After on a 429
    return resp
