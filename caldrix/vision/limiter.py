"""The server-wide image decode limiter (http-api.md: at most 2 requests decode images at once,
one request's images one at a time, at most --queue-depth more wait, one past that is a 429).

One `DecodeLimiter` lives in the server's root nursery's scope and is shared by every request
handler. A request takes one slot for all its images and decodes them one after another in a
worker thread; its place in the queue is held only while it waits, so a client that goes away
while waiting (its handler cancelled) frees the place at once. The queue is first come, first
served (trio.CapacityLimiter hands a freed slot to the longest waiter).

Each slot runs its work on a thread of its own (sched.threads.StepThread) under Linux's
SCHED_IDLE policy (IMAGE_NICE where that is refused): decoding, preprocessing and the vision
tower take only the CPU the decode steps leave, so text streams keep their pace while images
are prepared (a 13-tile image is seconds of tower work; on trio's worker threads, at equal
priority, it tripled a running stream's inter-token latency on 2 cores, and at nice 10 it
still doubled it on a VM where a woken step thread waited out the image thread's slice). The
flip side: while text steps keep every core busy, an image waits for the gaps between them.
How many threads the work itself uses is the caller's (serving.embed_request). A slot's thread ends
when its request's images are done (the next request starts a fresh one): the tower's parallel
kernels give it an OpenMP team, and libgomp lets no team's idle threads spin once more threads
are in teams than there are cores (sched/threads.py), so a team left behind slowed every later
decode step of the server (text ITL 22 -> 35 ms after one image request, on 2 cores).
Against other programs that keep every core busy, SCHED_IDLE would hold images back as long as
they run; valve.py watches each call for that and moves it to the slot's second thread, at the
process's priority ("caldrix imfair0", "caldrix imfair1"), ended with the slot's too.

No HTTP here: a full queue raises `DecodeQueueFull`, which the route answers with its 429; the
exception carries what routes/backoff.py needs for Retry-After (how long recent requests held a
slot, how many wait).
"""

from __future__ import annotations

import collections
import contextlib
import time
from typing import AsyncIterator, Callable, Sequence, TypeVar

import outcome
import trio

from caldrix.sched.threads import StepThread
from caldrix.vision.valve import JUDGED_AFTER_S, WATCH_S, Valve, Watch, promote

T = TypeVar("T")
R = TypeVar("R")

DECODE_SLOTS = 2
# the slots' threads' Linux nice value where SCHED_IDLE is refused: below the engine's steps (0)
IMAGE_NICE = 10
QUEUE_FULL = "the image decode queue is full"
# how long a stopping server waits for starved calls the valve let go (valve.py): one tile's work
LET_GO_WAIT_S = 10.0
HOLDS_KEPT = 32  # recent slot-hold times kept for the 429's Retry-After estimate


class DecodeQueueFull(Exception):
    """Every decode slot is taken and `queue_depth` requests already wait: answer 429.
    `held`: seconds each of the recent requests held its slot, oldest first; `waiting` and
    `slots` as the limiter had them when it refused."""

    def __init__(self, held: tuple[float, ...], waiting: int, slots: int) -> None:
        super().__init__(QUEUE_FULL)
        self.held = held
        self.waiting = waiting
        self.slots = slots


class DecodeLimiter:
    """`slots` requests decode at once; at most `queue_depth` more wait for a slot."""

    def __init__(self, queue_depth: int, slots: int = DECODE_SLOTS) -> None:
        if slots < 1 or queue_depth < 0:
            raise ValueError("slots must be at least 1 and queue_depth at least 0")
        self._limiter = trio.CapacityLimiter(slots)
        self._held: collections.deque[float] = collections.deque(maxlen=HOLDS_KEPT)
        self.queue_depth = queue_depth
        self._waiting = 0
        # Two threads per slot, started on first use: the idle-priority one, and the fair one the
        # valve moves calls to; a request takes a free pair with its slot.
        self._threads = [(StepThread(f"caldrix image{i}", nice=IMAGE_NICE, idle=True),
                          StepThread(f"caldrix imfair{i}")) for i in range(slots)]
        self._free = list(self._threads)
        self.valve = Valve()

    @property
    def decoding(self) -> int:
        """Requests holding a slot now (for /metrics)."""
        return self._limiter.borrowed_tokens

    @property
    def waiting(self) -> int:
        """Requests waiting for a slot now (for /metrics)."""
        return self._waiting

    @contextlib.asynccontextmanager
    async def slot(self) -> AsyncIterator["Slot"]:
        """Hold a slot for the block: its work goes through the yielded Slot's `run`.

        Raises DecodeQueueFull without waiting when no slot is free and the queue is full. A
        cancellation while waiting leaves the queue; one while decoding returns the slot once
        the call in hand is done (a thread cannot be stopped; its result is dropped)."""
        borrower = object()  # one borrower per call: a task may hold a slot only once
        try:
            self._limiter.acquire_on_behalf_of_nowait(borrower)
        except trio.WouldBlock:
            if self._waiting >= self.queue_depth:
                raise DecodeQueueFull(tuple(self._held), self._waiting, int(self._limiter.total_tokens)) from None
            self._waiting += 1
            try:
                await self._limiter.acquire_on_behalf_of(borrower)
            finally:
                self._waiting -= 1
        threads = self._free.pop()  # a slot is held: one pair of threads is free
        slot = Slot(*threads, self.valve)
        since = trio.current_time()
        try:
            yield slot
        finally:
            slot.renew()  # its OpenMP teams end with its threads (the module docstring says why)
            self._held.append(trio.current_time() - since)
            self._free.append(threads)
            self._limiter.release_on_behalf_of(borrower)

    async def run(self, items: Sequence[T], fn: Callable[[T], R]) -> list[R]:
        """`fn(item)` for each item, one at a time, on the slot's thread, inside one slot (slot()
        says what it raises)."""
        async with self.slot() as slot:
            return [await slot.run(fn, item) for item in items]

    def close(self, let_go_wait_s: float = LET_GO_WAIT_S) -> int:
        """End the slots' threads once nothing runs on them (the server, as it stops), and wait
        up to `let_go_wait_s` for threads the valve let go with a starved call (a thread still in
        torch's kernels at exit aborts the process). Returns how many still run."""
        for pair in self._threads:
            for thread in pair:
                thread.close()
        deadline = time.monotonic() + let_go_wait_s
        return sum(idle.wait_let_go(max(0.0, deadline - time.monotonic())) for idle, _ in self._threads)


class Slot:
    """A held decode slot (DecodeLimiter.slot): calls run one at a time, on the slot's
    idle-priority thread, or on its fair one while the valve is open (valve.py)."""

    def __init__(self, idle: StepThread, fair: StepThread, valve: Valve) -> None:
        self._idle = idle
        self._fair = fair
        self._valve = valve

    async def run(self, fn: Callable[..., R], *args) -> R:
        """fn(*args) on one of the slot's threads. Like StepThread.run, a cancel arrives once
        the call is done. fn must touch nothing shared: a starved call is run again on the fair
        thread and the starved one let go with its result unread."""
        if self._valve.is_open:
            return await self._fair.run(fn, *args)
        done = trio.Event()
        box: list[outcome.Outcome] = []
        token = trio.lowlevel.current_trio_token()

        def deliver(result: outcome.Outcome) -> None:  # on the idle thread, maybe long after
            box.append(result)
            try:
                token.run_sync_soon(done.set)
            except trio.RunFinishedError:  # a let-go call that outlived the server
                pass

        watch = Watch(self._idle.submit(fn, args, deliver))
        rerun: outcome.Outcome | None = None
        with trio.CancelScope(shield=True):
            with trio.move_on_after(JUDGED_AFTER_S):
                await done.wait()
            while not done.is_set():
                if watch.starved():
                    self._valve.open()
                    if promote(self._idle.name):  # the call goes on, at the process's priority
                        await done.wait()
                        self._idle.close()  # the next idle call starts a fresh thread, at idle priority
                        break
                    self._idle.abandon()  # it ends after the starved call; the next call starts a fresh one
                    rerun = await outcome.acapture(self._fair.run, fn, *args)
                    break
                with trio.move_on_after(WATCH_S):
                    await done.wait()
        await trio.lowlevel.checkpoint_if_cancelled()
        return (rerun or box[0]).unwrap()

    def renew(self) -> None:
        """End the slot's threads after the calls so far, and their OpenMP teams with them; the
        next call starts a fresh one."""
        self._idle.close()
        self._fair.close()
