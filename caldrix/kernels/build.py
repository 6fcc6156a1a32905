"""Compiling caldrix's C++ kernels (this folder's *.cpp) into one shared object, cached.

The build is one compiler call per source against torch's headers, as many at once as there are
cores and memory for (`compile_sources`), then a link: about 40 s on 2 cores, once per machine, torch
version and source. The object lives under the caldrix cache (kernels/<key>/attend.so), keyed by
all three and the compiler (`cached_object`), since -march=native code must not move to another
CPU. native.py loads it; this module never imports torch's ops, only its headers' paths.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

log = logging.getLogger("caldrix.engine")

# attend.cpp: decode_attend, decode_rope_attend, decode_norm; q4mm.cpp: q4_mm, where the CPU has
# AVX512-BF16; q4mm_f32.cpp: q4_mm_f32, where it has AVX2, FMA and F16C; delta.cpp: delta_decode
# (Qwen3.5's linear-attention decode step, plain C++); q4vnni.cpp: q4_vnni, where it has
# AVX512-VNNI (--weights q4's blocks); tower.cpp: tile_attend, and tile_linear.cpp: tile_linear,
# where it has AMX-BF16 (the vision tower); amx.h is what those two share; resample.cpp:
# lanczos_rgb and normalise_pixels, where it has AVX-512 F and BW (image preprocessing);
# prompt_attend.cpp: prompt_attend, where it has AMX-BF16 (an image prompt's chunks), on
# tower.cpp's tiles (attend_tiles.h)
SOURCES = [Path(__file__).with_name(name) for name in ("attend.cpp", "q4mm.cpp", "q4mm_f32.cpp", "delta.cpp",
                                                                  "q4vnni.cpp", "tower.cpp", "tile_linear.cpp",
                                                                  "resample.cpp", "prompt_attend.cpp")]
HEADERS = [Path(__file__).with_name(name) for name in ("amx.h", "attend_tiles.h")]
FLAGS = ["-O3", "-march=native", "-fopenmp", "-std=c++17", "-fPIC", "-shared", "-Wno-c++20-extensions"]


def _cpu_fingerprint() -> str:
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    lines = [ln for ln in info.splitlines() if ln.startswith(("model name", "flags", "Features"))]
    return "\n".join(sorted(set(lines)))


def compiler() -> list[str] | None:
    """The compiler's command: $CXX split as a shell would (`ccache g++`, `g++ -O2`: make and
    CMake take those too), else the first of c++, g++ and clang++ on PATH."""
    if os.environ.get("CXX", "").strip():
        return shlex.split(os.environ["CXX"])
    found = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    return [found] if found else None


def _key(cxx: list[str]) -> str:
    h = hashlib.sha256()
    for part in (*(src.read_bytes() for src in (*SOURCES, *HEADERS)), torch.__version__.encode(), str(torch.version.git_version).encode(),
                 shlex.join(cxx).encode(), " ".join(FLAGS).encode(), _cpu_fingerprint().encode()):
        h.update(part)
        h.update(b"\0")
    return h.hexdigest()[:16]


MAX_JOBS = 4  # compilers at once, at most
COMPILER_BYTES = 640 << 20  # one compiler's peak with torch's headers (530 MB measured a source)


def _free_bytes() -> int | None:
    """Memory this process may still take: Linux's MemAvailable, and under a cgroup v2 memory
    limit (a container's) what is left of it; None where neither can be read."""
    known = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                known.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError):
        pass
    try:
        cg = Path("/sys/fs/cgroup")
        limit = (cg / "memory.max").read_text().strip()
        if limit != "max":
            known.append(int(limit) - int((cg / "memory.current").read_text()))
    except (OSError, ValueError):
        pass
    return min(known) if known else None


class CompileError(RuntimeError):
    """A compiler call failed: its exit status (negative: killed by that signal) and message."""

    def __init__(self, cxx: list[str], returncode: int, err: str, what: str = "") -> None:
        how = f"killed by signal {-returncode}" if returncode < 0 else f"exited {returncode}"
        super().__init__(f"{shlex.join(cxx)} {how}{what}: {err.strip()[-2000:]}")
        self.returncode, self.err = returncode, err


# What a compiler says when it has no OpenMP: clang without libomp ("unsupported option
# '-fopenmp'", "'omp.h' file not found"), a missing libgomp at link ("cannot find -lgomp").
_NO_OPENMP = re.compile(r"fopenmp|omp\.h|gomp|libomp", re.IGNORECASE)


def _lacks_openmp(exc: CompileError) -> bool:
    """Whether a failed build is worth retrying without -fopenmp: the compiler ran to its end
    and named OpenMP. A compiler killed by a signal (Ctrl-C reaches it too, being in the
    terminal's process group; the kernel's OOM killer) says nothing about OpenMP, and a build
    without it cached for good would leave every later start on one thread."""
    return exc.returncode > 0 and bool(_NO_OPENMP.search(exc.err))


def compile_sources(cxx: list[str], flags: list[str], includes: list[str], where: Path) -> list[Path]:
    """Each source to an object file in `where`, as many at once as there are cores and memory
    for, up to MAX_JOBS (the sources are independent: one g++ call for all of them ran them one after
    another, about a minute on 2 cores). Blocks until all are done; CompileError with the
    compiler's message for the first that fails, the others then stopped."""
    pending, running, objects = list(SOURCES), [], []
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    free = _free_bytes()  # a 1.5 GiB container with the model loaded has room for one
    jobs = max(1, min(MAX_JOBS, cores, cores if free is None else free // COMPILER_BYTES))
    try:
        while pending or running:
            while pending and len(running) < jobs:
                src = pending.pop(0)
                obj = where / f"{src.stem}.o"
                running.append((obj, subprocess.Popen([*cxx, *flags, "-c", str(src), "-o", str(obj), *includes],
                                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)))
            obj, proc = running.pop(0)
            _, err = proc.communicate()
            if proc.returncode != 0:
                raise CompileError(cxx, proc.returncode, err)
            objects.append(obj)
    finally:
        for _, proc in running:
            proc.kill()
            proc.wait()
    return objects


def build_object(cxx: list[str], out: Path) -> None:
    """Compile the sources into `out`, atomically: a concurrent process waits on the lock file
    and then finds the finished object. A failed build leaves nothing behind, and the files of
    one that was killed are cleared by the next (under the lock, no build is running here)."""
    from torch.utils.cpp_extension import include_paths, library_paths

    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / "build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if out.exists():
            return
        for stale in out.parent.glob("tmp*"):
            if stale.is_dir():
                shutil.rmtree(stale, ignore_errors=True)
            else:
                stale.unlink(missing_ok=True)
        print("caldrix: compiling the kernels (once per machine and torch version, about 40 s on 2 cores)",
              file=sys.stderr, flush=True)
        libs = library_paths()
        includes = [f"-I{p}" for p in include_paths()]
        link = [*(f"-L{p}" for p in libs), *(f"-Wl,-rpath,{p}" for p in libs), "-lc10", "-ltorch_cpu"]
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
        os.close(fd)
        try:
            with tempfile.TemporaryDirectory(dir=out.parent) as objs:
                flags = FLAGS
                try:
                    objects = compile_sources(cxx, flags, includes, Path(objs))
                except CompileError as exc:
                    # A compiler without OpenMP (Apple clang without libomp): the same kernels,
                    # whose at::parallel_for then runs on one thread.
                    if not _lacks_openmp(exc):
                        raise
                    flags = [f for f in FLAGS if f != "-fopenmp"]
                    try:
                        objects = compile_sources(cxx, flags, includes, Path(objs))
                    except CompileError:
                        raise exc from None
                    log.warning("kernels built without OpenMP (%s failed with -fopenmp): one thread each", shlex.join(cxx))
                r = subprocess.run([*cxx, *flags, *map(str, objects), "-o", tmp, *link], capture_output=True, text=True)
                if r.returncode != 0:
                    raise CompileError(cxx, r.returncode, r.stderr, " linking")
            # mkstemp made it private (0600); a cache one user fills may serve others (models.md).
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(tmp, 0o755 & ~umask)
            os.replace(tmp, out)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)


def cached_object(cxx: list[str]) -> Path:
    """Where the object built by `cxx` lives in the caldrix cache (whether or not it exists yet)."""
    from caldrix.weights.gguf import cache_root

    return cache_root() / "kernels" / _key(cxx) / "attend.so"
