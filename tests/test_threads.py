"""sched/threads.py: a StepThread runs its calls on one OS thread, in order, and is never
abandoned on cancel."""

from __future__ import annotations

import os
import sys
import threading
import time

import pytest
import trio

from caldrix.sched.threads import StepThread


def test_calls_run_in_order_on_one_thread_and_return_or_raise():
    seen: list[tuple[int, int]] = []

    def work(i: int) -> int:
        seen.append((i, threading.get_ident()))
        return i * i

    def boom() -> None:
        raise ValueError("boom")

    async def main():
        with StepThread("t-test") as t:
            got = [await t.run(work, i) for i in range(5)]
            with pytest.raises(ValueError, match="boom"):
                await t.run(boom)
            got.append(await t.run(work, 5))  # an exception does not end the thread
        return got

    assert trio.run(main) == [0, 1, 4, 9, 16, 25]
    assert [i for i, _ in seen] == list(range(6))
    assert len({ident for _, ident in seen}) == 1 and seen[0][1] != threading.get_ident()
    assert "t-test" not in {t.name for t in threading.enumerate()}  # closed: the thread ended


@pytest.mark.skipif(sys.platform != "linux", reason="the OS thread name is set on Linux")
def test_the_os_sees_the_thread_by_its_name():
    def comm() -> str:
        with open(f"/proc/self/task/{threading.get_native_id()}/comm") as f:
            return f.read().strip()

    with StepThread("caldrix prefill") as t, StepThread("a name over fifteen bytes") as u:
        assert t.call(comm) == "caldrix prefill" and u.call(comm) == "a name over fif"


def test_two_tasks_share_the_thread_one_call_at_a_time():
    active = []
    overlap = []

    def work(_: int) -> None:
        active.append(1)
        overlap.append(len(active))
        time.sleep(0.01)
        active.pop()

    async def main():
        with StepThread("t-share") as t:
            async with trio.open_nursery() as n:
                for i in range(4):
                    n.start_soon(t.run, work, i)

    trio.run(main)
    assert overlap == [1, 1, 1, 1]


def test_a_cancel_waits_for_the_running_call():
    release = threading.Event()

    def slow() -> str:
        assert release.wait(10)
        return "done"

    async def main():
        got = []
        with StepThread("t-cancel") as t:
            t0 = trio.current_time()  # (before the timer starts: its 0.3 s is then a floor)
            threading.Timer(0.3, release.set).start()
            with trio.move_on_after(0.05) as scope:
                got.append(await t.run(slow))  # the cancel at 0.05 s waits for slow()
                got.append(trio.current_time() - t0)
                await trio.lowlevel.checkpoint()  # and arrives at the next checkpoint
                got.append("not reached")
        assert scope.cancelled_caught
        assert got[0] == "done" and got[1] >= 0.29 and len(got) == 2

    trio.run(main)


def test_call_from_plain_code_and_a_restart_after_close():
    t = StepThread("t-plain")
    first = t.call(threading.get_ident)
    t.close()
    second = t.call(threading.get_ident)  # a closed StepThread starts a fresh thread on use
    t.close()
    assert first != threading.get_ident() and second != threading.get_ident()
    with pytest.raises(ZeroDivisionError):
        with StepThread("t-raise") as u:
            u.call(lambda: 1 / 0)


def test_the_prefill_lane_picks_threads_and_opens_its_valve_when_a_chunk_starves():
    """sched/runners.py: whole-core chunks on the decode lane's thread; chunks beside decode on
    the low-priority thread until one gets less than half a core, then on the fair one."""
    from caldrix.batch import Batch
    from caldrix.sched.runners import BESIDE_NICE, DecodeLane, PrefillLane

    def where(_batch):
        tid = threading.get_native_id()
        return threading.current_thread().name, os.getpriority(os.PRIO_PROCESS, tid)

    def starved(_batch):  # waits without using a core, as a thread starved by a busy machine does
        time.sleep(0.1)
        return where(_batch)

    shares: list[float] = []  # the share of a core each busy chunk measured for itself

    def busy(_batch):
        t, w = time.thread_time(), time.monotonic()
        while time.thread_time() - t < 0.1:
            pass
        shares.append((time.thread_time() - t) / (time.monotonic() - w))
        return where(_batch)

    base = os.getpriority(os.PRIO_PROCESS, 0)

    async def main():
        decode = DecodeLane()
        lane = PrefillLane(decode)
        try:
            got = [await lane(where, Batch((), threads=0))]
            # A chunk that had its core does not open the valve. Whether a nice-10 thread gets
            # its core is the machine's doing (about a tenth of one beside two busy processes):
            # a chunk that measured itself starved proves nothing, so it runs again (5 tries).
            for _ in range(5):
                lane.fair_until = 0.0
                ran = await lane(busy, Batch((), threads=1))
                if shares[-1] >= 0.8:
                    break
            else:
                return None
            assert lane.fair_until == 0.0, shares
            got += [ran, await lane(starved, Batch((), threads=1)), await lane(where, Batch((), threads=1))]
            return got
        finally:
            for t in (*decode.threads, *lane.threads):
                t.close()

    got = trio.run(main)
    if got is None:
        pytest.skip(f"a nice-{BESIDE_NICE} thread never had its core on this busy machine: {shares}")
    low = max(base, BESIDE_NICE) if sys.platform == "linux" else base
    assert got == [("caldrix step", base), ("caldrix prefill", low), ("caldrix prefill", low),
                   ("caldrix fair", base)]


def test_abandon_lets_a_thread_go_with_its_call_and_the_next_call_starts_afresh():
    """An abandoned thread finishes the call in hand on its own and delivers its result where
    that call said; the StepThread's next call runs at once, on a fresh thread."""
    gate = threading.Event()
    got: list = []
    t = StepThread("t-abandon")
    try:
        first = t.submit(lambda: (gate.wait(10), threading.get_ident())[1], (), got.append)
        t.abandon()
        second = t.call(threading.get_ident)  # not queued behind the held call
        assert second != first and got == []
        old = next(th for th in threading.enumerate() if th.ident == first)
        gate.set()
        old.join(5)
        assert not old.is_alive() and got[0].unwrap() == first
    finally:
        gate.set()
        t.close()


def test_wait_let_go_waits_for_the_threads_abandon_let_go_and_says_how_many_still_run():
    """Whoever ends the process waits for let-go threads (a thread still inside torch at exit
    aborts it), up to a bound: the count left is what it could not wait out."""
    gate = threading.Event()
    t = StepThread("t-let-go")
    try:
        assert t.wait_let_go(0) == 0  # none let go yet
        t.submit(gate.wait, (10,), lambda _: None)
        t.abandon()
        t.submit(gate.wait, (10,), lambda _: None)  # a fresh thread, let go in its turn
        t.abandon()
        began = time.monotonic()
        assert t.wait_let_go(0.2) == 2
        assert time.monotonic() - began < 2  # the bound is for all of them, not each
        gate.set()
        assert t.wait_let_go(10) == 0
    finally:
        gate.set()
        t.close()
