"""A one-row decode layer as one TorchScript function, for 4-bit llama-family layers.

A single-stream decode step makes about 35 torch calls a layer, and at one row each call that
is not a matmul costs a few microseconds of Python, whatever its size. This function makes the
same ATen calls in the same order as `Block.forward` on its one-row decode path, with
`Int4Linear` inlined, but TorchScript's interpreter runs them without Python in between: the
same bits (checked by the engine tests, which compare these steps with the eager verify and
batched forms), about 10 % less time a step on 2 cores (docs/performance.md).

It is taken only where it is exact by construction: decode steps of one row, layers without
Qwen3's q/k norms, every projection an `Int4Linear` that takes the 4-bit kernel at one row.
torch.jit is deprecated in favour of torch.compile, which fuses elementwise work and so changes
bf16 rounding; if scripting fails, `compile_layer` returns None and the eager path runs.

Shapes as in decoder.py: D hidden, H query heads, G kv heads, E head dim, C context rows.
"""

from __future__ import annotations

import logging
import warnings

import torch
import torch.nn.functional as F
from torch import Tensor

log = logging.getLogger("caldrix.engine")


def decode_row(x: Tensor, in_w: Tensor, post_w: Tensor, eps: float, qkv_p: Tensor, qkv_sz: Tensor, wo_p: Tensor,
               wo_sz: Tensor, gu_p: Tensor, gu_sz: Tensor, dn_p: Tensor, dn_sz: Tensor, group: int, K: Tensor,
               V: Tensor, slot: int, n: int, cos: Tensor, sin: Tensor, h: int, g: int, e: int,
               scale: float) -> Tensor:
    """One layer for one row: x [1, D] at position n - 1 of `slot` -> [1, D]. Writes the row's
    key and value into K, V [S, G, C, E] (this layer's cache) and attends over rows 0..n-1."""
    d = x.shape[-1]
    hn = in_w * F.rms_norm(x.float(), [d], None, eps).to(x.dtype)
    qkv = torch.ops.aten._weight_int4pack_mm_for_cpu(hn, qkv_p, group, qkv_sz)  # [1, (H+2G)E]
    qk, v = qkv.split([(h + g) * e, g * e], dim=-1)
    qk = qk.view(1, h + g, e)
    v = v.view(1, g, e)
    qk = qk * cos + qk.roll(e // 2, dims=-1) * sin  # decoder.apply_rope
    q, k = qk[:, :h], qk[:, h:]
    K[slot, :, n - 1] = k[0]
    V[slot, :, n - 1] = v[0]
    out = F.scaled_dot_product_attention(q.unsqueeze(2), K[slot : slot + 1, :, :n], V[slot : slot + 1, :, :n],
                                         scale=scale, enable_gqa=True)  # [1, H, 1, E]
    x = x + torch.ops.aten._weight_int4pack_mm_for_cpu(out.reshape(1, h * e), wo_p, group, wo_sz)
    hn = post_w * F.rms_norm(x.float(), [d], None, eps).to(x.dtype)
    gate, up = torch.ops.aten._weight_int4pack_mm_for_cpu(hn, gu_p, group, gu_sz).chunk(2, dim=-1)
    return x + torch.ops.aten._weight_int4pack_mm_for_cpu(F.silu(gate) * up, dn_p, group, dn_sz)


def compile_layer():
    """The scripted `decode_row`, or None where torch.jit cannot script it."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # torch.jit's own notice
            return torch.jit.script(decode_row)
    except Exception as exc:  # noqa: BLE001 -- an optional speed-up; the eager path is always there
        log.warning("one-row decode layers run eager: torch.jit.script failed (%s)", exc)
        return None
