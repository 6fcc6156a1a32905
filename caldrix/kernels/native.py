"""The decode kernels (attend.cpp; q4mm.cpp's q4_mm and q8_rows; q4mm_f32.cpp; delta.cpp), compiled on
first use and cached (build.py compiles them).

`load()` makes `torch.ops.caldrix.decode_attend`, `decode_rope_attend` and `decode_norm` exist
in this process and says whether they are the compiled kernels. Where they cannot be compiled
(no C++ compiler, a failed build, or CALDRIX_NATIVE=0), it falls back to torch definitions of
the same ops with the same contracts (one scaled_dot_product_attention call a row; the RMSNorm
of ops.py), so callers, TorchScript included, have one name to call either way. Which one
runs is decided once a process: an engine's decode passes all use one of them, so a reply
never depends on which was picked for which step.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import List

import torch
import torch.nn.functional as F

from caldrix.kernels import build

log = logging.getLogger("caldrix.engine")

_lock = threading.Lock()
_state: str | None = None  # "native" | "torch", once decided
_why_torch: str | None = None  # why the kernels are not in use, once decided (None where they are)
_q4_mm = False  # whether the compiled library holds caldrix::q4_mm (q4mm.cpp)
_q4_mm_f32 = False  # and caldrix::q4_mm_f32 (q4mm_f32.cpp)


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
            cxx = build.compiler()
            if os.environ.get("CALDRIX_NATIVE", "1") == "0":
                _why_torch = "CALDRIX_NATIVE=0"
                log.info("decode attention: torch (CALDRIX_NATIVE=0)")
            elif cxx is None:
                _why_torch = "no C++ compiler found (install g++ or set CXX)"
                # INFO: the start-up's note (runtime.kernel_notes) tells the user already.
                log.info("decode attention: torch; %s for the faster kernel", _why_torch)
            else:
                out = build.cached_object(cxx)
                try:
                    if not out.exists():
                        build.build_object(cxx, out)
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
