"""The decode kernels (attend.cpp; q4mm.cpp's q4_mm and q8_rows; q4mm_f32.cpp; delta.cpp), compiled on
first use and cached.

`load()` makes `torch.ops.caldrix.decode_attend`, `decode_rope_attend` and `decode_norm` exist
in this process and says whether they are the compiled kernels. Where they cannot be compiled
(no C++ compiler, a failed build, or CALDRIX_NATIVE=0), it falls back to torch definitions of
the same ops with the same contracts (one scaled_dot_product_attention call a row; the RMSNorm
of ops.py), so callers, TorchScript included, have one name to call either way. Which one
runs is decided once a process: an engine's decode passes all use one of them, so a reply
never depends on which was picked for which step.

The build is one g++ call per source against torch's headers, as many at once as there are
cores and memory for (`_compile`), then a link: about 40 s on 2 cores, once per machine, torch
version and source. The shared object lives under the caldrix cache (kernels/<key>/), keyed by
all three, since -march=native code must not move to another CPU.
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
import threading
from pathlib import Path
from typing import List

import torch
import torch.nn.functional as F

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

_lock = threading.Lock()
_state: str | None = None  # "native" | "torch", once decided
_why_torch: str | None = None  # why the kernels are not in use, once decided (None where they are)
_q4_mm = False  # whether the compiled library holds caldrix::q4_mm (q4mm.cpp)
_q4_mm_f32 = False  # and caldrix::q4_mm_f32 (q4mm_f32.cpp)


def _cpu_fingerprint() -> str:
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    lines = [ln for ln in info.splitlines() if ln.startswith(("model name", "flags", "Features"))]
    return "\n".join(sorted(set(lines)))


def _compiler() -> list[str] | None:
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


def _compile(cxx: list[str], flags: list[str], includes: list[str], where: Path) -> list[Path]:
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


def _build(cxx: list[str], out: Path) -> None:
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
                    objects = _compile(cxx, flags, includes, Path(objs))
                except CompileError as exc:
                    # A compiler without OpenMP (Apple clang without libomp): the same kernels,
                    # whose at::parallel_for then runs on one thread.
                    if not _lacks_openmp(exc):
                        raise
                    flags = [f for f in FLAGS if f != "-fopenmp"]
                    try:
                        objects = _compile(cxx, flags, includes, Path(objs))
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


def _define_torch_fallback() -> None:
    lib = torch.library.Library("caldrix", "DEF")
    lib.define("decode_attend(Tensor q, Tensor k, Tensor v, Tensor(a!) K, Tensor(b!) V, int[] slots, int[] lengths, "
               "float scale) -> Tensor")
    lib.define("decode_rope_attend(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) K, Tensor(b!) V, int[] slots, "
               "int[] lengths, int heads, float scale) -> Tensor")
    lib.define("decode_norm(Tensor x, Tensor w, float eps) -> Tensor")
    lib.impl("decode_attend", torch_decode_attend, "CPU")
    lib.impl("decode_rope_attend", torch_decode_rope_attend, "CPU")
    lib.impl("decode_norm", torch_decode_norm, "CPU")
    _define_torch_fallback.lib = lib  # keep the registration alive
    _define_q4_mm_stub("q4_mm")
    _define_q4_mm_stub("q4_mm_f32")
    _define_q8_rows_stub()


_stubs = []  # keeps the stub registrations alive


def _define_q4_mm_stub(name: str) -> None:
    """caldrix::q4_mm or q4_mm_f32 where its source was not built (the CPU lacks AVX512-BF16,
    or AVX2, FMA and F16C, or there are no kernels at all): the name must exist for the scripted
    layers (kernels/scripted.py), which only call it where `has_q4_mm()` or `has_q4_mm_f32()`
    said it is the compiled kernel."""
    lib = torch.library.Library("caldrix", "FRAGMENT")
    lib.define(f"{name}(Tensor x, Tensor qw, Tensor dm) -> Tensor")
    lib.impl(name, _no_q4_mm, "CPU")
    _stubs.append(lib)


def _define_q8_rows_stub() -> None:
    """caldrix::q8_rows (q4mm.cpp, built with q4_mm): read only from the q4_mm layout, so where
    q4_mm is not built nothing calls it; the name must still exist for scripted.decode_logits."""
    lib = torch.library.Library("caldrix", "FRAGMENT")
    lib.define("q8_rows(Tensor ids, Tensor hi_qw, Tensor lo_qw, Tensor lo_dm) -> Tensor")
    lib.impl("q8_rows", _no_q8_rows, "CPU")
    _stubs.append(lib)


def _no_q8_rows(ids: torch.Tensor, hi_qw: torch.Tensor, lo_qw: torch.Tensor, lo_dm: torch.Tensor) -> torch.Tensor:
    raise NotImplementedError("caldrix::q8_rows reads q4_mm's layout, which was not compiled for this CPU "
                              "(AVX512-BF16)")


def _has_op(name: str) -> bool:
    try:
        getattr(torch.ops.caldrix, name)
    except (AttributeError, RuntimeError):
        return False
    return True


def _no_q4_mm(x: torch.Tensor, qw: torch.Tensor, dm: torch.Tensor) -> torch.Tensor:
    raise NotImplementedError("caldrix's 4-bit kernel was not compiled for this CPU (q4_mm: AVX512-BF16, "
                              "q4_mm_f32: AVX2, FMA and F16C)")


def torch_decode_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, K: torch.Tensor, V: torch.Tensor,
                        slots: List[int], lengths: List[int], scale: float) -> torch.Tensor:
    """The op in torch: q [T, H, E], k, v [T, G, E], K, V [S, G, C, E] -> [T, H * E]."""
    T, h, e = q.shape
    for i, (s, n) in enumerate(zip(slots, lengths)):
        if n:
            K[s, :, n - 1], V[s, :, n - 1] = k[i], v[i]
    qs = q.unsqueeze(2)
    zero = q.new_zeros(1, h, 1, e)
    out = [F.scaled_dot_product_attention(qs[i : i + 1], K[s : s + 1, :, :n], V[s : s + 1, :, :n], scale=scale,
                                          enable_gqa=True) if n else zero
           for i, (s, n) in enumerate(zip(slots, lengths))]
    return torch.cat(out).reshape(T, h * e)


def torch_decode_rope_attend(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, K: torch.Tensor,
                             V: torch.Tensor, slots: List[int], lengths: List[int], heads: int,
                             scale: float) -> torch.Tensor:
    """qkv [T, (H+2G)E], cos, sin [T, 1, E] -> [T, H * E]: split, RoPE, then decode_attend."""
    from caldrix.kernels.ops import apply_rope

    T, (g, e) = qkv.shape[0], (K.shape[1], K.shape[3])
    qk, v = qkv.split([(heads + g) * e, g * e], dim=-1)
    qk = apply_rope(qk.view(T, heads + g, e), cos.view(T, 1, e), sin.view(T, 1, e))
    return torch.ops.caldrix.decode_attend(qk[:, :heads], qk[:, heads:], v.view(T, g, e), K, V, slots, lengths, scale)


def torch_decode_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """ops.rms_norm, the models' RMSNorm: x [T, D] -> [T, D]."""
    from caldrix.kernels.ops import rms_norm

    return rms_norm(x, w, eps)


def load() -> bool:
    """Register the caldrix ops in this process, once; whether they are the compiled kernels.
    Blocks while compiling (first use on a machine) or while another process compiles."""
    global _state, _why_torch
    with _lock:
        if _state is None:
            _state = "torch"
            cxx = _compiler()
            if os.environ.get("CALDRIX_NATIVE", "1") == "0":
                _why_torch = "CALDRIX_NATIVE=0"
                log.info("decode attention: torch (CALDRIX_NATIVE=0)")
            elif cxx is None:
                _why_torch = "no C++ compiler found (install g++ or set CXX)"
                # INFO: the start-up's note (runtime.kernel_notes) tells the user already.
                log.info("decode attention: torch; %s for the faster kernel", _why_torch)
            else:
                from caldrix.weights.gguf import cache_root

                out = cache_root() / "kernels" / _key(cxx) / "attend.so"
                try:
                    if not out.exists():
                        _build(cxx, out)
                    torch.ops.load_library(str(out))
                    _state = "native"
                    global _q4_mm, _q4_mm_f32
                    _q4_mm = _has_op("q4_mm")  # q4mm.cpp is empty without AVX512-BF16
                    _q4_mm_f32 = _has_op("q4_mm_f32")  # q4mm_f32.cpp without AVX2, FMA and F16C
                    for name, built in (("q4_mm", _q4_mm), ("q4_mm_f32", _q4_mm_f32)):
                        if not built:
                            _define_q4_mm_stub(name)
                    if not _q4_mm:
                        _define_q8_rows_stub()
                except Exception as exc:  # noqa: BLE001 -- the torch definition below always works
                    _why_torch = f"the kernels did not build or load: {_first_line(exc)}"
                    log.info("decode attention: torch; the kernel did not build or load (%s)", exc)
            if _state == "torch":
                _define_torch_fallback()
        return _state == "native"


def why_torch() -> str | None:
    """Why this process runs the torch definitions instead of the compiled kernels, in one
    line for the start-up (runtime.announce); None where the kernels loaded. Calls `load()`."""
    load()
    return _why_torch


def _first_line(exc: BaseException) -> str:
    """A compiler's error is many lines; the start-up shows the first that names an error."""
    text = str(exc).strip() or type(exc).__name__
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    head = lines[0]
    errors = [ln for ln in lines[1:] if "error" in ln.lower()]
    return (f"{head} {errors[0]}" if errors else head)[:300]


def has_q4_mm() -> bool:
    """Whether the compiled caldrix::q4_mm (q4mm.cpp) is here: built only for CPUs with
    AVX512-BF16, and never in the torch fallback (torch's int4 kernel serves there)."""
    return load() and _q4_mm


def has_delta_decode() -> bool:
    """Whether the compiled caldrix::delta_decode (delta.cpp) is here; without it Qwen3.5's
    decode runs the same maths as torch ops (models/qwen3_5.py)."""
    return load() and _has_op("delta_decode")


def has_q4_vnni() -> bool:
    """Whether the compiled caldrix::q4_vnni (q4vnni.cpp) is here: built for CPUs with
    AVX512-VNNI; without it `--weights q4` layers take torch's int4 kernel."""
    return load() and _has_op("q4_vnni")


def has_tower_kernels() -> bool:
    """Whether the compiled caldrix::tile_attend (tower.cpp) is here: built for CPUs with
    AMX-BF16; without it the vision tower runs torch's attention."""
    return load() and _has_op("tile_attend")


def has_tile_linear() -> bool:
    """Whether the compiled caldrix::tile_linear and tile_pack_weight (tile_linear.cpp) are
    here: built for CPUs with AMX-BF16, as tower.cpp."""
    return load() and _has_op("tile_linear")


def has_prompt_attend() -> bool:
    """Whether the compiled caldrix::prompt_attend (prompt_attend.cpp) is here: built for CPUs
    with AMX-BF16, as tower.cpp; without it every prompt chunk attends with torch's SDPA."""
    return load() and _has_op("prompt_attend")


def has_lanczos_rgb() -> bool:
    """Whether the compiled caldrix::lanczos_rgb (resample.cpp) is here: built for CPUs with
    AVX-512 F and BW; without it image preprocessing resizes with Pillow (the same bytes)."""
    return load() and _has_op("lanczos_rgb")


def has_q4_mm_f32() -> bool:
    """Whether the compiled caldrix::q4_mm_f32 (q4mm_f32.cpp) is here: built for CPUs with
    AVX2, FMA and F16C; without it a float32 engine keeps dense weights."""
    return load() and _q4_mm_f32


def usable(dtype: torch.dtype, head_dim: int, device) -> bool:
    """Whether the compiled kernels serve an engine of this dtype (bfloat16 or float32), head
    dim and device."""
    return (dtype in (torch.bfloat16, torch.float32) and head_dim in (64, 128) and torch.device(device).type == "cpu"
            and load())
