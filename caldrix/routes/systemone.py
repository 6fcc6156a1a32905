"""POST /v1/systemone: typed decisions read from next-token logits (http-api.md).

Flow: read the body (413 over the server's limit) -> parse it keeping number lexemes, refusing
duplicate keys -> validate every question (400) -> the server and model checks (param null) ->
build and tokenize every prompt, checking each fits the context (400) -> run the probes one at
a time through the request queue as read-only submissions (429 for the whole request when the
queue is full, 503 when the engine has stopped, 500 when it failed or a reading is not finite)
-> the answers, in the request's order.

A request of several probes sharing their first ids (the decider's state piece, Probe.shared)
gets a StateLease: the first probe keeps the model's state at the end of those ids, the later
ones start from it, and usage counts what was read; the lease is released in the handler's
finally, however it ends, and the scheduler task drops the kept state.

Each probe is its own scheduler request with its own id ("so-7.0", "so-7.1", ...), so the
replay ring and /metrics count every one; their records carry the status the client got.
"""

from __future__ import annotations

import itertools
import json
import logging

import trio
from quart import Blueprint, current_app, g

from caldrix.decider.systemone import DeciderReading
from caldrix.routes.responses import json_response
from caldrix.generate import EngineStopped, GenRequest, QueueFull, submit
from caldrix.protocol import FinishReason, SamplingParams, StateLease
from caldrix.request_queue import RequestQueue
from caldrix.routes import backoff
from caldrix.routes.debug import refuse
from caldrix.routes.errors import ApiError
from caldrix.routes.prompt_ids import LIMITER_KEY, check_in_vocab, parsed
from caldrix.systemone import jsonlex
from caldrix.systemone.reading import NotFinite, Plan, Probe, Reading, ZeroShot, answer
from caldrix.systemone.request import parse_body, parse_request

log = logging.getLogger("caldrix.systemone")
bp = Blueprint("systemone", __name__)
ROUTE = "/v1/systemone"
NEEDS_SINGLE_STREAM = "/v1/systemone needs --max-batch 1"
_ids = itertools.count(1)
_lease_keys = itertools.count(1)  # the engine's snapshot keys: only this route takes any


def reading_for(rt) -> Reading:
    """The server's reading, made on first use and kept: the decider reading when the model
    directory held a decider_config.json at load (rt.decider), else the zero-shot one."""
    ext = current_app.extensions
    reading = ext.get("caldrix.systemone")
    if reading is None:
        decider = getattr(rt, "decider", None)
        vision = ext.get("caldrix.vision") is not None  # its template reads content parts, as chat sends them
        reading = (DeciderReading(decider) if decider is not None
                   else ZeroShot(rt.tokenizer, rt.vocab_size, parts=vision))
        ext["caldrix.systemone"] = reading
    return reading


@bp.post(ROUTE)
async def systemone():
    rt, queue = current_app.extensions["caldrix"]
    reading = reading_for(rt)
    req = await parsed(lambda raw: parse_request(parse_body(raw), rt.served_name, reading.limits))
    if rt.cfg.max_batch > 1:
        raise ApiError.invalid(NEEDS_SINGLE_STREAM, None)
    reading.check_model()
    for q in req.questions:
        reading.check_question(q)
    # Rendering and tokenizing 64 prompts of a long state takes a while: off the event loop.
    plans = await trio.to_thread.run_sync(reading.plan, req, rt.context, limiter=current_app.extensions[LIMITER_KEY])
    for plan in plans:
        for probe in plan.probes:
            check_in_vocab(probe.ids, rt.vocab_size, rt.tokenizer, None)  # the model's fault, not a field's
    if rt.scheduler.failed:
        raise ApiError.engine_unavailable()

    base = f"so-{next(_ids)}"
    g.caldrix_request_id = base
    lease = _lease_for(rt, plans)
    ran: list[str] = []  # probes the scheduler took: their records get the route's half
    status = 499  # left as is only when the client went away (the handler was cancelled)
    try:
        answers, tokens = {}, 0
        for plan in plans:
            reads = []
            for probe in plan.probes:
                rid = f"{base}.{len(ran)}"
                if probe.text and log.isEnabledFor(logging.DEBUG):  # text only when asked for
                    log.debug("%s question %s prompt %s", rid, plan.question.name, json.dumps(probe.text))
                keep = lease is not None and not ran
                read, reused = await _read(rt, queue, rid, probe, ran, lease, keep)
                reads.append(read)
                tokens += probe.counted - reused
            try:
                p = reading.probabilities(plan, reads)
            except NotFinite:
                raise ApiError(500, f'the engine gave no usable reading for question "{plan.question.name}": '
                                    "a probability is not a finite number") from None
            answers[plan.question.name] = answer(plan.question, p, jsonlex.echo)
        status = 200
    except ApiError as err:
        status = err.status
        raise
    except Exception:
        status = 500
        raise
    finally:
        # No await here: a cancelled handler gets no further checkpoint.
        if lease is not None:
            lease.released = True  # the scheduler task drops the kept state
        for rid in ran:
            # a client that left sees its questions aborted, as a completion's would be (499, abort)
            finish = {200: FinishReason.STOP, 499: FinishReason.ABORT}.get(status)
            rt.telemetry.route_done(rid, route=ROUTE, status=status, finish=finish, stream=False)
    return json_response({"model": rt.served_name, "answers": answers,
                          "usage": {"input_tokens": tokens, "output_tokens": 0}})


def _lease_for(rt, plans: list[Plan]) -> StateLease | None:
    """A kept state for a request of several probes that share their first ids (the decider's
    state), on an engine that keeps snapshots; None otherwise (every probe read whole)."""
    probes = [p for plan in plans for p in plan.probes]
    shared = probes[0].shared if probes else 0
    if len(probes) < 2 or shared <= 0 or any(p.shared != shared for p in probes):
        return None
    if not callable(getattr(rt.engine, "snapshot", None)):
        return None
    return StateLease(next(_lease_keys), shared)


async def _read(rt, queue: RequestQueue, rid: str, probe: Probe, ran: list[str],
                lease: StateLease | None = None, keep: bool = False) -> tuple[tuple[float, ...], int]:
    """Submit one read-only probe and wait for its logits: (the read, the prompt tokens it
    did not read because it started from the lease's kept state)."""
    gen = GenRequest(request_id=rid, prompt_ids=probe.ids, max_tokens=1, sampling=SamplingParams(),
                     stop_token_ids=frozenset())
    try:
        rx = submit(queue, gen, read_ids=probe.read_ids, lease=lease, keep_state=keep)
    except QueueFull:
        refuse(rid, gen, 429, stream=False, read_only=True)
        wait = backoff.retry_after_s(rt.telemetry.records(), queue.waiting(), rt.cfg.max_batch)
        raise ApiError.queue_full(backoff.headers(wait)) from None
    except EngineStopped:
        refuse(rid, gen, 503, stream=False, read_only=True)
        raise ApiError.engine_unavailable() from None
    ran.append(rid)
    with rx:
        async for event in rx:
            if event.finish is FinishReason.ERROR:
                raise ApiError.engine_failed(event.error)
            if event.finish is FinishReason.ABORT:  # the server is shutting down
                raise ApiError(503, event.error or "the engine is unavailable")
            if event.finish is not None:
                if len(event.read) != len(probe.read_ids):
                    raise ApiError.engine_failed("the engine returned no reading")
                # A prompt of a lease reuses rows only from the kept state (never held rows).
                reused = event.prefix_rows if lease is not None and not keep else 0
                return event.read, reused
    raise ApiError.engine_failed("the engine stopped during the request")
