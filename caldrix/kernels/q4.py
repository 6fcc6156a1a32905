"""Keep a GGUF's Q4_1 blocks 4-bit for the matmul, no re-quantizing.

A Q4_1 block holds 32 weights of one row as w = d * q + m, with q in 0..15 and d, m float16.
Three kernels take them as they are. caldrix::q4_mm (q4mm.cpp, CPUs with AVX512-BF16) reads
the nibbles in its own column-group layout (`q4_mm_layout`) with d and m in float16, as the GGUF
stores them, for bfloat16 rows. caldrix::q4_mm_f32 (q4mm_f32.cpp, CPUs with AVX2, FMA and
F16C) does the same for float32 rows, in another layout (`q4_mm_f32_layout`): the engine of a
CPU without native bfloat16. torch's int4 weight-only kernel computes w = (q - 8) * scale +
zero per group, so the GGUF's q values go in unchanged with scale = d and zero = m + 8 d, rounded to bfloat16, the
kernel's dtype; it serves a bfloat16 engine where q4_mm is not built.

This file holds the blocks and the layers that multiply by them; which of a model's weights
become such layers, read from which GGUF tensors, is the architecture's loader's business
(models/llama_load.py).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from caldrix.kernels import native
from caldrix.kernels.packed import CALL_ROWS

GROUP = 32
Q4_1 = 3  # ggml type id
BLOCK_BYTES = 20  # float16 d, float16 m, 16 bytes of nibbles
Q8_0 = 8  # ggml type id: float16 d, then 32 int8 q; w = d * q
Q8_0_BYTES = 34


def available() -> bool:
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")


def ours_built(dtype: torch.dtype) -> bool:
    """Whether caldrix's own 4-bit kernel for activations of `dtype` is compiled here: q4_mm
    for bfloat16 (CPUs with AVX512-BF16), q4_mm_f32 for float32 (AVX2, FMA and F16C)."""
    if dtype == torch.float32:
        return native.has_q4_mm_f32()
    return dtype == torch.bfloat16 and native.has_q4_mm()


def runs_4bit(dtype: torch.dtype, device: str) -> bool:
    """Whether an engine of this dtype on this device can keep the 4-bit blocks: on the CPU,
    through caldrix's own kernel for the dtype, or for bfloat16 through torch's."""
    return device == "cpu" and (ours_built(dtype) or (dtype == torch.bfloat16 and available()))


def torch_int4_only(dtype: torch.dtype) -> None:
    """Weights laid out for torch's int4 kernel take bfloat16 activations alone."""
    if dtype != torch.bfloat16:
        raise ValueError(f"torch's int4 kernel takes bfloat16 activations, not {dtype}; "
                         "float32 needs caldrix::q4_mm_f32")


def unpack_q4_1(raw: np.ndarray, cols: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """raw: uint8 [N, blocks * 20] -> q uint8 [N, K] (0..15; bytes, since int32 q and their
    temporaries were most of loading's peak), d and m float32 [N, blocks]."""
    n = raw.shape[0]
    blocks = raw.reshape(n, cols // GROUP, BLOCK_BYTES)
    d = blocks[:, :, 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    m = blocks[:, :, 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    nib = blocks[:, :, 4:]  # byte j: weight j in the low nibble, weight j + 16 in the high one
    q = np.concatenate([nib & 0x0F, nib >> 4], axis=-1).reshape(n, cols)
    return torch.from_numpy(q), torch.from_numpy(d), torch.from_numpy(m)


def unpack_q8_0(raw: np.ndarray, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """raw: uint8 [N, blocks * 34] -> q int8 [N, K], d float32 [N, blocks]. int8, not int32: for
    SmolLM2's 49152 x 576 head an int32 q and the temporaries made from it were most of
    loading's peak memory (docs/performance-history.md)."""
    n = raw.shape[0]
    blocks = raw.reshape(n, cols // GROUP, Q8_0_BYTES)
    d = blocks[:, :, 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    q = blocks[:, :, 2:].copy().view(np.int8).reshape(n, cols)
    return torch.from_numpy(q), torch.from_numpy(d)


# Rows per call up to which torch's int4 kernel is used where an Int4Linear keeps dense weights
# beside its blocks (only torch's kernel does); the loader sets it to --max-batch, so every
# decode step takes the 4-bit path and prefill chunks the dense one. Measured on 2 cores (bf16,
# one thread, SmolLM2's gate/up projection): 4-bit 70/135/265 us at 1/4/8 rows against dense
# 153/165/203 us; at 128-row prefill chunks 540 tokens/s against the dense 930. caldrix's own
# kernels take every call: at 128 rows as fast as the dense matmul (docs/performance-history.md).
MAX_INT4_ROWS = 8

# Rows per call from which a layer on caldrix::q4_mm (bfloat16) unpacks its blocks into dense
# weights for the call (caldrix::q4_dense, the same bits as the dense conversion) and takes
# oneDNN's matmul instead, on CPUs with AMX only (`unpacks_long_calls`); only calls past
# `max_int4_rows` too, so decode steps never do. Measured on 2 cores of a Xeon with AMX,
# SmolLM2, a 512-token prompt in 128-row chunks: 0.81 s on q4_mm against 0.33 s unpacked (one
# thread: 1.54 against 0.66 s). Without AMX (a Zen 4 EPYC, AVX512-BF16) the dense matmul was only
# at par with q4_mm at 128 rows (docs/performance-history.md), so there unpacking would only
# add its cost.
UNPACK_FROM_ROWS = 32
# The most rows one matmul on unpacked weights takes; a longer chunk is multiplied in pieces of
# this many, against one unpacking: the dense decoder matmuls' bound (packed.CALL_ROWS says why).
UNPACKED_CALL_ROWS = CALL_ROWS


def unpacks_long_calls() -> bool:
    """Whether Int4Linear layers on caldrix::q4_mm unpack their blocks for calls of many rows:
    where oneDNN's bfloat16 matmul has AMX tiles. A property of the machine, fixed for the
    process, so which kernel computes a prompt's rows never depends on timing."""
    probe = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool(probe and probe()) and torch.backends.mkldnn.is_available()


def q4_mm_layout(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q integers [N, K] in 0..15, d and m [N, K / GROUP] -> caldrix::q4_mm's operands (q4mm.cpp):
    nibbles uint8 [N, K / 2] in 16-column groups, 32 bytes per 4 k's (byte 2c: column c's
    k0 | k2 << 4, byte 2c + 1: k1 | k3 << 4); d and m float16 [N / 16, K / GROUP, 2, 16]: the
    GGUF's own float16 values (the kernel computes m - 128 d in float32), so they must round-trip."""
    n, k = q.shape
    q = q.to(torch.uint8)  # 0..15: bytes from here on, not the caller's int32
    g = q.view(n // 16, 16, k // 4, 4).permute(0, 2, 1, 3)  # [groups, k / 4, column, k within 4]
    qw = (g[..., 0:2] | (g[..., 2:4] << 4)).reshape(n, k // 2).contiguous()
    dm = _float16_scales(d, m, "q4_mm_layout")
    return qw, dm.view(2, n // 16, 16, k // GROUP).permute(1, 3, 0, 2).contiguous()


def _float16_scales(d: torch.Tensor, m: torch.Tensor, who: str) -> torch.Tensor:
    """[2, N, K / GROUP] float16: d then m, refused unless float16 holds them exactly."""
    dm = torch.stack([d, m]).half()
    if not torch.equal(dm.float(), torch.stack([d.float(), m.float()])):
        raise ValueError(f"{who}: d and m must be float16 values (as a GGUF stores them)")
    return dm


def q4_mm_f32_layout(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q integers [N, K] in 0..15, d and m [N, K / GROUP] -> caldrix::q4_mm_f32's operands
    (q4mm_f32.cpp): nibbles uint8 [N, K / 2] in 8-column groups, 32 bytes per 8 k's (dword c:
    column c's nibbles, k j at bits 4j, little-endian); d and m float16 [N / 8, K / GROUP, 2, 8],
    which must round-trip as in q4_mm_layout."""
    n, k = q.shape
    q = q.to(torch.uint8)  # 0..15: bytes from here on, not the caller's int32
    g = q.view(n // 8, 8, k // 8, 8).permute(0, 2, 1, 3)  # [groups, k / 8, column, k within 8]
    pairs = g[..., 0::2] | (g[..., 1::2] << 4)  # byte i of a dword: k 2i low, k 2i + 1 high
    qw = pairs.reshape(n, k // 2).contiguous()
    dm = _float16_scales(d, m, "q4_mm_f32_layout").view(2, n // 8, 8, k // GROUP).permute(1, 3, 0, 2)
    return qw, dm.contiguous()


def int4_mm(x: torch.Tensor, packed: torch.Tensor, scale_zero: torch.Tensor, ours: bool) -> torch.Tensor:
    """x [T, K] -> [T, N], x's dtype, through the kernel the weights were laid out for: with
    `ours`, caldrix's own for x's dtype (q4_mm for bfloat16, q4_mm_f32 for float32; contiguous x
    only), else torch's (bfloat16). The scripted decode layers (scripted.py) call it too, hence
    GROUP written out as 32: TorchScript takes no module globals."""
    if ours:
        if x.dtype == torch.float32:
            return torch.ops.caldrix.q4_mm_f32(x, packed, scale_zero)
        return torch.ops.caldrix.q4_mm(x, packed, scale_zero)
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, 32, scale_zero)


def ours_fits(n: int, k: int, dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether caldrix's kernel for `dtype` can take an [n, k] weight: whole blocks, and
    column groups of 16 (q4_mm) or 8 (q4_mm_f32)."""
    return n % (8 if dtype == torch.float32 else 16) == 0 and k % GROUP == 0


def layout(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """caldrix's kernel operands for activations of `dtype` (see q4_mm_layout, q4_mm_f32_layout)."""
    return (q4_mm_f32_layout if dtype == torch.float32 else q4_mm_layout)(q, d, m)


class Int4Linear(nn.Module):
    """y = x @ W.T with W held as packed 4-bit groups (activations of `dtype`).

    `ours`: the weights are laid out for caldrix's kernel for `dtype` (q4_mm, kernels/q4mm.cpp,
    for bfloat16; q4_mm_f32, q4mm_f32.cpp, for float32), else for torch's int4 weight-only
    kernel (bfloat16 only); `packed` and `scale_zero` hold that kernel's operands either way. An
    engine picks one kernel for all its layers (quantize_from_gguf): the two round differently.
    Calls of more than `max_int4_rows` rows (prefill chunks) use `dense`, the same weights
    dequantized, when one is given: quantize_from_gguf gives one only for torch's kernel, which
    is slower than the dense matmul there. On caldrix's bfloat16 kernel, on a CPU with AMX, such
    calls of more than UNPACK_FROM_ROWS rows unpack the blocks for the call instead
    (caldrix::q4_dense: the dense weights' bits, no copy held). Decode steps are never past
    `max_int4_rows`, so they always take the 4-bit kernel."""

    def __init__(self, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor, dense: torch.Tensor | None = None,
                 ours: bool = False, dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        # q [N, K] integers in 0..15; d, m [N, K / GROUP]
        self.out_features, self.in_features = q.shape
        self.ours = ours
        if ours:
            packed, scale_zero = layout(q, d, m, dtype)
        else:
            torch_int4_only(dtype)
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 1)
            scale_zero = torch.stack([d, m + 8 * d], dim=-1).transpose(0, 1)  # [K / GROUP, N, 2]
            scale_zero = scale_zero.to(torch.bfloat16).contiguous()
        self.register_buffer("packed", packed)
        self.register_buffer("scale_zero", scale_zero)
        self.dense = dense
        self.max_int4_rows = MAX_INT4_ROWS
        # rows from which a call unpacks the blocks (UNPACK_FROM_ROWS), or None: never
        self.unpack_rows = UNPACK_FROM_ROWS if ours and dtype == torch.bfloat16 and unpacks_long_calls() else None
        self.group = GROUP

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > self.max_int4_rows:
            if self.dense is not None:
                return torch.nn.functional.linear(x, self.dense)
            if self.unpack_rows is not None and x.shape[0] > self.unpack_rows:
                w = torch.ops.caldrix.q4_dense(self.packed, self.scale_zero)
                if x.shape[0] <= UNPACKED_CALL_ROWS:
                    return torch.nn.functional.linear(x, w)
                return torch.cat([torch.nn.functional.linear(part, w) for part in x.split(UNPACKED_CALL_ROWS)])
        return int4_mm(x.contiguous(), self.packed, self.scale_zero, self.ours)


# Rows of the Q8_0 head laid out at a time (a multiple of both kernels' column groups).
HEAD_SLICE = 4096


class Q8AsInt4Linear(nn.Module):
    """y = x @ W.T, fp32 out, with W held as a GGUF's Q8_0 blocks split into two 4-bit halves.

    q = 16 hi + lo, with hi in -8..7 and lo in 0..15, so W = (16 d) hi + d lo: two calls of
    the 4-bit kernel, hi with scale 16 d and zero 0, lo with scale d and zero 8 d. The q values
    stay exact. Through torch's kernel (d rounded to bfloat16), measured on 2 cores for
    SmolLM2's 49152 x 576 lm_head: 3.5 ms a row against 7.2 ms dense bf16, but 12.4 ms at 8
    rows against 6.5 ms, so the engine uses it there only at --max-batch 1. Through
    caldrix::q4_mm (d float32): 0.55 ms a row and 1.6 ms at 8 rows on another machine, where
    the dense head took about 2.6 ms at 8, so every engine uses it."""

    def __init__(self, q: torch.Tensor, d: torch.Tensor, ours: bool = False, dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        self.out_features, self.in_features = q.shape
        self.ours = ours
        if not ours:
            torch_int4_only(dtype)

        def half(nibbles, scale, zero):  # w = (nibble - 8) * scale + zero
            if ours:  # as Q4_1: w = scale * nibble + (zero - 8 scale)
                return layout(nibbles, scale, zero - 8 * scale, dtype)
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(nibbles.to(torch.int32).contiguous(), 1)
            return packed, torch.stack([scale, zero], dim=-1).transpose(0, 1).to(torch.bfloat16).contiguous()

        def halves(q, d):
            return (*half((q >> 4) + 8, 16 * d, torch.zeros_like(d)), *half(q & 15, d, 8 * d))

        if ours:
            # In slices of rows, each written into its place: the temporaries of the whole head
            # at once were loading's peak. Both layouts keep a slice's rows together (qw by
            # row, the scales by column group), so the slices concatenate along dim 0.
            n = q.shape[0]
            out: list[torch.Tensor] = []
            for i in range(0, n, HEAD_SLICE):
                part = halves(q[i:i + HEAD_SLICE], d[i:i + HEAD_SLICE])
                rows = min(HEAD_SLICE, n - i)
                if not out:
                    out = [torch.empty((x.shape[0] * n // rows, *x.shape[1:]), dtype=x.dtype) for x in part]
                for whole, x in zip(out, part):
                    at = i * x.shape[0] // rows  # a slice's rows, or its column groups
                    whole[at:at + x.shape[0]] = x
            hi_packed, hi_sz, lo_packed, lo_sz = out
        else:
            hi_packed, hi_sz, lo_packed, lo_sz = halves(q, d)
        self.register_buffer("hi_packed", hi_packed)
        self.register_buffer("hi_scale_zero", hi_sz)
        self.register_buffer("lo_packed", lo_packed)
        self.register_buffer("lo_scale_zero", lo_sz)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        hi = int4_mm(x, self.hi_packed, self.hi_scale_zero, self.ours)
        return hi.float() + int4_mm(x, self.lo_packed, self.lo_scale_zero, self.ours).float()


class Q8Embedding(nn.Module):
    """A tied embedding served from the Q8_0 head's blocks (caldrix::q8_rows, q4mm.cpp): token
    ids [T] -> bfloat16 rows [T, D], the same bits as the dense table it replaces
    (`embed_from_head` checks every row), with no dense copy held. It reads the head's tensors;
    it owns none, so the state dict has them once."""

    def __init__(self, head: Q8AsInt4Linear):
        super().__init__()
        self.num_embeddings, self.embedding_dim = head.out_features, head.in_features
        self._head = (head,)  # a tuple, so nn.Module does not register the head a second time

    @property
    def operands(self) -> list[torch.Tensor]:
        """q8_rows' operands after the ids: hi nibbles, lo nibbles, lo scales."""
        head = self._head[0]
        return [head.hi_packed, head.lo_packed, head.lo_scale_zero]

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        return torch.ops.caldrix.q8_rows(token_ids, *self.operands)
