"""StepThread: one OS thread of its own that runs the blocking calls handed to it, in order.

Why not trio's worker threads: OpenMP (libgomp, the runtime torch's CPU kernels use) keeps a
team of helper threads for each thread that starts parallel work, and it counts every team's
threads. Once the count passes the machine's cores it stops letting idle helpers spin and puts
them to sleep at once, so each of a decode step's ~150 parallel kernel calls pays a wake-up
(about 50 us each on a 2-core VM: a one-row step took 12-14 ms instead of 4.7-5.6). trio hands a
job to whichever cached thread is idle, so the model load, the decode lane and the prefill lane
could each grow a team, and a server ran fast or slow by which thread had run what: 8 streams
at 308-323 or 535-555 tok/s (docs/performance-history.md, "one OpenMP team"). With the load on a thread
that ends with it, one StepThread for all other work that uses every core (decode steps, chunks
run alone) and others for chunks beside decode (one thread: no team), libgomp counts exactly
the cores.

Contract: `run` blocks the calling task (not the event loop) until the call returns, and is
never abandoned on cancel: a step that is writing KV rows must finish before anything touches
them; a cancel arrives once it has. Calls run one at a time, in the order they were handed
over. `close` ends the thread after its last call; whoever created the StepThread closes it.
`abandon` lets the thread go with a call in hand (only for calls that touch nothing shared: an
image's tile, never a step); `wait_let_go` is for whoever ends the process, since a thread still
inside torch's kernels when the interpreter exits aborts it ("terminate called without an active
exception").
"""

from __future__ import annotations

import os
import queue
import sys
import threading
import time
from typing import Callable, TypeVar

import outcome
import trio

T = TypeVar("T")


class StepThread:
    """`nice`: the thread's own scheduling priority on Linux (0: the process's; 19: the lowest).
    `idle`: Linux's SCHED_IDLE policy on top, where the kernel allows it: the thread runs only on
    CPU time no ordinary thread wants, and gives its core up the moment one wakes (a nice value
    only shares the time out by weight: a step's woken thread could wait out the other's slice).
    An unprivileged thread cannot raise its priority again, so it is set once, as it starts, and
    the threads it starts (an OpenMP team's, a kernel's own) inherit it."""

    def __init__(self, name: str, *, nice: int = 0, idle: bool = False):
        self.name = name
        self.nice = nice
        self.idle = idle
        # Unbounded in type, bounded in use: each call's task waits for it before handing over
        # another, so the queue holds at most one call per task using this thread (two lanes).
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        # Threads `abandon` let go that may still run. Bounded in use: a thread is let go only
        # when a call on it starved (vision/valve.py), and an ended one is dropped at the next.
        self._let_go: list[threading.Thread] = []

    def _start(self) -> None:
        with self._lock:
            if self._thread is None:
                # daemon: a process that exits without closing (a crash, a test) does not hang on it
                self._thread = threading.Thread(target=self._serve, args=(self._calls,), name=self.name,
                                                daemon=True)
                self._thread.start()

    def _serve(self, calls: queue.SimpleQueue) -> None:
        if sys.platform == "linux":
            tid = threading.get_native_id()
            try:  # the name `top -H` and `ps -L` show (Python sets none; 15 bytes at most)
                with open(f"/proc/self/task/{tid}/comm", "w") as comm:
                    comm.write(self.name[:15])
            except OSError:
                pass
            if self.nice:  # Linux: a thread's priority is its own
                try:
                    os.setpriority(os.PRIO_PROCESS, tid, self.nice)
                except OSError:  # a container may refuse it: the thread keeps the process's
                    pass
            if self.idle:
                try:
                    os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
                except (OSError, AttributeError):  # refused, or not in this Python: the nice value stands
                    pass
        while True:
            call = calls.get()
            if call is None:
                return
            fn, args, deliver = call
            deliver(outcome.capture(fn, *args))

    async def run(self, fn: Callable[..., T], *args) -> T:
        """fn(*args) on this thread; returns its result or raises its exception."""
        await trio.lowlevel.checkpoint_if_cancelled()
        self._start()
        token = trio.lowlevel.current_trio_token()
        task = trio.lowlevel.current_task()

        def deliver(result: outcome.Outcome) -> None:  # on this thread: wake the task
            token.run_sync_soon(trio.lowlevel.reschedule, task, result)

        self._calls.put((fn, args, deliver))
        return await trio.lowlevel.wait_task_rescheduled(lambda _: trio.lowlevel.Abort.FAILED)

    def submit(self, fn: Callable[..., T], args: tuple, deliver: Callable[[outcome.Outcome], None]) -> int:
        """Hand fn(*args) over without waiting: `deliver(outcome)` is called on this thread when it
        returns. Returns the thread's ident (for its CPU clock: time.pthread_getcpuclockid)."""
        self._start()
        with self._lock:
            ident = self._thread.ident
            self._calls.put((fn, args, deliver))
        return ident

    def call(self, fn: Callable[..., T], *args) -> T:
        """fn(*args) on this thread, from plain (non-trio) code: blocks until it returns."""
        self._start()
        done = threading.Event()
        box: list[outcome.Outcome] = []

        def deliver(result: outcome.Outcome) -> None:
            box.append(result)
            done.set()

        self._calls.put((fn, args, deliver))
        done.wait()
        return box[0].unwrap()

    def close(self) -> None:
        """End the thread once the calls handed over so far have run; waits for it."""
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            self._calls.put(None)
            thread.join()

    def abandon(self) -> None:
        """Let the thread go without waiting for it: it ends once the calls handed over so far
        have run, and their results go wherever those calls said; the next call starts a fresh
        thread. Only for calls that touch nothing another call could (sched/threads.py)."""
        with self._lock:
            thread, self._thread = self._thread, None
            calls, self._calls = self._calls, queue.SimpleQueue()
            if thread is not None:
                self._let_go = [t for t in self._let_go if t.is_alive()] + [thread]
        if thread is not None:
            calls.put(None)

    def wait_let_go(self, timeout: float) -> int:
        """Wait up to `timeout` seconds in all for the threads `abandon` let go to end; returns
        how many still run."""
        deadline = time.monotonic() + timeout
        with self._lock:
            let_go = list(self._let_go)
        for thread in let_go:
            thread.join(max(0.0, deadline - time.monotonic()))
        with self._lock:
            self._let_go = [t for t in self._let_go if t.is_alive()]
            return len(self._let_go)

    def __enter__(self) -> "StepThread":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
