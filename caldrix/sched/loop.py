"""The scheduler task: the only async code in sched/. It receives, steps and emits.

Admission and backpressure: the scheduler takes a submission off the request channel only when a
slot is free for it, so the channel's buffer (--queue-depth) is exactly the queue of requests
waiting beyond those running, and a route whose `send_nowait` finds it full answers 429.
"""

from __future__ import annotations

import logging
import time
from typing import Awaitable, Callable, Protocol

import attrs
import trio

from caldrix.batch import Batch, StepOutput
from caldrix.protocol import FinishReason, Submission, TokenEvent
from caldrix.sched.policy import Policy
from caldrix.sched.sequence import Sequence, Status

log = logging.getLogger("caldrix")

SHUTTING_DOWN = "the server is shutting down"


class StepEngine(Protocol):
    def step(self, batch: Batch) -> StepOutput: ...


StepRunner = Callable[[Callable[[Batch], StepOutput], Batch], Awaitable[StepOutput]]


def thread_runner() -> StepRunner:
    """Run each step in a worker thread behind a limiter of its own (one step at a time), so
    the event loop keeps serving HTTP while torch works. Not abandoned on cancel: a step that
    is still writing KV rows must finish before anything else touches them."""
    limiter = trio.CapacityLimiter(1)

    async def run(fn, batch):
        return await trio.to_thread.run_sync(fn, batch, limiter=limiter)

    return run


@attrs.frozen
class SchedStats:
    running: int
    waiting: int
    free_slots: int
    held_rows: int
    steps: int


@attrs.define(eq=False)
class Scheduler:
    engine: StepEngine
    policy: Policy
    run_step: StepRunner = attrs.field(factory=thread_runner)
    on_finish: Callable[[Sequence], None] | None = None  # telemetry hook, called synchronously
    failed: str | None = None  # set once the engine has failed: the server answers 503
    # Set (by the server's shutdown watchdog) to end every running request now, cleanly.
    cutoff: trio.Event = attrs.Factory(trio.Event)
    _steps: int = 0

    def statistics(self, queued: int = 0) -> SchedStats:
        slots = self.policy.slots
        return SchedStats(len(self.policy.running), queued, slots.num_free, slots.rows_held(), self._steps)

    async def run(self, requests: trio.MemoryReceiveChannel[Submission], *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Serve submissions until the request channel is closed and the running ones end.

        On an engine failure every running request gets an error event, the failure is kept in
        `failed`, and the task returns, closing the request channel: routes then see a broken
        channel and answer 503.
        """
        async with requests:
            task_status.started()
            while True:
                if not self.policy.has_running():
                    try:
                        self._admit(await requests.receive())
                    except trio.EndOfChannel:
                        return
                while self.policy.can_admit:
                    try:
                        self._admit(requests.receive_nowait())
                    except (trio.WouldBlock, trio.EndOfChannel):
                        break
                self._drop_abandoned()
                if self.cutoff.is_set():
                    self._cut_all()
                    continue
                work = self.policy.schedule()
                if work is None:
                    await trio.lowlevel.checkpoint()
                    continue
                try:
                    out = await self.run_step(self.engine.step, work.batch)
                except Exception as exc:  # the engine is gone; fail loudly, never silently
                    log.exception("engine step failed")
                    self.failed = f"{type(exc).__name__}: {exc}"
                    self._fail_all(requests)
                    return
                self._steps += 1
                now = time.monotonic()
                for seq, event in self.policy.postprocess(work, out):
                    self._emit(seq, event, now)

    def _admit(self, sub: Submission) -> None:
        seq = Sequence(sub)
        if sub.events.statistics().open_receive_channels == 0:
            seq.finish = FinishReason.ABORT  # the client left while queued
            self._closed(seq)
            return
        self.policy.admit(seq)
        seq.t_admitted = time.monotonic()

    def _drop_abandoned(self) -> None:
        """Free the slot of every request whose route stopped listening (client gone, or a
        stop string ended it), within one step of it happening."""
        for seq in list(self.policy.running):
            if seq.sub.events.statistics().open_receive_channels == 0:
                self._end(seq, FinishReason.ABORT)

    def _emit(self, seq: Sequence, event: TokenEvent, now: float) -> None:
        if event.token_id is not None:
            if not seq.t_first_token:
                seq.t_first_token = now
            seq.t_tokens.append(now)
        try:
            # Never blocks: the route opened the channel with room for max_tokens + 1 events.
            seq.sub.events.send_nowait(event)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            self._end(seq, FinishReason.ABORT)
            return
        if event.finish is not None:
            self._closed(seq)

    def _end(self, seq: Sequence, reason: FinishReason) -> None:
        self.policy.release(seq, reason)
        self._closed(seq)

    def _closed(self, seq: Sequence) -> None:
        seq.sub.events.close()
        if self.on_finish is not None:
            self.on_finish(seq)

    def _cut_all(self) -> None:
        """Shutdown deadline: end every running request with a clean "shutting down"."""
        self._answer_all(list(self.policy.running), FinishReason.ABORT, SHUTTING_DOWN)

    def _fail_all(self, requests: trio.MemoryReceiveChannel[Submission]) -> None:
        """Answer every running and every queued request with the engine's error."""
        failed = list(self.policy.running)
        while True:
            try:
                failed.append(Sequence(requests.receive_nowait()))
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
