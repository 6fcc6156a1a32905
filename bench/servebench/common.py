"""Shared by the serving benchmark's parts: paths, constants, statistics, process facts."""


from __future__ import annotations

import math
import os
import platform
import re
import socket
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
# Every peer runs in the environment the user gave this script; nothing sets
# OMP_WAIT_POLICY for them. Measured here with PASSIVE, llama.cpp's OpenMP pool decodes about
# 3.4 times slower (35 against 120 tok/s) and transformers generate about 2.4 times slower (19 against 45 tok/s). --llama-wait-policy active
# was tried too: no steady difference from leaving it unset, both swing between ~35 and ~120.
ENV = dict(os.environ)

BENCH_VENV = Path(os.environ.get("CALDRIX_BENCH_VENV") or ROOT / ".venv-bench")  # llama-cpp-python's own venv
LLAMA_SPEC = "llama-cpp-python[server]"
BUILD_LOG = BENCH_VENV / "build.log"
BUILD_FAILED = BENCH_VENV / "build-failed"  # the reason a build failed; --rebuild-llama tries again
# llama.cpp's native build enables its AMX kernels where the CPU has AMX; with llama-cpp-python
# 0.3.36 they crash on the first prompt of more than one token (seen here on a Sapphire Rapids
# VM), so on such CPUs the benchmark builds for AVX-512 without them.
NO_AMX_CMAKE_ARGS = " ".join(f"-DGGML_{opt}" for opt in (
    "NATIVE=OFF", "AVX=ON", "AVX2=ON", "FMA=ON", "F16C=ON", "AVX512=ON", "AVX512_VBMI=ON", "AVX512_VNNI=ON",
    "AVX512_BF16=ON", "AVX_VNNI=ON", "AMX_TILE=OFF", "AMX_INT8=OFF", "AMX_BF16=OFF"))
THREADS = 2
CONTEXT = 2048  # rows per sequence, the same for both servers: the longest request is 512 + 16
LISTENING = re.compile(r"caldrix: listening on (http://\S+)/v1")


T0 = time.monotonic()


def progress(msg: str) -> None:
    print(f"[bench {time.monotonic() - T0:6.0f}s] {msg}", file=sys.stderr, flush=True)


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def pct(xs: list[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not xs:
        return None
    s = sorted(xs)
    k = (len(s) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def median(xs: list[float]) -> float | None:
    return pct(xs, 0.5)


def ms(x: float | None) -> float | None:
    return None if x is None else x * 1000.0



def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def vm_hwm_mb(pid: int) -> float | None:
    """Peak resident set (VmHWM) of pid and its child processes, MiB."""
    total, seen = 0.0, False
    pids = [pid]
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            pids += [int(c) for c in (task / "children").read_text().split()]
    except OSError:
        pass
    for p in pids:
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    total += int(line.split()[1]) / 1024.0
                    seen = True
        except OSError:
            pass
    return round(total, 1) if seen else None



def cpu_ticks() -> list[int]:
    """/proc/stat's first line: user nice system idle iowait irq softirq steal ..."""
    try:
        return [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    except (OSError, ValueError, IndexError):
        return []


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown cpu"


