"""Linear layers whose weight oneDNN has reordered into its blocked layout once, at load.

On a CPU with oneDNN's bfloat16 support (avx512_bf16 or AMX: `can_pack`), a bfloat16 matmul
on the packed weight skips the per-call reorder F.linear does: at a few rows (decode) it reads
the weight about 1.5x faster, and at a thousand rows (a vision tile, a prefill chunk) it is
about 1.3x faster with the bias and a GELU (or a residual sum) fused into the same call. Results per row do not
depend on the row count. Model files swap their nn.Linear for these in a `pack()` step after
loading; float32 models and other CPUs keep nn.Linear.
"""

from __future__ import annotations

import torch
from torch import nn


def can_pack(dtype: torch.dtype, device) -> bool:
    """Whether PackedLinear runs for weights of `dtype` on `device`."""
    return (dtype == torch.bfloat16 and torch.device(device).type == "cpu" and torch.backends.mkldnn.is_available()
            and torch.ops.mkldnn._is_mkldnn_bf16_supported())


class PackedLinear(nn.Module):
    """y = act(x W^T + b) for x [..., in] -> [..., out], W packed once at construction.

    `gelu`: "" for no activation, or "tanh"/"none" for GELU with that approximation, applied in
    the same oneDNN call (as F.gelu(..., approximate=gelu) would)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, gelu: str = "",
                 max_rows: int | None = None):
        super().__init__()
        # calls of more rows run in pieces of max_rows (CALL_ROWS says why), while split_calls
        # has them on; call_rows is the bound it restores
        self.max_rows = self.call_rows = max_rows
        self.out_features, self.in_features = weight.shape
        # no batch-size hint: with one (1) the prefill's 1000-row matmuls ran 20-35% slower,
        # and one-row ones no faster
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous())
        self.bias = None if bias is None else bias.detach().contiguous()
        self.attr, self.algorithm = ("gelu", gelu) if gelu else ("none", "")

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """With `residual` [..., out]: residual + x W^T + b, the sum taken inside the same call
        (in float32, rounded once), which spares a pass over the output (no activation then)."""
        x2 = x.reshape(-1, self.in_features).contiguous()
        if self.max_rows is not None and x2.shape[0] > self.max_rows:
            parts = (x2.split(self.max_rows),) if residual is None else (
                x2.split(self.max_rows), residual.reshape(-1, self.out_features).split(self.max_rows))
            y = torch.cat([self(*p) for p in zip(*parts)])
            return y.view(*x.shape[:-1], self.out_features)
        if residual is None:
            y = torch.ops.mkldnn._linear_pointwise(x2, self.packed, self.bias, self.attr, [], self.algorithm)
        else:
            assert self.attr == "none", "a residual sum takes no activation"
            other = residual.reshape(-1, self.out_features).contiguous()
            y = torch.ops.mkldnn._linear_pointwise.binary(x2, other, self.packed, self.bias, "add")
        return y.view(*x.shape[:-1], self.out_features)


class TileLinear(nn.Module):
    """y = x W^T + b for x [..., in] -> [..., out] on AMX tiles (kernels/tile_linear.cpp), W
    repacked once at construction; only where native.has_tile_linear() says the kernel is
    built. in and out multiples of 32, and x's rows too: the vision tower's 1024-row tiles.

    Its place is where oneDNN falls short: on this project's two AMX cores oneDNN ran the
    1024-row calls with 768 outputs on one thread (a tile's wo and fc2: 1.1 and 4.8 ms, here
    0.55 and 2.4), and the tower's four matmuls on one tile take 6.4 ms a layer here, 7.7
    with oneDNN's packed calls."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.packed = torch.ops.caldrix.tile_pack_weight(weight.detach())
        self.bias = None if bias is None else bias.detach().contiguous()

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, gelu: bool = False,
                norm: nn.LayerNorm | None = None) -> torch.Tensor:
        """With `residual`: residual + x W^T + b, summed in float32 and rounded once. With
        `gelu`: the tanh-approximated GELU of the rounded x W^T + b, rounded again (the two
        ops F.gelu(F.linear(...), approximate="tanh") are, to bfloat16 rounding). With `norm`
        (a bfloat16 LayerNorm over the inputs): x is normalised as it is read, in float32 and
        rounded once, as the LayerNorm's own call would, to bfloat16 rounding."""
        if norm is None:
            return torch.ops.caldrix.tile_linear(x, self.packed, self.bias, residual, gelu)
        return torch.ops.caldrix.tile_linear(x, self.packed, self.bias, residual, gelu, norm.weight, norm.bias, norm.eps)


# The most rows one decoder matmul takes (packed here, or a 4-bit layer's unpacked weights,
# q4.UNPACKED_CALL_ROWS); a longer prompt chunk is multiplied in pieces of this many. oneDNN gave
# every row the same bits on one thread as on two up to here, and not always past it (on the
# 2-core AMX Xeon: SmolLM2's 576 -> 960 projection at 512 rows, its 1536 -> 576 one at 256, the
# unpacked ones at 384 and 512: it splits the sums between threads there), and the engine's
# lanes rest on that (engine_probes.lanes probes a chunk of PREFILL_CHUNK_LANES rows).
CALL_ROWS = 128


def split_calls(module: nn.Module, on: bool) -> None:
    """Turn the CALL_ROWS pieces of every PackedLinear under `module` that has them on or off.
    They exist for the engine's lanes, which need a chunk's bits not to depend on the thread
    count; where the lanes do not overlap, every step runs on every core and the pieces only
    cost time (Qwen3.5 at decider-0.8b's shape, a 1000-row prefill in one call: 2.47 s whole,
    2.82 s in pieces). engine_probes.lanes sets them."""
    for m in module.modules():
        if isinstance(m, PackedLinear):
            m.max_rows = m.call_rows if on else None


def pack_linears(module: nn.Module) -> int:
    """Swap every bias-free nn.Linear under `module` (other layer types, 4-bit ones included, stay
    as they are) for a PackedLinear of its weight: the same bits as the plain matmul. Returns
    how many it swapped. For model files' pack() steps, where can_pack says so."""
    def takes(child: nn.Module) -> bool:
        return type(child) is nn.Linear and child.bias is None

    count = 0
    # parents only: a list holding the Linear modules themselves would keep every plain weight
    # alive until the last is packed
    for parent in [m for m in module.modules() if any(takes(c) for c in m.children())]:
        for name in [n for n, c in parent.named_children() if takes(c)]:
            setattr(parent, name, PackedLinear(getattr(parent, name).weight, max_rows=CALL_ROWS))
            count += 1
    return count
