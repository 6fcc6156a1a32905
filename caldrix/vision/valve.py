"""The image slots' valve: when other programs keep the machine busy, image work stops yielding.

An image slot's thread runs under SCHED_IDLE (limiter.py says why): it takes only the CPU no
other thread wants. Against caldrix's own decode steps that is the point, but SCHED_IDLE yields
to every thread on the machine, so while other programs keep every core busy an image call
gets almost nothing (a weight of 3 against 1024: on 2 cores beside two busy loops, a 0.15 s
tile took minutes) and its request waits as long as they run.

The valve tells the two apart. While a call runs, the slot watches it (`Watch`): the share of a
core the call's thread got (its CPU clock against the wall clock), and how many cores the rest
of the machine used meanwhile, outside this process (/proc/stat's busy time less
/proc/self/stat's). A call that got less than `STARVED_SHARE` of a core while other programs
used at least `OTHERS_BUSY` cores is starved by them, and the valve opens for `FAIR_HOLD_S`:
while it is open every image call runs on a thread at the process's priority. The starved call
itself is rescued in one of two ways:
- Where the kernel lets this process raise a thread's priority again (root, CAP_SYS_NICE, or
  an RLIMIT_NICE of 20), `promote` puts the starved thread, and the OpenMP helpers it started,
  back under the normal policy at the process's nice value; the call goes on where it was.
- Elsewhere the call runs again on the fair thread, and the starved thread is let go with its
  call (a tile's work touches nothing shared). It finishes on idle CPU. Until it does, it can
  be preempted while it holds Python's GIL and stall the other threads for a moment: the one
  cost of a let-go call, and the reason promotion comes first.
A call starved by caldrix's own steps alone keeps waiting for their gaps, as designed.

Linux only (/proc and thread CPU clocks); elsewhere nothing is ever judged starved, and the
threads carry no SCHED_IDLE there either.
"""

from __future__ import annotations

import logging
import os
import time

from caldrix.sched.runners import FAIR_HOLD_S, STARVED_SHARE  # the prefill lane's valve's: one policy for both

log = logging.getLogger("caldrix")

OTHERS_BUSY = 0.5  # cores other programs used meanwhile for the starving to be theirs
JUDGED_AFTER_S = 0.5  # a call is first judged after this long (a tile takes about 0.15 s alone)
WATCH_S = 0.25  # how often a running call is judged after that

try:
    _TICK = os.sysconf("SC_CLK_TCK")
except (AttributeError, ValueError, OSError):
    _TICK = 100


def _machine_busy() -> int | None:
    """Busy jiffies of every CPU since boot (user, nice, system, irq, softirq, steal), or None."""
    try:
        with open("/proc/stat", "rb") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if len(fields) < 9 or fields[0] != b"cpu":
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[1:9])
    return user + nice + system + irq + softirq + steal


def _own_busy() -> int | None:
    """This process's CPU jiffies since it started (utime + stime), or None."""
    try:
        with open("/proc/self/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # after the command name in parentheses (which may hold spaces): field 3 on; utime, stime are 14, 15
    rest = stat[stat.rfind(b")") + 2:].split()
    return int(rest[11]) + int(rest[12])


def _thread_cpu(ident: int) -> float | None:
    """CPU seconds of the thread `ident` (threading ident), or None where it cannot be read."""
    try:
        return time.clock_gettime(time.pthread_getcpuclockid(ident))
    except (AttributeError, OSError, OverflowError):
        return None


def starved(cpu_s: float, wall_s: float, others_cores: float) -> bool:
    """Whether a call that ran `wall_s` with `cpu_s` of its thread's CPU, while other programs
    used `others_cores` cores on average, is starved by them (module docstring)."""
    return wall_s >= JUDGED_AFTER_S and cpu_s < STARVED_SHARE * wall_s and others_cores >= OTHERS_BUSY


class Watch:
    """The counters at a call's start on the thread `ident`; `starved()` judges it so far."""

    def __init__(self, ident: int) -> None:
        self.ident = ident
        self.wall = time.monotonic()
        self.cpu = _thread_cpu(ident)
        self.machine = _machine_busy()
        self.own = _own_busy()

    def starved(self) -> bool:
        cpu, machine, own = _thread_cpu(self.ident), _machine_busy(), _own_busy()
        if None in (cpu, machine, own, self.cpu, self.machine, self.own):
            return False
        wall = time.monotonic() - self.wall
        others = (machine - self.machine - (own - self.own)) / _TICK / max(wall, 1e-9)
        return starved(cpu - self.cpu, wall, others)


def promote(name: str) -> bool:
    """Put this process's threads named `name` (a slot's thread and the OpenMP helpers it
    started, which inherit its name) under the normal policy at the process's nice value.
    False where the kernel refuses it or cannot be asked (not Linux): nothing was changed
    then, or the rest is left as it was."""
    if not hasattr(os, "sched_setscheduler"):
        return False
    nice = os.getpriority(os.PRIO_PROCESS, 0)
    comm = name[:15].encode()
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return False
    found = False
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/comm", "rb") as f:
                if f.read().rstrip(b"\n") != comm:
                    continue
            os.sched_setscheduler(int(tid), os.SCHED_OTHER, os.sched_param(0))
            os.setpriority(os.PRIO_PROCESS, int(tid), nice)
            found = True
        except FileNotFoundError:  # it ended meanwhile
            continue
        except OSError:  # refused: the caller reruns the call instead
            return False
    return found


class Valve:
    """Open (image calls at the process's priority) until `fair_until`, server-wide."""

    def __init__(self) -> None:
        self.fair_until = 0.0  # monotonic time until which the valve stays open

    @property
    def is_open(self) -> bool:
        return time.monotonic() < self.fair_until

    def open(self) -> None:
        log.warning("an image call got less than %.0f%% of a core while other programs kept the machine "
                    "busy; image calls run at normal priority for %.0f s", 100 * STARVED_SHARE, FAIR_HOLD_S)
        self.fair_until = time.monotonic() + FAIR_HOLD_S
