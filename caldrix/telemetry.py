"""The replay ring: one record per recent request, its trace export, and the per-request log line.

A record carries timings, token counts, sampling settings with the seed, the prefix rows reused
and the batch sizes seen; never text and never token ids. Prompt sharing survives only as
salted block digests (`block_digests`), computed from the prompt ids when the request finishes
and kept instead of them.

A request's record has two halves, joined here by request id:
- the scheduler's, from `on_finish` (the Scheduler's hook, called synchronously with the
  finished Sequence): timings, counts, prefix rows, batch sizes, digests;
- the route's, from `route_done`: the route, the status the client got and the finish reason
  it saw (a stop string ends a generation the scheduler only sees as abandoned).
Whichever comes first waits in a bounded table for the other. Requests refused at submission
(429, 503) have no scheduler half and are recorded whole by `refused`.

Ownership: a Telemetry belongs to one server and is only called from its trio thread (the
scheduler task and the HTTP handlers), so it needs no lock. Image requests (submitted with
reuse_prefix False, the only ones that are) are counted in the metrics but never captured.
"""

from __future__ import annotations

import collections
import hashlib
import logging
import secrets
import struct
import time
from typing import TYPE_CHECKING, Iterable, Iterator

import attrs

from caldrix.metrics import Metrics
from caldrix.protocol import FinishReason, SamplingParams

if TYPE_CHECKING:
    from caldrix.sched.sequence import Sequence

log = logging.getLogger("caldrix.request")

BLOCK_TOKENS = 16  # tokens per digested block
DIGEST_BYTES = 8  # 16 hex characters per digest
TRACE_VERSION = 1


def block_digests(ids: tuple[int, ...], salt: bytes, block: int = BLOCK_TOKENS) -> tuple[str, ...]:
    """Chained, salted digests of the prompt's blocks of `block` tokens (the last may be shorter).

    Digest i covers tokens [0, block * (i + 1)): it hashes digest i-1 with block i, so two prompts
    have the same digest i exactly when they agree on everything up to the end of block i. Without
    the salt (random per server, never shown) a digest cannot be tested against guessed tokens.
    """
    out: list[str] = []
    prev = b""
    for start in range(0, len(ids), block):
        chunk = ids[start:start + block]
        h = hashlib.blake2b(prev + struct.pack(f"<{len(chunk)}I", *chunk), key=salt, digest_size=DIGEST_BYTES)
        prev = h.digest()
        out.append(h.hexdigest())
    return tuple(out)


@attrs.frozen
class RequestRecord:
    """One request in the replay ring. Times are seconds; `queued`, `first_token` and `end` count
    from `arrived` (None when the request never got that far)."""

    id: str
    route: str
    status: int | None  # None: the route's half never came (see Telemetry.pending_max)
    finish_reason: str | None  # None: refused before generating
    arrived: float  # Unix time
    queued: float | None
    first_token: float | None
    end: float | None
    prompt_tokens: int
    completion_tokens: int  # reply tokens the server generated
    max_tokens: int
    sampling: SamplingParams
    prefix_rows: int
    batch_sizes: tuple[tuple[int, int], ...]  # (sequences in the step, steps), by size
    stream: bool
    blocks: tuple[str, ...]  # block_digests of the prompt: in the trace, not in /debug/requests
    speculative: tuple[int, int] | None = None  # (proposed, accepted) guesses; None: did not speculate
    sampler: str = "cpu"  # the pick of sampled tokens: "cpu" (run.md) or "device" (the AMD lane's)
    # The end of sequence was an ordinary token (the request's ignore_eos, or a model without
    # one): with the sampling settings, what it takes to reproduce the reply.
    ignore_eos: bool = False

    def to_json(self) -> dict:
        """The /debug/requests form: everything but the digests."""
        return {
            "id": self.id,
            "route": self.route,
            "status": self.status,
            "finish_reason": self.finish_reason,
            "arrived": round(self.arrived, 6),
            "timings": {"queued": _r(self.queued), "first_token": _r(self.first_token), "end": _r(self.end)},
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "max_tokens": self.max_tokens,
            "ignore_eos": self.ignore_eos,
            "sampling": sampling_json(self.sampling),
            "prefix_rows": self.prefix_rows,
            "batch_sizes": [list(p) for p in self.batch_sizes],
            "stream": self.stream,
            "speculative": _spec_json(self.speculative),
            "sampler": self.sampler,
        }

    def trace_json(self, t0: float) -> dict:
        """One line of a trace: a request of the workload, arriving `arrival` s after the first."""
        return {
            "arrival": round(self.arrived - t0, 6),
            "id": self.id,
            "route": self.route,
            "status": self.status,
            "finish_reason": self.finish_reason,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "max_tokens": self.max_tokens,
            "sampling": sampling_json(self.sampling),
            "stream": self.stream,
            "blocks": list(self.blocks),
            "prefix_rows": self.prefix_rows,
            "timings": {"queued": _r(self.queued), "first_token": _r(self.first_token), "end": _r(self.end)},
        }


def _spec_json(spec: tuple[int, int] | None) -> dict | None:
    return None if spec is None else {"proposed": spec[0], "accepted": spec[1]}


def sampling_json(s: SamplingParams) -> dict:
    return {
        "temperature": s.temperature,
        "top_k": s.top_k,
        "top_p": s.top_p,
        "min_p": s.min_p,
        "repetition_penalty": s.repetition_penalty,
        "seed": s.seed,
    }


def _r(t: float | None) -> float | None:
    return None if t is None else round(t, 6)


@attrs.frozen
class _SchedHalf:
    id: str
    captured: bool
    finish: str
    arrived: float
    queued: float | None
    first_token: float | None
    end: float
    prompt_tokens: int
    completion_tokens: int
    max_tokens: int
    sampling: SamplingParams
    prefix_rows: int
    batch_sizes: tuple[tuple[int, int], ...]
    blocks: tuple[str, ...]
    speculative: tuple[int, int] | None
    sampler: str
    ignore_eos: bool


@attrs.frozen
class _RouteHalf:
    route: str
    status: int
    finish: str | None  # what the client saw; None: the client left, take the scheduler's
    stream: bool
    at: float  # Unix time the route answered or its client left


def _unix(mono: float, now_mono: float, now_unix: float) -> float:
    return now_unix - (now_mono - mono)


def _batch_histogram(sizes: Iterable[int]) -> tuple[tuple[int, int], ...]:
    return tuple(sorted(collections.Counter(sizes).items()))


@attrs.define(eq=False)
class Telemetry:
    metrics: Metrics
    ring: collections.deque  # of RequestRecord, maxlen --replay-ring
    salt: bytes = attrs.field(factory=lambda: secrets.token_bytes(16), repr=False)
    block_tokens: int = BLOCK_TOKENS
    header: dict = attrs.Factory(dict)  # facts about the server for the trace's first line
    pending_max: int = 4096  # halves waiting for their partner; the oldest is completed as is
    sampler: str = "cpu"  # which pick this server's sampled tokens go through (lanes.sampler_name)
    _pending: collections.OrderedDict = attrs.Factory(collections.OrderedDict)

    @classmethod
    def create(cls, model_name: str, ring_size: int, sampler: str = "cpu", **header) -> "Telemetry":
        return cls(Metrics(model_name), collections.deque(maxlen=ring_size),
                   header={"served_name": model_name, "sampler": sampler, **header},
                   pending_max=max(1024, 4 * ring_size), sampler=sampler)

    # --- the scheduler's half -------------------------------------------------------------

    def on_finish(self, seq: "Sequence") -> None:
        """The Scheduler's on_finish hook: observe the latencies and keep the scheduler's half."""
        now = time.monotonic()
        sub = seq.sub
        m = self.metrics
        admitted = seq.t_admitted > 0
        first = seq.t_first_token if seq.t_first_token > 0 else None
        if admitted:  # one that never was is observed at the join: its client may have left long before
            m.e2e.observe(now - sub.arrived)
            m.queue_time.observe(seq.t_admitted - sub.arrived)
            m.prompt_tokens.inc(len(sub.prompt_ids))
            m.prompt_size.observe(len(sub.prompt_ids))
            m.prefix_queries.inc(len(sub.prompt_ids))
            m.prefix_hits.inc(seq.prefix_rows)
        if first is not None:
            m.ttft.observe(first - sub.arrived)
            m.prefill_time.observe(first - seq.t_admitted)
            m.decode_time.observe(now - first)
        times = seq.t_tokens
        for a, b in zip(times, times[1:]):
            m.itl.observe(b - a)
        if not sub.is_read_only:
            m.generation_tokens.inc(len(seq.output))
            m.reply_size.observe(len(seq.output))
        if seq.speculating:
            m.spec_drafts.inc(seq.proposed)
            m.spec_accepted.inc(seq.accepted)
        captured = sub.reuse_prefix  # image requests, the only ones without it, are never captured
        half = _SchedHalf(
            id=sub.request_id,
            captured=captured,
            finish=(seq.finish or FinishReason.ABORT).value,
            arrived=_unix(sub.arrived, now, time.time()),
            queued=seq.t_admitted - sub.arrived if admitted else None,
            first_token=first - sub.arrived if first is not None else None,
            end=now - sub.arrived,
            prompt_tokens=len(sub.prompt_ids),
            completion_tokens=len(seq.output),
            max_tokens=sub.max_tokens,
            sampling=sub.sampling,
            prefix_rows=seq.prefix_rows,
            batch_sizes=_batch_histogram(seq.batch_sizes) if captured else (),
            blocks=block_digests(sub.prompt_ids, self.salt, self.block_tokens) if captured else (),
            speculative=(seq.proposed, seq.accepted) if seq.speculating and seq.proposed else None,
            sampler=self.sampler,
            ignore_eos=not sub.is_read_only and not sub.stop_token_ids,
        )
        other = self._pending.pop(sub.request_id, None)
        if isinstance(other, _RouteHalf):
            self._join(half, other)
        else:
            self._wait(sub.request_id, half)

    # --- the route's half -----------------------------------------------------------------

    def route_done(self, rid: str, *, route: str, status: int, finish: FinishReason | None, stream: bool) -> None:
        """The route has answered (or the client has left): its status and visible finish."""
        half = _RouteHalf(route, status, finish.value if finish is not None else None, stream, time.time())
        other = self._pending.pop(rid, None)
        if isinstance(other, _SchedHalf):
            self._join(other, half)
        else:
            self._wait(rid, half)

    def refused(self, rid: str, *, route: str, status: int, prompt_ids: tuple[int, ...], max_tokens: int,
                sampling: SamplingParams, stream: bool, ignore_eos: bool, captured: bool = True) -> None:
        """A request refused at submission (429 queue full, 503 engine gone): never scheduled."""
        rec = RequestRecord(
            id=rid, route=route, status=status, finish_reason=None, arrived=time.time(),
            queued=None, first_token=None, end=None, prompt_tokens=len(prompt_ids), completion_tokens=0,
            max_tokens=max_tokens, sampling=sampling, prefix_rows=0, batch_sizes=(), stream=stream,
            blocks=block_digests(prompt_ids, self.salt, self.block_tokens) if captured else (),
            sampler=self.sampler, ignore_eos=ignore_eos,
        )
        if captured:
            self.ring.append(rec)
        _log(rec)

    # --- reading --------------------------------------------------------------------------

    def records(self, last: int | None = None) -> list[RequestRecord]:
        """The ring, oldest first; `last` keeps only the most recent ones."""
        recs = list(self.ring)
        return recs[-last:] if last else recs

    def trace(self, last: int | None = None) -> Iterator[dict]:
        """The ring as a workload: a header, then one request per line in arrival order."""
        recs = sorted(self.records(last), key=lambda r: r.arrived)
        t0 = recs[0].arrived if recs else 0.0
        yield {"trace": "caldrix", "version": TRACE_VERSION, "block_tokens": self.block_tokens,
               "requests": len(recs), "started": round(t0, 3), **self.header}
        for rec in recs:
            yield rec.trace_json(t0)

    # --- internals ------------------------------------------------------------------------

    def _wait(self, rid: str, half: _SchedHalf | _RouteHalf) -> None:
        self._pending[rid] = half
        while len(self._pending) > self.pending_max:
            _, stale = self._pending.popitem(last=False)
            if isinstance(stale, _SchedHalf):  # its route never reported: record what is known
                self._join(stale, None)

    def _join(self, s: _SchedHalf, r: _RouteHalf | None) -> None:
        finish = (r.finish if r is not None else None) or s.finish
        self.metrics.finished(finish)
        end = s.end
        if s.queued is None:
            # Never admitted: a client that left while queued ended its request then, though the
            # scheduler only found the abandoned submission when it took it off the channel.
            if r is not None:
                end = min(end, max(0.0, r.at - s.arrived))
            self.metrics.e2e.observe(end)
        rec = RequestRecord(
            id=s.id, route=r.route if r else "", status=r.status if r else None, finish_reason=finish,
            arrived=s.arrived, queued=s.queued, first_token=s.first_token, end=end,
            prompt_tokens=s.prompt_tokens, completion_tokens=s.completion_tokens, max_tokens=s.max_tokens,
            sampling=s.sampling, prefix_rows=s.prefix_rows, batch_sizes=s.batch_sizes,
            stream=r.stream if r else False, blocks=s.blocks, speculative=s.speculative, sampler=s.sampler,
            ignore_eos=s.ignore_eos,
        )
        if s.captured:
            self.ring.append(rec)
        _log(rec)


def _log(rec: RequestRecord) -> None:
    """The one log line of a request: id, status, token counts and timings; never text."""
    def t(v: float | None) -> str:
        return "-" if v is None else f"{v:.3f}s"

    log.info("request %s %s status=%s finish=%s prompt=%d completion=%d prefix=%d queued=%s ttft=%s e2e=%s",
             rec.id, rec.route or "-", rec.status if rec.status is not None else "-", rec.finish_reason or "-",
             rec.prompt_tokens, rec.completion_tokens, rec.prefix_rows, t(rec.queued), t(rec.first_token), t(rec.end))


def sharing_signature(lines: Iterable[dict]) -> list[tuple[int, ...]]:
    """A trace's prefix sharing with the salt taken out: each digest replaced by the order in
    which it first appears. Two traces of the same workload (any salts) have equal signatures."""
    seen: dict[str, int] = {}
    return [tuple(seen.setdefault(d, len(seen)) for d in line["blocks"]) for line in lines]
