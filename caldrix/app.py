"""create_app(): the quart-trio application, its limits and its error shapes."""

from __future__ import annotations

import logging
import time

from quart import Response, request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException

from caldrix.routes import completions, debug, health, openapi, origins, prompt_ids, systemone
from caldrix.routes.errors import ApiError, clip
from caldrix.routes.responses import error_response, json_response  # noqa: F401 -- json_response: re-exported
from caldrix.request_queue import RequestQueue
from caldrix.runtime import Runtime

log = logging.getLogger("caldrix")

MAX_BODY = 4 * 2**20  # 4 MiB: a larger body is a 413, refused before it is read whole
VISION_MAX_BODY = 32 * 2**20  # a vision server's, on every route (http-api.md); about 24 MiB of images in base64
BODY_TIMEOUT_S = 300  # a body still arriving after this long is a 408 (a client that stalled mid-upload)


def create_app(rt: Runtime, queue: RequestQueue) -> QuartTrio:
    app = QuartTrio("caldrix")
    # "/v1//completions" is no route (a 404 in the error shape), as on vLLM's server: merged,
    # it was a 308 redirect with an HTML body, which routing sends past the error handlers.
    app.url_map.merge_slashes = False
    # A vision model's image state, with the one server-wide image decode limiter: made here,
    # under serve()'s root nursery, and shared by every request handler.
    vision = None
    if getattr(getattr(rt, "engine", None), "takes_images", False):
        from caldrix.vision.serving import VisionServing

        vision = VisionServing.load(rt.model_dir, rt.tokenizer.hf.convert_tokens_to_ids, rt.cfg.queue_depth,
                                    getattr(rt.engine, "pixel_dtype", None))
    max_body = VISION_MAX_BODY if vision is not None else MAX_BODY
    app.config["MAX_CONTENT_LENGTH"] = max_body
    app.extensions["caldrix.vision"] = vision
    if vision is not None:  # /metrics reads the image decode limiter at scrape time
        rt.telemetry.metrics.read_images_from(lambda: (vision.limiter.decoding, vision.limiter.waiting))
    # Quart's 60 s defaults would cut a long stream or a slow upload without an error.
    app.config["RESPONSE_TIMEOUT"] = None
    app.config["BODY_TIMEOUT"] = BODY_TIMEOUT_S
    app.extensions["caldrix"] = (rt, queue)
    app.extensions[prompt_ids.LIMITER_KEY] = prompt_ids.new_limiter()
    app.extensions["caldrix.created"] = int(time.time())  # /v1/models' `created`: the model loaded
    app.register_blueprint(health.bp)
    app.register_blueprint(completions.bp)
    app.register_blueprint(debug.bp)  # /metrics, /debug/*, and the response counter
    app.register_blueprint(systemone.bp)  # /v1/systemone
    app.register_blueprint(openapi.bp)  # /openapi.json

    @app.before_request
    async def refuse_ambiguous_framing():
        """A request carrying both Content-Length and Transfer-Encoding is a 400, and its
        connection is closed (RFC 9112 6.3: a server MUST close after such a request; it may
        refuse it). The two lengths can disagree, and a proxy in front that reads the other one
        would see a second request hidden in this one's body. No client sends both. It is the
        first check, so that no other refusal answers such a request and keeps its connection."""
        if "Content-Length" in request.headers and "Transfer-Encoding" in request.headers:
            return error_response(ApiError(
                400, "the request carries both Content-Length and Transfer-Encoding; send one", None,
                headers={"Connection": "close"}))
        return None

    # Browser origins (routes/origins.py): loopback pages and --allowed-origins; others a 403.
    extra_origins = tuple(getattr(getattr(rt, "cfg", None), "allowed_origins", ()) or ())

    @app.before_request
    async def check_origin():
        origin = request.headers.get("Origin")
        if origin is None:
            return None
        if not origins.allowed(origin, extra_origins):
            return error_response(origins.refusal(origin))
        if request.method == "OPTIONS" and "Access-Control-Request-Method" in request.headers:
            asked = request.headers.get("Access-Control-Request-Headers")
            return Response("", 204, headers=origins.preflight_headers(origin, asked))
        return None

    @app.before_request
    async def refuse_encoded_bodies():
        """A compressed body (Content-Encoding: gzip) is a 415 naming the encoding, as RFC 9110
        asks, before the body is read: parsed as it is, it read as "not UTF-8". No OpenAI client
        compresses its requests; a proxy or a hand-made one may."""
        coding = request.headers.get("Content-Encoding", "").strip().lower()
        if coding not in ("", "identity") and request.method not in ("GET", "HEAD", "OPTIONS"):
            # (the unread body is still on the wire, as for a 413: the connection closes)
            return error_response(ApiError(
                415, f"Content-Encoding {clip(coding, 40)} is not supported; send the body uncompressed", None,
                headers={"Accept-Encoding": "identity", "Connection": "close"}))
        return None

    @app.after_request
    async def name_the_origin(resp):
        origin = request.headers.get("Origin")
        if origin is not None and origins.allowed(origin, extra_origins):
            resp.headers["Access-Control-Allow-Origin"] = origin
            resp.headers["Vary"] = "Origin"
        return resp

    @app.errorhandler(ApiError)
    async def api_error(err: ApiError):
        return error_response(err)

    @app.errorhandler(HTTPException)
    async def http_error(err: HTTPException):
        status = err.code or 500
        if status == 413:
            # Refused before the body is read: the unread rest of it is still on the wire, so
            # the connection cannot carry another request. Close it, or a keep-alive client's
            # next request on it hangs.
            return error_response(ApiError.body_too_large(max_body, headers={"Connection": "close"}))
        messages = {404: "no such route", 405: "method not allowed on this route"}
        if err.description == type(err).description:  # werkzeug's stock text speaks of a browser
            messages |= {400: "the request could not be understood (a WebSocket upgrade, or malformed framing)",
                         408: "the request body did not arrive in time"}
        # A 408's body is still unread on the wire, as a 413's: the connection ends with it.
        headers = {"Connection": "close"} if status == 408 else None
        resp = error_response(ApiError(status, messages.get(status, err.description or err.name), None, headers=headers))
        allow = dict(err.get_headers()).get("Allow")
        if status == 405 and allow:  # RFC 9110: a 405 names the methods the route takes
            resp.headers["Allow"] = allow
        return resp

    @app.errorhandler(Exception)
    async def internal_error(err: Exception):
        log.exception("request failed")
        return error_response(ApiError(500, f"internal error: {type(err).__name__}", None))

    return app
