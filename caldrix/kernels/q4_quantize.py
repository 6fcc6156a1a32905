"""4-bit weights made at load from dense ones (`--weights q4`), for a bfloat16 engine's decode.

A decode step reads every weight once, so on a CPU its time is the weights' bytes over memory
bandwidth: bfloat16 holds a model's decode to about what memory gives at 2 bytes a weight.
Rounding the projections and the head to 4-bit groups at load cuts those bytes to about a
third, which is how llama.cpp and Ollama serve models by default.

The rounding is ggml's Q4_1 (quantize_row_q4_1_ref): in each group of 32 weights of a row,
d = (max - min) / 15 and m = min, both kept as float16, and q = floor((w - min) / d + 0.5)
clamped to 0..15, so w ~ d * q + m. The blocks then go to torch's int4 weight-only kernel
(the one a GGUF's blocks take where caldrix's kernel is not built, kernels/q4.py), whose scale
d and zero m + 8 d are bfloat16: the values `dequantize` rebuilds.

Which calls take which kernel: torch's kernel is 2.5x faster than the packed bfloat16 matmul
at one row and about ten times slower at a few hundred, so a layer runs it for calls of up to
`max_int4_rows` rows (every decode step, a verify pass) and a packed bfloat16 copy of the
same dequantized weights for longer ones (prompt chunks). The model is the 4-bit model either
way: the copy holds the blocks' values, not the checkpoint's. Measured on 2 cores (AMX Xeon),
one thread, one row: a 3584 x 1024 projection 0.25 ms against 0.63 ms packed bfloat16; the
248320 x 1024 head 15 ms against 50 ms.
"""

from __future__ import annotations

import torch
from torch import nn

from caldrix.kernels.packed import PackedLinear, can_pack
from caldrix.kernels.q4 import GROUP, available


# Rows rounded at a time: a 248320-row head in float32 at once was a gigabyte of temporaries.
SLICE_ROWS = 4096


def usable(dtype: torch.dtype, device) -> bool:
    """Whether `--weights q4` can run for an engine of `dtype` on `device`: torch's int4
    kernel takes bfloat16 rows on the CPU."""
    return dtype == torch.bfloat16 and torch.device(device).type == "cpu" and available()


def fits(out_features: int, in_features: int) -> bool:
    """Whether torch's int4 kernel takes an [out, in] weight: rows in sixteens, whole groups."""
    return out_features % 16 == 0 and in_features % GROUP == 0


def q4_1(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [N, K] (K a multiple of 32) -> q uint8 [N, K] in 0..15, d and m float32 [N, K / 32]
    holding float16 values: ggml's Q4_1 rounding, a slice of rows at a time."""
    n, k = w.shape
    q = torch.empty(n, k, dtype=torch.uint8)
    d = torch.empty(n, k // GROUP)
    m = torch.empty(n, k // GROUP)
    for i in range(0, n, SLICE_ROWS):
        g = w[i:i + SLICE_ROWS].float().view(-1, k // GROUP, GROUP)
        lo, hi = g.amin(-1), g.amax(-1)
        step = (hi - lo) / 15
        inv = torch.where(step > 0, 1.0 / step, torch.zeros_like(step))  # ggml: id = d ? 1/d : 0
        q[i:i + SLICE_ROWS] = ((g - lo[..., None]) * inv[..., None] + 0.5).clamp(0, 15).to(torch.uint8).view(-1, k)
        d[i:i + SLICE_ROWS], m[i:i + SLICE_ROWS] = step.half().float(), lo.half().float()
    return q, d, m


def torch_layout(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q uint8 [N, K], d and m [N, K / 32] -> torch's int4 kernel operands: packed uint8 [N, K / 2]
    and scale_zero bfloat16 [K / 32, N, 2], where w = (q - 8) * scale + zero, so scale = d and
    zero = m + 8 d. Packed a slice of rows at a time (the kernel's layout keeps a row's bytes in
    its row, so slices concatenate): q widened to int32 at once was a gigabyte for the head."""
    packed = torch.cat([torch.ops.aten._convert_weight_to_int4pack_for_cpu(q[i:i + SLICE_ROWS].to(torch.int32), 1)
                        for i in range(0, q.shape[0], SLICE_ROWS)])
    scale_zero = torch.stack([d, m + 8 * d], dim=-1).transpose(0, 1).to(torch.bfloat16).contiguous()
    return packed, scale_zero


def dequantize(q: torch.Tensor, scale_zero: torch.Tensor) -> torch.Tensor:
    """The bfloat16 weights [N, K] torch's kernel computes with: (q - 8) * scale + zero, with
    the bfloat16 scale and zero, in float32, rounded once."""
    n, k = q.shape
    out = torch.empty(n, k, dtype=torch.bfloat16)
    for i in range(0, n, SLICE_ROWS):
        scale = scale_zero[:, i:i + SLICE_ROWS, 0].t().float()[..., None]  # [rows, K / GROUP, 1]
        zero = scale_zero[:, i:i + SLICE_ROWS, 1].t().float()[..., None]
        g = q[i:i + SLICE_ROWS].float().view(-1, k // GROUP, GROUP)
        out[i:i + SLICE_ROWS] = ((g - 8) * scale + zero).view(-1, k).to(torch.bfloat16)
    return out


class QuantizedLinear(nn.Module):
    """y = x @ W.T (bfloat16 rows, bias-free) with W rounded to 4-bit groups at construction.

    Calls of up to `max_int4_rows` rows run torch's int4 kernel on the blocks; longer ones the
    dequantized weights, packed for oneDNN where it can (`dense`). With `dense_copy=False`
    (the head, whose long calls are rare: a verify pass's rows) no copy is kept and every call
    takes the 4-bit kernel. Each row's result does not depend on the row count in either
    kernel, so a reply does not depend on its batch mates."""

    def __init__(self, weight: torch.Tensor, max_int4_rows: int, dense_copy: bool = True):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        q, d, m = q4_1(weight)
        packed, scale_zero = torch_layout(q, d, m)
        self.register_buffer("packed", packed)
        self.register_buffer("scale_zero", scale_zero)
        self.max_int4_rows = max_int4_rows
        self.dense: nn.Module | None = None
        if dense_copy:
            w = dequantize(q, scale_zero)
            self.dense = PackedLinear(w) if can_pack(torch.bfloat16, "cpu") else _Plain(w)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if self.dense is not None and rows.shape[0] > self.max_int4_rows:
            y = self.dense(rows)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(rows.contiguous(), self.packed, GROUP, self.scale_zero)
        return y.view(*x.shape[:-1], self.out_features)


class _Plain(nn.Module):
    """F.linear on a plain weight: the dense copy where oneDNN cannot pack bfloat16."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.register_buffer("weight", weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.weight)


def quantize_linears(module: nn.Module, max_int4_rows: int) -> int:
    """Swap every bias-free nn.Linear under `module` whose shape torch's kernel takes for a
    QuantizedLinear (the others stay dense), freeing each dense weight as it goes. Returns how
    many it swapped."""
    count = 0
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and child.bias is None and fits(*child.weight.shape):
                setattr(parent, name, QuantizedLinear(child.weight.detach(), max_int4_rows))
                count += 1
    return count


def dense_left(module: nn.Module) -> bool:
    """Whether any matmul under `module` stayed dense (a shape torch's kernel does not take),
    not counting the dense copies inside QuantizedLinear layers."""
    return any(isinstance(child, (nn.Linear, PackedLinear, _Plain)) for parent in module.modules()
               if not isinstance(parent, QuantizedLinear) for child in parent.children())
