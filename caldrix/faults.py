"""A test-only fault: make the Nth engine step raise, to prove the server survives its engine.

Off in production: `install` does nothing unless CALDRIX_TEST_FAULT_STEP is set in the server's
environment, and the variable is read only at start-up. With it set to N, the Nth call of
engine.step (1-based, prefill chunks and decode steps alike) raises `InjectedFault`, and every
step after it would raise again (the scheduler stops stepping after the first). What the server
must then do is the scheduler's ordinary engine-failure path (sched/loop.py `_fail`): running
streams get an SSE error event, queued and new requests a 503, and /healthz answers 503.
"""

from __future__ import annotations

import os

ENV = "CALDRIX_TEST_FAULT_STEP"


class InjectedFault(RuntimeError):
    """The failure CALDRIX_TEST_FAULT_STEP asked for."""


class FaultyEngine:
    """Wraps an engine; its `step` raises from the `at`-th call on. Everything else delegates."""

    def __init__(self, engine, at: int) -> None:
        self._engine = engine
        self._at = at
        self._calls = 0

    def step(self, batch):
        self._calls += 1
        if self._calls >= self._at:
            raise InjectedFault(f"injected fault at engine step {self._calls} ({ENV})")
        return self._engine.step(batch)

    def __getattr__(self, name: str):
        return getattr(self._engine, name)


def install(scheduler, say) -> None:
    """Wrap the scheduler's engine when CALDRIX_TEST_FAULT_STEP is set; say so on stderr."""
    raw = os.environ.get(ENV)
    if not raw:
        return
    at = int(raw)
    scheduler.engine = FaultyEngine(scheduler.engine, at)
    say(f"caldrix: test fault armed: engine step {at} will raise ({ENV})")
