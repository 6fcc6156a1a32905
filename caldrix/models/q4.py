"""Keep a GGUF's Q4_1 blocks 4-bit: torch's int4 weight-only CPU matmul, no re-quantizing.

A Q4_1 block holds 32 weights of one row as w = d * q + m, with q in 0..15 and d, m float16.
torch's int4 kernel computes w = (q - 8) * scale + zero per group, so the GGUF's own q values
go in unchanged with scale = d and zero = m + 8 d. The one rounding is of scale and zero to
bfloat16, the kernel's dtype, which is why this path is taken only for a bfloat16 engine.

llama.cpp's converter stores the q and k projections with their rows permuted (for its
interleaved RoPE); rows move whole, blocks and all, so undoing it is a row gather.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import nn

from caldrix.models.gguf_index import read_tensors

GROUP = 32
Q4_1 = 3  # ggml type id
BLOCK_BYTES = 20  # float16 d, float16 m, 16 bytes of nibbles
Q8_0 = 8  # ggml type id: float16 d, then 32 int8 q; w = d * q
Q8_0_BYTES = 34


def available() -> bool:
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")


def unpack_q4_1(raw: np.ndarray, cols: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """raw: uint8 [N, blocks * 20] -> q int32 [N, K], d and m float32 [N, blocks]."""
    n = raw.shape[0]
    blocks = raw.reshape(n, cols // GROUP, BLOCK_BYTES)
    d = blocks[:, :, 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    m = blocks[:, :, 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    nib = blocks[:, :, 4:]  # byte j: weight j in the low nibble, weight j + 16 in the high one
    q = np.concatenate([nib & 0x0F, nib >> 4], axis=-1).reshape(n, cols).astype(np.int32)
    return torch.from_numpy(q), torch.from_numpy(d), torch.from_numpy(m)


def unpack_q8_0(raw: np.ndarray, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """raw: uint8 [N, blocks * 34] -> q int32 [N, K] in -128..127, d float32 [N, blocks]."""
    n = raw.shape[0]
    blocks = raw.reshape(n, cols // GROUP, Q8_0_BYTES)
    d = blocks[:, :, 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    q = blocks[:, :, 2:].copy().view(np.int8).reshape(n, cols).astype(np.int32)
    return torch.from_numpy(q), torch.from_numpy(d)


def unpermute_rows(n_rows: int, n_head: int) -> torch.Tensor:
    """Index that undoes llama.cpp's q/k row permutation: hf = gguf[index]."""
    perm = torch.arange(n_rows).reshape(n_head, 2, n_rows // n_head // 2).transpose(1, 2).reshape(-1)
    return torch.argsort(perm)


# Rows per call up to which the 4-bit kernel is used; the engine sets it to --max-batch, so
# every decode step takes the 4-bit path and prefill chunks the dense one. Measured on 2 cores
# (bf16, one thread, SmolLM2's gate/up projection): 4-bit 70/135/265 us at 1/4/8 rows against
# dense 153/165/203 us; at 128-row prefill chunks 540 tokens/s against the dense 930.
MAX_INT4_ROWS = 8


def script_decode_rows(model: nn.Module) -> bool:
    """Where every layer's four projections are 4-bit and no layer has q/k norms, give the
    model the scripted decode path through all its layers (models/scripted.py). Whether it did."""
    from caldrix.models import scripted

    if not all(b.q_norm is None and all(isinstance(m, Int4Linear) for m in (b.wqkv, b.wo, b.w_gate_up, b.w_down))
               for b in model.layers):
        return False
    fn = scripted.compile_stack()
    if fn is None:
        return False
    model.stack_fn, model.stack_weights = fn, scripted.stack_weights(model.layers)
    return True


def set_max_int4_rows(model: nn.Module, rows: int) -> None:
    for module in model.modules():
        if isinstance(module, Int4Linear):
            module.max_int4_rows = rows


class Int4Linear(nn.Module):
    """y = x @ W.T with W held as packed 4-bit groups (bfloat16 activations).

    Calls of more than `max_int4_rows` rows (prefill chunks) use `dense`, the same weights
    dequantized, when one is given: compute-bound work is faster there."""

    def __init__(self, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor, dense: torch.Tensor | None = None):
        super().__init__()
        # q [N, K] int32 in 0..15; d, m [N, K / GROUP]
        self.out_features, self.in_features = q.shape
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.contiguous(), 1))
        scale_zero = torch.stack([d, m + 8 * d], dim=-1).transpose(0, 1)  # [K / GROUP, N, 2]
        self.register_buffer("scale_zero", scale_zero.to(torch.bfloat16).contiguous())
        self.dense = dense
        self.max_int4_rows = MAX_INT4_ROWS
        self.group = GROUP

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.dense is not None and x.shape[0] > self.max_int4_rows:
            return torch.nn.functional.linear(x, self.dense)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, GROUP, self.scale_zero)


class Q8AsInt4Linear(nn.Module):
    """y = x @ W.T, fp32 out, with W held as a GGUF's Q8_0 blocks split into two 4-bit halves.

    q = 16 hi + lo, with hi in -8..7 and lo in 0..15, so W = (16 d) hi + d lo: two calls of
    the int4 kernel, hi with scale 16 d and zero 0, lo with scale d and zero 8 d. The q values
    stay exact; d rounds to bfloat16. Measured on 2 cores for SmolLM2's 49152 x 576 lm_head:
    3.5 ms a row against 7.2 ms dense bf16, but 12.4 ms at 8 rows against 6.5 ms, since the
    kernel's cost grows with the rows. Hence the engine uses it only at --max-batch 1."""

    def __init__(self, q: torch.Tensor, d: torch.Tensor):
        super().__init__()
        self.out_features, self.in_features = q.shape

        def half(nibbles, scale, zero):
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(nibbles.contiguous(), 1)
            return packed, torch.stack([scale, zero], dim=-1).transpose(0, 1).to(torch.bfloat16).contiguous()

        hi_packed, hi_sz = half((q >> 4) + 8, 16 * d, torch.zeros_like(d))
        lo_packed, lo_sz = half(q & 15, d, 8 * d)
        self.register_buffer("hi_packed", hi_packed)
        self.register_buffer("hi_scale_zero", hi_sz)
        self.register_buffer("lo_packed", lo_packed)
        self.register_buffer("lo_scale_zero", lo_sz)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mm = torch.ops.aten._weight_int4pack_mm_for_cpu
        hi = mm(x, self.hi_packed, GROUP, self.hi_scale_zero)
        return hi.float() + mm(x, self.lo_packed, GROUP, self.lo_scale_zero).float()


def head_from_gguf(model: nn.Module, gguf_path: Path) -> bool:
    """Give the model a Q8AsInt4Linear lm_head where the GGUF holds it (or the tied embedding)
    as Q8_0. Returns whether it did; the dense head stays otherwise."""
    tensors = read_tensors(gguf_path)
    t = tensors.get("token_embd.weight") if model.cfg.tie_embeddings else tensors.get("output.weight")
    if t is None or int(t.tensor_type) != Q8_0:
        return False
    q, d = unpack_q8_0(t.data, int(t.shape[0]))
    model.head = Q8AsInt4Linear(q, d)
    return True


def quantize_from_gguf(model: nn.Module, gguf_path: Path) -> int:
    """Swap the model's projection layers for Int4Linear where the GGUF holds them as Q4_1.

    Returns how many layers were swapped; a layer whose tensors are of another type keeps its
    dense weights. The model must be the Decoder loaded from the same file's conversion."""
    cfg = model.cfg
    tensors = read_tensors(gguf_path)

    def q4(name: str, heads: int | None = None):
        t = tensors.get(name)
        if t is None or int(t.tensor_type) != Q4_1:
            return None
        cols = int(t.shape[0])  # gguf shapes are [K, N]
        q, d, m = unpack_q4_1(t.data, cols)
        if heads is not None:
            idx = unpermute_rows(q.shape[0], heads)
            q, d, m = q[idx], d[idx], m[idx]
        return q, d, m

    def fused(dense: nn.Linear, *parts):
        if any(p is None for p in parts):
            return None
        return Int4Linear(*(torch.cat(xs) for xs in zip(*parts)), dense=dense.weight)

    swapped = 0
    for i, layer in enumerate(model.layers):
        b = f"blk.{i}."
        permute = cfg.arch == "llama"  # llama.cpp permutes q/k only for its llama family
        new = {
            "wqkv": fused(layer.wqkv, q4(b + "attn_q.weight", cfg.num_heads if permute else None),
                          q4(b + "attn_k.weight", cfg.num_kv_heads if permute else None),
                          q4(b + "attn_v.weight")),
            "wo": fused(layer.wo, q4(b + "attn_output.weight")),
            "w_gate_up": fused(layer.w_gate_up, q4(b + "ffn_gate.weight"), q4(b + "ffn_up.weight")),
            "w_down": fused(layer.w_down, q4(b + "ffn_down.weight")),
        }
        for name, module in new.items():
            if module is not None:
                setattr(layer, name, module)
                swapped += 1
    return swapped
