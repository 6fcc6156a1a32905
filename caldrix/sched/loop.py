"""The scheduler task: it receives, steps and emits. Its steps run on the lanes' step threads
(runners.py, threads.py); everything else in sched/ is synchronous.

Admission and backpressure: the scheduler takes a submission off the request channel only when a
slot is free for it, and whenever one is (also while a step runs: `_admitting`), so the channel
holds exactly the requests waiting beyond those running; the routes' side (request_queue.py)
answers 429 when --queue-depth of them wait. Taking one sets its `taken`, which ends its count
there; one whose client has left is dropped here as an abort.

Two lanes: decode steps are awaited inline; a prompt chunk runs as a task of the scheduler's own
nursery (`_prefill_lane`) and hands its output back on a channel of one. The loop applies both
outputs itself, so sequences and slots still have one owner (see `Scheduler`).
"""

from __future__ import annotations

import logging
import time
from typing import Awaitable, Callable, Protocol, TypeVar

import attrs
import trio

from caldrix.batch import Batch, StepOutput
from caldrix.protocol import FinishReason, StateLease, Submission, TokenEvent
from caldrix.sched.policy import Policy, Work
from caldrix.sched.sequence import Sequence, Status
from caldrix.sched.runners import DecodeLane, PrefillLane

log = logging.getLogger("caldrix")
T = TypeVar("T")

SHUTTING_DOWN = "the server is shutting down"
EMPTY_PROMPT = "the prompt is empty"


class StepEngine(Protocol):
    def step(self, batch: Batch) -> StepOutput: ...


StepRunner = Callable[[Callable[[Batch], StepOutput], Batch], Awaitable[StepOutput]]


@attrs.frozen
class SchedStats:
    running: int
    waiting: int
    free_slots: int
    held_rows: int
    steps: int
    kept_states: int = 0  # leases not yet dropped: /v1/systemone's states kept for later prompts


@attrs.frozen
class Landed:
    """What the prefill lane hands back to the loop: its Work and the step's output, or the
    exception the engine raised."""

    work: Work
    out: StepOutput | None
    error: Exception | None = None


def _prefill_runner(sched: "Scheduler") -> StepRunner:
    # A threaded decode lane gets a threaded prefill lane (sched/runners.py); a runner given by
    # a test (inline) serves both lanes.
    decode = sched.run_step
    return PrefillLane(decode) if isinstance(decode, DecodeLane) else decode


@attrs.define(eq=False)
class Scheduler:
    """The step scheduler: one task, two lanes.

    The decode lane steps every sequence past its prompt, one token each. The prefill lane runs
    prompt chunks. Where the engine allows it (`engine.overlap_lanes`: a CPU engine of two or
    more threads whose steps give the same bits on one, Engine.check_lanes) a chunk runs in
    its own thread while decode steps go on beside it, one core each, so a long prompt
    arriving does not stall the running streams' tokens; otherwise the loop waits for each chunk before the next decode step. Only this task touches
    sequences and slots: the prefill lane's task just runs the step and hands back a Landed.
    """

    engine: StepEngine
    policy: Policy
    run_step: StepRunner = attrs.field(factory=DecodeLane)  # the decode lane
    run_prefill: StepRunner = attrs.field(default=attrs.Factory(_prefill_runner, takes_self=True))
    on_finish: Callable[[Sequence], None] | None = None  # telemetry hook, called synchronously
    failed: str | None = None  # set once the engine has failed: the server answers 503
    # Set (by the server's shutdown watchdog) to end every running request now, cleanly.
    cutoff: trio.Event = attrs.Factory(trio.Event)
    _steps: int = 0
    _in_flight: Work | None = None  # the prefill Work whose step is running now
    # Leases (Submission.lease) whose snapshots the engine may hold, by key: dropped once the
    # route releases them and no step is in flight (the engine's snapshot table is not
    # touched while a step thread runs).
    _leases: dict[int, StateLease] = attrs.Factory(dict)

    def statistics(self, queued: int = 0) -> SchedStats:
        slots = self.policy.slots
        return SchedStats(len(self.policy.running), queued, slots.num_free, slots.rows_held(), self._steps,
                          len(self._leases))

    @property
    def overlap(self) -> bool:
        return bool(getattr(self.engine, "overlap_lanes", False))

    async def run(self, requests: trio.MemoryReceiveChannel[Submission], *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Serve submissions until the request channel is closed and the running ones end.

        On an engine failure every running request gets an error event, the failure is kept in
        `failed`, and the task returns, closing the request channel: routes then see a broken
        channel and answer 503. A prefill step in flight is always waited for (its thread
        writes KV rows), also on cancel: the lane's task lives in this task's nursery. The
        lanes' step threads end when this returns (a later run starts them again).
        """
        try:
            await self._serve(requests, task_status)
        finally:
            note = self.policy.stopped()  # --speculation-memory keeps the tuner's state
            if note is not None:
                log.warning("caldrix: %s", note)
            self._drop_leases(every=True)  # nothing is in flight: the lanes' nursery has closed
            for lane in (self.run_step, self.run_prefill):
                for thread in getattr(lane, "threads", ()):
                    thread.close()  # nothing is in flight: both lanes' steps were awaited

    async def _serve(self, requests: trio.MemoryReceiveChannel[Submission], task_status) -> None:
        # The prefill lane's hand-back: at most one Work is in flight, so one slot of buffer.
        landed_tx, landed_rx = trio.open_memory_channel[Landed](1)
        async with requests, trio.open_nursery() as lanes:
            task_status.started()
            while True:
                if not self.policy.has_running():
                    try:
                        self._admit(await self._next(requests))
                    except trio.EndOfChannel:
                        return
                while self.policy.can_admit:
                    try:
                        self._admit(requests.receive_nowait())
                    except (trio.WouldBlock, trio.EndOfChannel):
                        break
                self._drop_abandoned()
                if self._in_flight is None:
                    self._drop_leases()
                if self.cutoff.is_set():
                    self._cut_all()
                    if self._in_flight is not None and not self._land(await landed_rx.receive(), requests):
                        return  # the chunk's sequences are cut on the next pass
                    continue
                if self._in_flight is None:
                    work = self.policy.schedule_prefill()
                    if work is not None:
                        threads = 1 if self.overlap and self.policy.has_decoding() else 0
                        self._in_flight = work
                        lanes.start_soon(self._prefill_lane, work, threads, landed_tx)
                if self._in_flight is not None and not self.overlap:
                    if not self._land(await self._admitting(landed_rx.receive, requests), requests):
                        return  # one step at a time
                work = self.policy.schedule_decode()
                if work is not None and not await self._decode(work, requests):
                    return
                if self._in_flight is None:
                    if work is None:
                        await trio.lowlevel.checkpoint()
                    continue
                if work is None:
                    got = await self._admitting(landed_rx.receive, requests)  # nothing to decode
                else:
                    try:
                        got = landed_rx.receive_nowait()
                    except trio.WouldBlock:
                        continue  # still running: decode on beside it
                if not self._land(got, requests):
                    return

    async def _admitting(self, wait: Callable[[], Awaitable[T]], requests: trio.MemoryReceiveChannel[Submission]) -> T:
        """Await `wait()` (a step, or a chunk landing) and take submissions meanwhile while slots
        are free: the request channel is --queue-depth deep, and left undrained for a whole step
        it refused newcomers (429) with slots free. Only the admitting side is ever cancelled
        here, at its receive, which then consumes nothing; `wait()` runs to its end.

        Safe beside a step in flight: admission gives a sequence a free slot, and a free slot is
        in no batch, so the step's thread never touches what admission writes."""
        if not self.policy.can_admit:
            return await wait()
        async with trio.open_nursery() as beside:

            async def admit() -> None:
                while self.policy.can_admit:
                    try:
                        sub = await requests.receive()
                    except trio.EndOfChannel:
                        return  # stopping: only `wait` is left
                    self._admit(sub)

            beside.start_soon(admit)
            try:  # raised in the nursery's body, an error would come out wrapped in a group
                got, error = await wait(), None
            except Exception as exc:
                got, error = None, exc
            beside.cancel_scope.cancel()
        if error is not None:
            raise error
        return got

    async def _next(self, requests: trio.MemoryReceiveChannel[Submission]) -> Submission:
        """The next submission, waited for while nothing runs. While a lease is live, look up
        every half second, so a released lease's snapshot does not outlive its request long."""
        while self._leases:
            with trio.move_on_after(0.5):
                return await requests.receive()
            self._drop_leases()
        return await requests.receive()

    def _drop_leases(self, every: bool = False) -> None:
        """Drop the snapshots of released leases that no running sequence uses (all of them
        with `every`). Call only with no step in flight."""
        used = {id(seq.sub.lease) for seq in self.policy.running if seq.sub.lease is not None}
        for key, lease in list(self._leases.items()):
            if every or (lease.released and id(lease) not in used):
                del self._leases[key]
                self.policy.forget(key)
                drop = getattr(self.engine, "drop_snapshot", None)
                if drop is not None:
                    drop(key)

    async def _prefill_lane(self, work: Work, threads: int, landed: trio.MemorySendChannel[Landed]) -> None:
        batch = attrs.evolve(work.batch, threads=threads) if threads else work.batch
        try:
            got = Landed(work, await self.run_prefill(self.engine.step, batch))
        except Exception as exc:  # handed to the loop, which fails every request
            got = Landed(work, None, exc)
        landed.send_nowait(got)  # never blocks: the buffer holds the one Work in flight

    async def _decode(self, work: Work, requests) -> bool:
        """Run one decode step and emit its tokens; False if the engine failed. Beside a chunk
        in flight the step takes one core, the chunk the other."""
        batch = attrs.evolve(work.batch, threads=1) if self._in_flight is not None else work.batch
        alone = self._in_flight is None
        t0 = time.monotonic()
        try:
            out = await self._admitting(lambda: self.run_step(self.engine.step, batch), requests)
        except Exception as exc:
            self._fail(exc, requests)  # a chunk still in flight is waited for by the nursery
            return False
        if alone and self._in_flight is None:  # a step beside a chunk runs on one core: not its usual time
            self.policy.timed(work, time.monotonic() - t0)
        self._apply(work, out)
        return True

    def _land(self, got: Landed, requests) -> bool:
        """Apply a landed prefill step; False if the engine failed (the loop then returns)."""
        self._in_flight = None
        if got.error is not None:
            self._fail(got.error, requests)
            return False
        self._apply(got.work, got.out)
        return True

    def _apply(self, work: Work, out: StepOutput) -> None:
        self._steps += 1
        now = time.monotonic()
        ended: set[int] = set()  # a verify pass gives a sequence several events; one ending is final
        for seq, event in self.policy.postprocess(work, out):
            if id(seq) not in ended and not self._emit(seq, event, now):
                ended.add(id(seq))

    def _fail(self, exc: Exception, requests) -> None:
        """The engine is gone; fail loudly, never silently."""
        log.error("engine step failed", exc_info=exc)
        self.failed = f"{type(exc).__name__}: {exc}"
        self._fail_all(requests)

    def _admit(self, sub: Submission) -> None:
        sub.taken.set()
        seq = Sequence(sub)
        if sub.events.statistics().open_receive_channels == 0:
            seq.finish = FinishReason.ABORT  # the client left while queued
            self._closed(seq)
            return
        if not sub.prompt_ids:  # routes refuse these; one let through would never leave its slot
            self._answer_all([seq], FinishReason.ERROR, EMPTY_PROMPT)
            return
        if sub.lease is not None:
            self._leases[sub.lease.key] = sub.lease
        self.policy.admit(seq)
        seq.t_admitted = time.monotonic()

    def _drop_abandoned(self) -> None:
        """Free the slot of every request whose route stopped listening (client gone, or a
        stop string ended it), within one step of it happening."""
        for seq in self._settled():
            if seq.sub.events.statistics().open_receive_channels == 0:
                self._end(seq, FinishReason.ABORT)

    def _settled(self) -> list[Sequence]:
        """Running sequences with no step in flight: those whose slots may be freed now. A
        sequence whose chunk is running is dealt with once it lands."""
        busy = self._in_flight.seqs if self._in_flight is not None else ()
        return [seq for seq in self.policy.running if seq not in busy]

    def _emit(self, seq: Sequence, event: TokenEvent, now: float) -> bool:
        """Send one event; False once the sequence has ended (its last event, or its route gone),
        after which the rest of the pass's events for it are dropped: each would end it again
        (counted again in /metrics, closed again)."""
        if event.token_id is not None:
            if not seq.t_first_token:
                seq.t_first_token = now
            seq.t_tokens.append(now)
        try:
            # Never blocks: the route opened the channel with room for max_tokens + 1 events.
            seq.sub.events.send_nowait(event)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            self._end(seq, FinishReason.ABORT)
            return False
        if event.finish is not None:
            self._closed(seq)
            return False
        return True

    def _end(self, seq: Sequence, reason: FinishReason) -> None:
        self.policy.release(seq, reason)
        self._closed(seq)

    def _closed(self, seq: Sequence) -> None:
        seq.sub.events.close()
        if seq.sub.embeds and hasattr(self.engine, "drop_embeddings"):
            # no step of seq is in flight here: it finished, was dropped settled, or never ran
            self.engine.drop_embeddings({e.key for e in seq.sub.embeds})
        if self.on_finish is not None:
            self.on_finish(seq)

    def _cut_all(self) -> None:
        """Shutdown deadline: end every running request with a clean "shutting down"."""
        self._answer_all(self._settled(), FinishReason.ABORT, SHUTTING_DOWN)

    def _fail_all(self, requests: trio.MemoryReceiveChannel[Submission]) -> None:
        """Answer every running and every queued request with the engine's error."""
        failed = list(self.policy.running)
        while True:
            try:
                sub = requests.receive_nowait()
                sub.taken.set()
                failed.append(Sequence(sub))
            except (trio.WouldBlock, trio.EndOfChannel):
                break
        self._answer_all(failed, FinishReason.ERROR, self.failed)

    def _answer_all(self, seqs: list[Sequence], reason: FinishReason, message: str | None) -> None:
        event = TokenEvent(None, reason, error=message)
        for seq in seqs:
            if seq.status is Status.RUNNING:
                self.policy.release(seq, reason)
            else:
                seq.finish = reason  # still queued: it never had a slot
            try:
                seq.sub.events.send_nowait(event)
            except (trio.BrokenResourceError, trio.ClosedResourceError, trio.WouldBlock):
                pass
            self._closed(seq)
