"""GET /metrics, GET /debug/requests and GET /debug/trace, and the routes' side of telemetry.

- /metrics: Prometheus text (metrics.py), from this server's own registry.
- /debug/requests: the replay ring as JSON, oldest first: {"object": "list", "ring": N, "data": [...]}.
- /debug/trace: the ring exported as a trace, JSON lines (a header line, then one request a line).
  Both take `?last=N` to keep only the N most recent requests.

The generation routes call `tracked` (wraps their piece stream, reports the outcome) and
`refuse` (a 429 or 503 at submission). An after-request hook counts every response by handler,
method and status, and writes the log line of a refused POST that never got a request id.
"""

from __future__ import annotations

import logging
import weakref
from typing import AsyncIterator

import orjson
import trio
from quart import Blueprint, Response, current_app, g, request

from caldrix.routes.responses import json_response
from caldrix.generate import EngineFailed, EngineStopped, GenRequest, Piece
from caldrix.metrics import CONTENT_TYPE
from caldrix.protocol import FinishReason
from caldrix.routes.errors import ApiError
from caldrix.telemetry import Telemetry

log = logging.getLogger("caldrix.request")
bp = Blueprint("debug", __name__)


@bp.record_once
def _wire(state) -> None:
    """Point the scrape-time gauges at the scheduler and the request queue."""
    rt, queue = state.app.extensions["caldrix"]
    rt.telemetry.metrics.read_live_from(lambda: rt.scheduler.statistics(queue.waiting()))


def _telemetry() -> Telemetry:
    return current_app.extensions["caldrix"][0].telemetry


LAST_ALL = 10**9  # `?last=` past nine digits: more than any ring holds


def _last() -> int | None:
    raw = request.args.get("last")
    if raw is None:
        return None
    # ASCII digits only: int() would also take " 1", "1_0" and other scripts' digits. Past
    # nine digits it is more than any ring holds: all of them (and int() of a huge one is slow).
    if not (raw.isascii() and raw.isdigit()):
        last = -1
    else:
        last = int(raw) if len(raw) <= 9 else LAST_ALL
    if last < 1:
        raise ApiError.invalid(f"must be an integer >= 1, got {raw!r}", "last")
    return last


@bp.get("/metrics")
async def metrics():
    return Response(_telemetry().metrics.render(), content_type=CONTENT_TYPE)


@bp.get("/debug/requests")
async def debug_requests():
    tel = _telemetry()
    return json_response({"object": "list", "ring": tel.ring.maxlen, "data": [r.to_json() for r in tel.records(_last())]})


@bp.get("/debug/trace")
async def debug_trace():
    body = b"".join(orjson.dumps(line) + b"\n" for line in _telemetry().trace(_last()))
    return Response(body, content_type="application/x-ndjson")


@bp.after_app_request
async def _count(response: Response) -> Response:
    rule = request.url_rule.rule if request.url_rule is not None else "unmatched"
    status = response.status_code
    _telemetry().metrics.response(rule, request.method, status)
    if request.method == "POST" and status >= 400 and g.get("caldrix_request_id") is None:
        log.info("request - %s status=%d", rule, status)  # refused before it had an id
    return response


# --- the generation routes' side --------------------------------------------------------------


def _route() -> str:
    return request.url_rule.rule if request.url_rule is not None else request.path


def refuse(rid: str, gen: GenRequest, status: int, *, stream: bool, read_only: bool = False) -> None:
    """Record a request refused at submission (429 queue full, 503 engine unavailable). An image
    request (one with embeddings) is logged and counted but never enters the replay ring.
    `read_only`: a /v1/systemone probe, which generates nothing (so ignores no end of sequence)."""
    g.caldrix_request_id = rid
    _telemetry().refused(rid, route=_route(), status=status, prompt_ids=gen.prompt_ids, max_tokens=gen.max_tokens,
                         sampling=gen.sampling, stream=stream, ignore_eos=not read_only and not gen.stop_token_ids,
                         captured=not gen.embeds)


def tracked(rid: str, pieces: AsyncIterator[Piece], events, *, stream: bool) -> AsyncIterator[Piece]:
    """Wrap a request's piece stream: when it ends, however it ends, the route's half of the
    record (route, status, the finish the client saw) goes to telemetry. Call in the request
    context; close the result like the stream it wraps.

    A streamed response whose client left before its body was first iterated (quart cancels
    the handler at the response's first send) leaves the generator unstarted, and an unstarted
    generator's finally never runs: the scheduler went on generating to max_tokens into
    `events` (the request's receive channel) and the record never ended. So when the result is
    collected unstarted, `events` is closed (the scheduler frees the slot at its next step) and
    the route's half goes to telemetry as a client that left."""
    g.caldrix_request_id = rid
    return watched(_telemetry(), rid, _route(), pieces, events, stream)


def watched(tel: Telemetry, rid: str, route: str, pieces: AsyncIterator[Piece], events,
            stream: bool) -> AsyncIterator[Piece]:
    """tracked's generator, outside a request context (the tests call it directly). Call on
    the trio thread."""
    started = [False]
    gen = _watch(tel, rid, route, pieces, stream, started)
    # The collector can run on any thread (whichever allocates), and in the middle of anything:
    # the report is handed to the trio thread. Not at interpreter exit, after the run.
    fin = weakref.finalize(gen, _never_iterated, trio.lowlevel.current_trio_token(), tel, rid, route, events,
                           stream, started)
    fin.atexit = False
    return gen


def _never_iterated(token, tel: Telemetry, rid: str, route: str, events, stream: bool, started: list[bool]) -> None:
    """A generator collected unstarted (a started one is closed by trio's async generator
    hooks, and its finally reports)."""
    if started[0]:
        return

    def report() -> None:
        events.close()
        tel.route_done(rid, route=route, status=200 if stream else 499, finish=None, stream=stream)

    try:
        token.run_sync_soon(report)
    except trio.RunFinishedError:
        pass


async def _watch(tel: Telemetry, rid: str, route: str, pieces: AsyncIterator[Piece], stream: bool,
                 started: list[bool]):
    started[0] = True
    finish: FinishReason | None = None
    failed = stopped = False
    try:
        async for piece in pieces:
            if piece.finish is not None:
                finish = piece.finish
            yield piece
    except EngineFailed:
        failed = True
        raise
    except EngineStopped:  # ended by the server's shutdown
        stopped = True
        raise
    finally:
        # Report before awaiting anything: a cancelled handler gets no further checkpoint.
        if failed:
            status, finish = (200 if stream else 500), FinishReason.ERROR
        elif stopped:
            status, finish = (200 if stream else 503), FinishReason.ABORT
        elif finish is not None:
            status = 200
        else:  # the client left: a stream's 200 was already sent; 499 as nginx logs it
            status = 200 if stream else 499
        tel.route_done(rid, route=route, status=status, finish=finish, stream=stream)
        await pieces.aclose()
