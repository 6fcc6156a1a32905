"""The decode layers as one TorchScript function, for 4-bit llama-family models.

A decode step makes about 35 torch calls a layer, plus 4 a row for the per-slot attention, and
each call that is not a matmul costs a few microseconds of Python, whatever its size.
`decode_rows` makes the same ATen calls in the same order as `Block.forward` on its decode
path, with `Int4Linear` inlined, and `decode_stack` runs it for every layer, so a pass is one
call from Python and TorchScript's interpreter runs the rest: the same bits (tests/test_int4.py
compares them), and less time a step (docs/performance-history.md).

It is taken only where it is exact by construction: decode-form passes (decode steps and
speculative verifies) of at most the rows that take the 4-bit kernel, layers without Qwen3's
q/k norms, every projection an `Int4Linear`.
torch.jit is deprecated in favour of torch.compile, which fuses elementwise work and so changes
bf16 rounding; if scripting fails, `compile_stack` returns None and the eager path runs.

Shapes as in models/llama.py: D hidden, H query heads, G kv heads, E head dim, C context rows.
"""

from __future__ import annotations

import logging
import warnings
from typing import List, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from caldrix.kernels.q4 import int4_mm

log = logging.getLogger("caldrix.engine")


def decode_rows(x: Tensor, in_w: Tensor, post_w: Tensor, eps: float, qkv_p: Tensor, qkv_sz: Tensor, wo_p: Tensor,
                wo_sz: Tensor, gu_p: Tensor, gu_sz: Tensor, dn_p: Tensor, dn_sz: Tensor, K: Tensor,
                V: Tensor, slots: List[int], lengths: List[int], slot_index: Tensor, write_rows: Tensor,
                cos: Tensor, sin: Tensor, h: int, g: int, e: int, scale: float, native: bool, ours: bool) -> Tensor:
    """One layer for T decode rows: x [T, D] -> [T, D]. Row i belongs to slots[i] at position
    lengths[i] - 1 (a verify run's rows share a slot). Writes each row's key and value into
    K, V [S, G, C, E] (this layer's cache) at (slot_index[i], write_rows[i]), then attends
    row i over its slot's rows 0..lengths[i]-1: one call per row, as Block._attend does."""
    T, d = x.shape[0], x.shape[1]
    if native:  # Block._decode_native: norm, RoPE and attention in the compiled kernels
        hn = torch.ops.caldrix.decode_norm(x, in_w, eps)
        qkv = int4_mm(hn, qkv_p, qkv_sz, ours)  # [T, (H+2G)E]
        att = torch.ops.caldrix.decode_rope_attend(qkv, cos, sin, K, V, slots, lengths, h, scale)
        x = x + int4_mm(att, wo_p, wo_sz, ours)
        hn = torch.ops.caldrix.decode_norm(x, post_w, eps)
        gate, up = int4_mm(hn, gu_p, gu_sz, ours).chunk(2, dim=-1)
        return x + int4_mm(F.silu(gate) * up, dn_p, dn_sz, ours)
    hn = in_w * F.rms_norm(x.float(), [d], None, eps).to(x.dtype)
    qkv = int4_mm(hn, qkv_p, qkv_sz, ours)  # [T, (H+2G)E]
    qk, v = qkv.split([(h + g) * e, g * e], dim=-1)
    qk = qk.view(T, h + g, e)
    v = v.view(T, g, e)
    qk = qk * cos + qk.roll(e // 2, dims=-1) * sin  # ops.apply_rope
    q, k = qk[:, :h], qk[:, h:]
    if T == 1 and lengths[0] > 0:
        s, n = slots[0], lengths[0]
        K[s, :, n - 1] = k[0]
        V[s, :, n - 1] = v[0]
        att = F.scaled_dot_product_attention(q.unsqueeze(2), K[s : s + 1, :, :n], V[s : s + 1, :, :n],
                                             scale=scale, enable_gqa=True).reshape(1, h * e)
    else:
        K[slot_index, :, write_rows] = k
        V[slot_index, :, write_rows] = v
        qs = q.unsqueeze(2)  # [T, H, 1, E]
        zero = q.new_zeros(1, h, 1, e)
        out: List[Tensor] = []
        for i in range(T):
            s, n = slots[i], lengths[i]
            if n > 0:
                out.append(F.scaled_dot_product_attention(qs[i : i + 1], K[s : s + 1, :, :n], V[s : s + 1, :, :n],
                                                          scale=scale, enable_gqa=True))
            else:
                out.append(zero)
        att = torch.cat(out).reshape(T, h * e)
    x = x + int4_mm(att, wo_p, wo_sz, ours)
    hn = post_w * F.rms_norm(x.float(), [d], None, eps).to(x.dtype)
    gate, up = int4_mm(hn, gu_p, gu_sz, ours).chunk(2, dim=-1)
    return x + int4_mm(F.silu(gate) * up, dn_p, dn_sz, ours)


def decode_stack(x: Tensor, weights: List[Tensor], eps: float, Ks: Tensor, Vs: Tensor,
                 slots: List[int], lengths: List[int], slot_index: Tensor, write_rows: Tensor, cos: Tensor,
                 sin: Tensor, h: int, g: int, e: int, scale: float, native: bool, ours: bool) -> Tensor:
    """Every layer in turn: `decode_rows` per layer, one call from Python a pass. `weights`
    holds 10 tensors a layer (`stack_weights`); Ks, Vs are the whole cache [L, S, G, C, E]."""
    for i in range(len(weights) // 10):
        w = weights[10 * i : 10 * i + 10]
        x = decode_rows(x, w[0], w[1], eps, w[2], w[3], w[4], w[5], w[6], w[7], w[8], w[9], Ks[i], Vs[i],
                        slots, lengths, slot_index, write_rows, cos, sin, h, g, e, scale, native, ours)
    return x


def decode_logits(ids: Tensor, embed: List[Tensor], rope_cos: Tensor, rope_sin: Tensor, positions: Tensor,
                  weights: List[Tensor], eps: float, Ks: Tensor, Vs: Tensor, slots: List[int], lengths: List[int],
                  slot_index: Tensor, write_rows: Tensor, h: int, g: int, e: int, scale: float, native: bool,
                  ours: bool, norm_w: Tensor, head: List[Tensor]) -> Tuple[Tensor, Tensor]:
    """A whole decode-form pass, ids [T] -> (float32 logits [T, V], their arg-max [T]): the
    embedding (`embed`: the dense table, or q4.Q8Embedding's operands) and RoPE tables of
    Decoder.forward, `decode_stack`, the final norm of Decoder.logits and the Q8_0 head's two
    halves (q4.Q8AsInt4Linear, `head` = hi packed, hi scales, lo packed, lo scales), the same
    calls in the same order. One call from Python a step: the step thread then wins the GIL
    back from the event loop once, not once per call (docs/performance-history.md, "the event loop's
    share and the GIL")."""
    if len(embed) == 1:  # the dense table
        x = F.embedding(ids, embed[0])
    else:  # q4.Q8Embedding: the rows read from the head's blocks, the same bits
        x = torch.ops.caldrix.q8_rows(ids, embed[0], embed[1], embed[2])
    cos = rope_cos[positions].to(x.dtype).unsqueeze(1)  # [T, 1, E]
    sin = rope_sin[positions].to(x.dtype).unsqueeze(1)
    x = decode_stack(x, weights, eps, Ks, Vs, slots, lengths, slot_index, write_rows, cos, sin, h, g, e, scale,
                     native, ours)
    hn = (norm_w * F.rms_norm(x.float(), [x.shape[1]], None, eps).to(x.dtype)).contiguous()  # ops.rms_norm
    hi = int4_mm(hn, head[0], head[1], ours)
    logits = hi.float() + int4_mm(hn, head[2], head[3], ours).float()
    return logits, torch.argmax(logits, dim=-1)


def stack_weights(layers) -> list[Tensor]:
    """The tensors `decode_stack` reads, 10 a layer, in its order."""
    out: list[Tensor] = []
    for b in layers:
        out += [b.input_norm.weight, b.post_norm.weight, b.wqkv.packed, b.wqkv.scale_zero, b.wo.packed,
                b.wo.scale_zero, b.w_gate_up.packed, b.w_gate_up.scale_zero, b.w_down.packed, b.w_down.scale_zero]
    return out


def compile_stack(fn=decode_stack):
    """The scripted `decode_stack` (or `decode_logits`), or None where torch.jit cannot script it."""
    from caldrix.kernels import native

    native.load()  # caldrix::decode_attend must exist, compiled or not, for the script to name it
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            return torch.jit.script(fn)
    except Exception as exc:  # noqa: BLE001 -- an optional speed-up; the eager path is always there
        log.warning("decode %s runs eager: torch.jit.script failed (%s)", fn.__name__, exc)
        return None


def head_weights(head) -> list[Tensor] | None:
    """`decode_logits`'s head operands for a q4.Q8AsInt4Linear, else None."""
    from caldrix.kernels.q4 import Q8AsInt4Linear

    if not isinstance(head, Q8AsInt4Linear):
        return None
    return [head.hi_packed, head.hi_scale_zero, head.lo_packed, head.lo_scale_zero]
