"""sched/threads.py: a StepThread runs its calls on one OS thread, in order, and is never
abandoned on cancel."""

from __future__ import annotations

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
            threading.Timer(0.3, release.set).start()
            t0 = trio.current_time()
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
