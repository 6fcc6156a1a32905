"""4-bit weights made at load from dense ones (`--weights q4`), for a bfloat16 engine's decode.

A decode step reads every weight once, so on a CPU its time is the weights' bytes over memory
bandwidth: bfloat16 holds a model's decode to about what memory gives at 2 bytes a weight.
Rounding the projections and the head to 4-bit groups at load cuts those bytes to about a
third, which is how llama.cpp and Ollama serve models by default.

The rounding is ggml's Q4_1 (quantize_row_q4_1_ref): in each group of 32 weights of a row,
d = (max - min) / 15 and m = min, both kept as float16, and q = floor((w - min) / d + 0.5)
clamped to 0..15, so w ~ d * q + m.

The kernel, chosen once a process: caldrix::q4_vnni (kernels/q4vnni.cpp, CPUs with
AVX512-VNNI) takes the blocks as they are and rounds each activation row to 8 bits a block,
as llama.cpp's Q4_1 x Q8_1 dot product does; it reads the weights at about what memory gives
(11 GB/s on one core here, 24 on two, for the 248320 x 1024 head: 14.3 / 6.6 ms). Elsewhere
torch's int4 weight-only kernel (bfloat16 activations, scale d and zero m + 8 d in bfloat16)
serves: 15.6 / 8.9 ms for that head, against 50 ms for the bfloat16 matmul on one core.

Which calls take which kernel: the 4-bit kernels are fast at a few rows and about ten times
slower than the packed bfloat16 matmul at a few hundred, so a layer runs its 4-bit kernel for
calls of up to `max_int4_rows` rows (every decode step, a verify pass) and a packed bfloat16
copy of the same dequantized weights for longer ones (prompt chunks: a prompt's last row, and
so a decider's reading, is computed with bfloat16 activations). The model is the 4-bit model
either way: the copy holds the blocks' values, not the checkpoint's.
"""

from __future__ import annotations

import torch
from torch import nn

from caldrix.kernels.packed import CALL_ROWS, PackedLinear, can_pack
from caldrix.kernels.q4 import GROUP, available


# Rows rounded at a time: a 248320-row head in float32 at once was a gigabyte of temporaries.
SLICE_ROWS = 4096


def usable(dtype: torch.dtype, device) -> bool:
    """Whether `--weights q4` can run for an engine of `dtype` on `device`: bfloat16 rows on
    the CPU, with torch's int4 kernel there (the fallback where caldrix::q4_vnni is not built)."""
    return dtype == torch.bfloat16 and torch.device(device).type == "cpu" and available()


def fits(out_features: int, in_features: int) -> bool:
    """Whether the 4-bit kernels take an [out, in] weight: rows in sixteens, whole groups."""
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


def vnni_layout(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q uint8 [N, K], d and m [N, K / 32] (float16 values) -> caldrix::q4_vnni's operands
    (kernels/q4vnni.cpp): qw uint8 [N / 16, K / 8, 64], per group of 16 columns and octet of k's
    byte 4c + j = column c's k j | k j + 4 << 4; dm float16 [N / 16, K / 32, 2, 16]."""
    n, k = q.shape
    g = q.view(n // 16, 16, k // 8, 8).permute(0, 2, 1, 3)  # [groups, octets, column, k in octet]
    qw = (g[..., :4] | (g[..., 4:] << 4)).reshape(n // 16, k // 8, 64).contiguous()
    dm = torch.stack([d, m]).half().view(2, n // 16, 16, k // GROUP).permute(1, 3, 0, 2).contiguous()
    return qw, dm


def vnni() -> bool:
    """Whether `--weights q4` layers run caldrix::q4_vnni (compiled where the CPU has
    AVX512-VNNI), else torch's int4 kernel; one answer a process, so every layer rounds alike."""
    from caldrix.kernels import native

    return native.has_q4_vnni()


class QuantizedLinear(nn.Module):
    """y = x @ W.T (bfloat16 rows, bias-free) with W rounded to 4-bit groups at construction.

    Calls of up to `max_int4_rows` rows run a 4-bit kernel on the blocks: caldrix::q4_vnni
    where it is compiled (activations rounded to 8 bits a block, kernels/q4vnni.cpp), else
    torch's int4 kernel (bfloat16 activations). Longer calls (prompt chunks) run the
    dequantized weights (`dequantized`), packed for oneDNN where it can (`dense`). With
    `dense_copy=False` (the head, whose long calls are rare: a verify pass's rows) no copy is
    kept and every call takes the 4-bit kernel. Each row's result does not depend on the row
    count in any of the kernels, so a reply does not depend on its batch mates."""

    def __init__(self, weight: torch.Tensor, max_int4_rows: int, dense_copy: bool = True):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        q, d, m = q4_1(weight)
        self.vnni = vnni()
        packed, scales = (vnni_layout if self.vnni else torch_layout)(q, d, m)
        self.register_buffer("packed", packed)
        self.register_buffer("scales", scales)
        self.max_int4_rows = max_int4_rows
        self.dense: nn.Module | None = None
        if dense_copy:
            w = dequantized(q, d, m, self.vnni)
            self.dense = PackedLinear(w, max_rows=CALL_ROWS) if can_pack(torch.bfloat16, "cpu") else _Plain(w)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if self.dense is not None and rows.shape[0] > self.max_int4_rows:
            y = self.dense(rows)
        elif self.vnni:
            y = torch.ops.caldrix.q4_vnni(rows.contiguous(), self.packed, self.scales)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(rows.contiguous(), self.packed, GROUP, self.scales)
        return y.view(*x.shape[:-1], self.out_features)


def dequantized(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor, vnni: bool) -> torch.Tensor:
    """bfloat16 [N, K]: the weights the 4-bit kernel computes with, in float32, rounded once:
    d q + m for caldrix::q4_vnni (float16 d and m, as the blocks hold them); (q - 8) scale +
    zero with bfloat16 scale = d and zero = m + 8 d for torch's kernel (torch_layout's)."""
    n, k = q.shape
    if vnni:
        scale, zero, shift = d, m, 0.0
    else:
        scale, zero, shift = d.to(torch.bfloat16).float(), (m + 8 * d).to(torch.bfloat16).float(), 8.0
    out = torch.empty(n, k, dtype=torch.bfloat16)
    for i in range(0, n, SLICE_ROWS):
        g = q[i:i + SLICE_ROWS].float().view(-1, k // GROUP, GROUP)
        out[i:i + SLICE_ROWS] = ((g - shift) * scale[i:i + SLICE_ROWS, :, None]
                                 + zero[i:i + SLICE_ROWS, :, None]).view(-1, k)
    return out


def layer_weights(weight: torch.Tensor) -> torch.Tensor:
    """The bfloat16 weights a QuantizedLinear of `weight` computes with (tests hold the layer,
    and transformers on these weights, to it)."""
    return dequantized(*q4_1(weight), vnni())


class _Plain(nn.Module):
    """F.linear on a plain weight: the dense copy where oneDNN cannot pack bfloat16."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.register_buffer("weight", weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.weight)


def quantize_head(weight: torch.Tensor, max_int4_rows: int) -> QuantizedLinear | None:
    """The output layer [V, D] as 4-bit groups, with no dense copy (only a verify pass calls it
    with more than a step's rows), or None where the kernels do not take its shape."""
    return QuantizedLinear(weight.detach(), max_int4_rows, dense_copy=False) if fits(*weight.shape) else None


def quantize_linears(module: nn.Module, max_int4_rows: int) -> int:
    """Swap every bias-free nn.Linear under `module` whose shape the 4-bit kernels take for a
    QuantizedLinear (the others stay dense), freeing each dense weight as it goes. Returns how
    many it swapped."""
    def takes(child: nn.Module) -> bool:
        return type(child) is nn.Linear and child.bias is None and fits(*child.weight.shape)

    count = 0
    # parents only: a list holding the Linear modules themselves would keep every dense weight
    # alive to the end, twice the model's bytes at the peak
    for parent in [m for m in module.modules() if any(takes(c) for c in m.children())]:
        for name in [n for n, c in parent.named_children() if takes(c)]:
            setattr(parent, name, QuantizedLinear(getattr(parent, name).weight.detach(), max_int4_rows))
            count += 1
    return count


def dense_left(module: nn.Module) -> bool:
    """Whether any matmul under `module` stayed dense (a shape torch's kernel does not take),
    not counting the dense copies inside QuantizedLinear layers."""
    return any(isinstance(child, (nn.Linear, PackedLinear, _Plain)) for parent in module.modules()
               if not isinstance(parent, QuantizedLinear) for child in parent.children())
