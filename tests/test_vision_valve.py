"""caldrix/vision/valve.py: an image call starved by other programs moves to the process's
priority (promoted in place where the kernel allows, run again on the fair thread where it does
not), and one that only waits for caldrix's own work stays at idle priority."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest
import trio

from caldrix.vision import limiter as limiter_mod
from caldrix.vision import valve
from caldrix.vision.limiter import DecodeLimiter
from caldrix.vision.valve import JUDGED_AFTER_S, Watch, starved

linux = pytest.mark.skipif(sys.platform != "linux", reason="SCHED_IDLE, /proc and thread CPU clocks are Linux's")
CPU_S = 0.3  # each test call's work, in seconds of its own thread's CPU


def work(_item):
    """CPU-bound work that leaves Python's GIL free (a one-thread torch kernel) for CPU_S of
    this thread's CPU; the thread's name and its scheduling policy as it ends."""
    import torch

    torch.set_num_threads(1)
    a = torch.randn(160, 160)
    t0 = time.thread_time()
    while time.thread_time() - t0 < CPU_S:
        a @ a
    return threading.current_thread().name, os.sched_getscheduler(0)


def test_starved_needs_a_low_share_long_enough_and_other_programs_busy():
    assert starved(0.1, 1.0, 2.0)
    assert not starved(0.1, 1.0, 0.2)  # starved by caldrix's own work: its gaps will come
    assert not starved(0.6, 1.0, 2.0)  # it had its share
    assert not starved(0.0, JUDGED_AFTER_S / 2, 2.0)  # too short to judge


@linux
def test_a_watch_reads_a_running_thread_as_not_starved():
    watch = Watch(threading.get_ident())
    t0 = time.thread_time()
    while time.thread_time() - t0 < JUDGED_AFTER_S + 0.1:
        pass
    assert not watch.starved()


class Hogs:
    """One busy process per core at the default priority: other programs that keep the machine busy."""

    def __enter__(self):
        self.procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 1)]
        time.sleep(0.3)
        return self

    def __exit__(self, *exc):
        for p in self.procs:
            p.kill()
            p.wait()


def run_two_calls(limiter: DecodeLimiter | None = None):
    """Two calls in one slot; the limiter is closed after, without waiting for let-go threads
    (pass one in to wait for them later)."""
    async def main():
        lim = limiter or DecodeLimiter(queue_depth=0)
        try:
            with trio.fail_after(60):
                got = await lim.run([0, 1], work)
            return got, lim.valve.is_open
        finally:
            lim.close(let_go_wait_s=0)

    return trio.run(main)


def idle_policy() -> int:
    """The policy a slot's thread runs under here (SCHED_OTHER where SCHED_IDLE is refused)."""
    got = []

    def probe():
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        except OSError:
            pass
        got.append(os.sched_getscheduler(0))

    t = threading.Thread(target=probe)
    t.start()
    t.join()
    return got[0]


@linux
def test_a_call_starved_by_other_programs_is_promoted_where_the_kernel_allows():
    if os.geteuid() != 0:
        pytest.skip("raising a thread's priority again needs root or CAP_SYS_NICE")
    with Hogs():
        (first, second), opened = run_two_calls()
    assert opened
    # the starved call went on where it was, under the normal policy; the next on the fair thread
    assert first == ("caldrix image1", os.SCHED_OTHER)
    assert second == ("caldrix imfair1", os.SCHED_OTHER)


@linux
def test_a_call_starved_by_other_programs_runs_again_on_the_fair_thread(monkeypatch):
    monkeypatch.setattr(limiter_mod, "promote", lambda name: False)  # as for an unprivileged user
    lim = DecodeLimiter(queue_depth=0)
    with Hogs():
        (first, second), opened = run_two_calls(lim)
    assert opened
    assert first == ("caldrix imfair1", os.SCHED_OTHER) and second == first
    # the let-go thread finishes its call once the machine is free, and a stopping server's
    # close waits for it (it may have ended already)
    assert lim.close(let_go_wait_s=30) == 0
    assert not [t for t in threading.enumerate() if t.name == "caldrix image1"]


@linux
def test_a_call_that_waits_for_caldrixs_own_work_stays_at_idle_priority():
    """Busy threads of this process keep every core; the call waits for them and is not judged
    starved (it would open the valve and take CPU from the decode steps it is meant to yield to)."""
    import torch

    policy = idle_policy()
    if policy != os.SCHED_IDLE:
        pytest.skip("SCHED_IDLE is refused here: a nice-10 thread is not starved by its own process")
    stop = threading.Event()

    def spin():
        torch.set_num_threads(1)
        a = torch.randn(160, 160)
        while not stop.is_set():
            a @ a

    spinners = [threading.Thread(target=spin) for _ in range(os.cpu_count() or 1)]
    for t in spinners:
        t.start()
    threading.Timer(2.0, stop.set).start()
    machine, own = valve._machine_busy(), valve._own_busy()
    try:
        t0 = time.monotonic()
        (got,), opened = trio.run(lambda: _one_call())
        waited = time.monotonic() - t0
    finally:
        stop.set()
        for t in spinners:
            t.join()
    others = (valve._machine_busy() - machine - (valve._own_busy() - own)) / valve._TICK / waited
    if others >= valve.OTHERS_BUSY:  # then the valve is right to open: this case cannot be set up here
        pytest.skip(f"other programs used {others:.1f} cores meanwhile")
    assert got == ("caldrix image1", os.SCHED_IDLE) and not opened
    assert waited >= 1.0, f"the call was never starved ({waited:.2f} s): the test proved nothing"


async def _one_call():
    lim = DecodeLimiter(queue_depth=0)
    try:
        with trio.fail_after(60):
            got = await lim.run([0], work)
        return got, lim.valve.is_open
    finally:
        lim.close()
