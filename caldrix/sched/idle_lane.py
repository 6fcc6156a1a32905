"""The thread that runs prompt chunks beside decode steps, at idle CPU priority.

Why: beside a chunk, a decode step has one core, and each token's event-loop and client work
(SSE framing, the client's own parsing) must take its CPU from one of the two compute threads.
At normal priority the OS shares it out evenly, so the decode step, whose time is the running
streams' inter-token latency, loses as much as the chunk. On Linux a SCHED_IDLE thread is
preempted at once by any other thread that wakes, and its core counts as idle when the kernel
places a waking thread, so that work lands on the chunk's core and the decode step keeps its
own. Measured in the mixed workload (docs/performance.md, 2026-12-04 evening): ITL p99/p50 2.03
to 1.80 (median of 20 rounds each way), with the newcomer's TTFT unchanged.

The thread is dedicated: an unprivileged thread cannot leave SCHED_IDLE again (that needs
CAP_SYS_NICE), so no step of any other kind may ever run on it. Where the OS has no SCHED_IDLE
(not Linux) or refuses it, the thread runs at normal priority and `priority` says so.
"""

from __future__ import annotations

import os
import queue
import threading
from typing import Callable

import trio

from caldrix.batch import Batch, StepOutput


def _lower_priority() -> str:
    """Put the calling thread at idle priority; returns the priority it ended up with."""
    if not hasattr(os, "SCHED_IDLE"):
        return "normal"
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # 0: the calling thread
    except OSError:
        return "normal"
    return "idle"


class IdleLane:
    """One OS thread of its own for one-core prompt chunks; `run` is a StepRunner.

    The thread starts on the first `run` and ends on `close` (Scheduler.run closes it as it
    returns). `run` never abandons a step on cancel: a chunk still writing KV rows must finish
    before anything else touches them, so the wait is shielded, as trio.to_thread's is.
    """

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self.priority = "not started"

    def _serve(self) -> None:
        self.priority = _lower_priority()
        self._ready.set()
        while (job := self._jobs.get()) is not None:
            job()

    def start(self) -> str:
        """Start the thread (once); blocks until its priority is set, which it returns."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name="caldrix-idle-lane", daemon=True)
            self._thread.start()
        self._ready.wait()
        return self.priority

    async def run(self, fn: Callable[[Batch], StepOutput], batch: Batch) -> StepOutput:
        self.start()
        token = trio.lowlevel.current_trio_token()
        done = trio.Event()
        result: list = []

        def job() -> None:
            try:
                result.append((True, fn(batch)))
            except BaseException as exc:  # handed back to the awaiting task
                result.append((False, exc))
            token.run_sync_soon(done.set)

        self._jobs.put(job)
        with trio.CancelScope(shield=True):
            await done.wait()
        ok, value = result[0]
        if not ok:
            raise value
        return value

    def close(self) -> None:
        """End the thread once its queue is empty. Does not wait for it: no job is queued once
        the scheduler returns, since each `run` waits for its own."""
        if self._thread is not None:
            self._jobs.put(None)
            self._thread = None
            self._ready.clear()
