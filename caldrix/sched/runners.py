"""The lanes' step runners: which OS thread runs each step (sched/threads.py says why threads
of our own).

- The decode lane: every decode step on "caldrix step".
- The prefill lane: a chunk given every core (nothing decoding beside it) on "caldrix step" too,
  so OpenMP keeps a single team; a chunk beside decode steps (one thread, no team) on
  "caldrix prefill", a thread at a low priority (nice 10). A chunk beside decode shares two
  cores with the decode step, the event loop and the clients; at a low priority it is the one
  those preempt when they wake, not the decode step, so the running streams' tokens keep their
  pace (docs/performance-history.md, "The beside-chunk thread at a low priority": the mixed row's
  p99/p50 at a median of 1.9-2.0 over rounds against 2.1-2.2, the newcomer's TTFT unchanged).
- The valve: a chunk that got less than half a core while it ran (`time.thread_time` against
  the wall clock) means something else busy shares the machine, and at a low priority the
  newcomer's prompt would wait for it (nice 10 gets about a tenth of a core against a busy
  process of the default priority). Chunks beside decode then run on a thread at the
  process's priority, "caldrix fair", for `FAIR_HOLD_S`.

A runner has the StepRunner shape (`await runner(fn, batch)`) and `threads`: the StepThreads
it owns, which the scheduler closes when its run ends.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Callable

from caldrix.batch import Batch, StepOutput
from caldrix.sched.threads import StepThread

log = logging.getLogger("caldrix")

BESIDE_NICE = 10  # nice 19 measured no better in the mixed row, and starves harder (1.4 % of a core)
STARVED_SHARE = 0.5  # a chunk that got less than this share of a core ran starved
JUDGED_AFTER_S = 0.05  # shorter chunks are not judged: one preemption is a large share of them
FAIR_HOLD_S = 30.0  # how long chunks beside decode keep the process's priority after one starved
# OpenMP's default wait policy spins idle workers; on a shared machine they spin on cores the
# other processes need, and every step waits for a descheduled spinner (measured 4-12x slower
# than PASSIVE beside other busy processes: docs/serve.md "Threads").
_SHARED_HINT = ("" if os.environ.get("OMP_WAIT_POLICY", "").upper() == "PASSIVE"
                else "; on a machine shared with busy processes, start caldrix with OMP_WAIT_POLICY=PASSIVE")


class DecodeLane:
    """Every step on one thread ("caldrix step")."""

    def __init__(self, thread: StepThread | None = None):
        self.thread = thread or StepThread("caldrix step")
        self.threads = (self.thread,)

    async def __call__(self, fn: Callable[[Batch], StepOutput], batch: Batch) -> StepOutput:
        return await self.thread.run(fn, batch)


def _with_cpu_share(fn: Callable[[Batch], StepOutput], batch: Batch) -> tuple[StepOutput, float, float]:
    """fn(batch), with the share of a core this thread got while it ran, and the wall seconds."""
    cpu, wall = time.thread_time(), time.monotonic()
    out = fn(batch)
    wall = time.monotonic() - wall
    return out, (time.thread_time() - cpu) / max(wall, 1e-9), wall


class PrefillLane:
    """Chunks given every core on the decode lane's thread; chunks beside decode on the
    low-priority thread, or on a fair one while the valve is open (module docstring)."""

    def __init__(self, decode: DecodeLane):
        self.decode = decode
        self.low = StepThread("caldrix prefill", nice=BESIDE_NICE)
        self.fair = StepThread("caldrix fair")
        self.threads = (self.low, self.fair)
        self.fair_until = 0.0  # monotonic time until which the valve stays open

    async def __call__(self, fn: Callable[[Batch], StepOutput], batch: Batch) -> StepOutput:
        if batch.threads != 1:
            return await self.decode.thread.run(fn, batch)
        if time.monotonic() < self.fair_until:
            return await self.fair.run(fn, batch)
        out, share, wall = await self.low.run(_with_cpu_share, fn, batch)
        if wall >= JUDGED_AFTER_S and share < STARVED_SHARE:
            log.warning("a prompt chunk beside decode steps got %.0f%% of a core: the machine is busy; "
                        "such chunks run at normal priority for %.0f s%s", 100 * share, FAIR_HOLD_S, _SHARED_HINT)
            self.fair_until = time.monotonic() + FAIR_HOLD_S
        return out
