"""The plain torch definitions of the small ops the compiled kernels reproduce: RMSNorm and
the half-split RoPE. Models call them on their general path; native.py's fallback registers
them under the kernels' names where the kernels are not built, so the two share one source.

Shapes: T rows, E head dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # fp32 statistics, as the reference does, then back to the activation dtype
    return weight * F.rms_norm(x.float(), weight.shape, eps=eps).to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [T, heads, E]; cos, sin: [T, 1, E] in x's dtype, sin's first half negated.
    # rotate_half(x) * sin_ref = cat(-x2, x1) * sin_ref = roll(x, E/2) * sin: the same products
    # (a sign moves from one factor to the other, exactly), in 4 ops instead of 7; at one row
    # that is about 13 us a layer of dispatch.
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin
