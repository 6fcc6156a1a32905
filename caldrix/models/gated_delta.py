"""The gated delta rule of Qwen3.5's linear-attention layers, in plain torch, two ways.

Per value head the layer keeps a matrix S [dk, dv] (float32). Each token t, with a key k and
query q (both L2-normalized, q also scaled by dk^-0.5), a value v, a decay g <= 0 (log space)
and a write strength beta in (0, 1), does

    S <- exp(g) * S                       forget a little
    S <- S + k (beta * (v - k^T S))^T     write the part of v that S does not already predict
    o  = q^T S                            read

`recurrent` runs that step for one token of many sequences at once (decode). `chunked` runs a
whole stretch of one sequence by chunks of 64 tokens: inside a chunk the writes are solved as
one unit-lower-triangular system (the UT transform of the DeltaNet papers), between chunks S
is carried. It is the same algorithm as transformers' torch_chunk_gated_delta_rule, so the two
agree to float32 rounding; both continue from a given S and return the final one.

Shapes: N independent heads (batch x heads flattened), T tokens, dk key dim, dv value dim.
"""

from __future__ import annotations

import torch

CHUNK = 64
# Log-decays below this are taken as total forgetting: exp() of them would be under 1e-26, and
# products with them land in float32's subnormal range, where x86 arithmetic runs ~100x
# slower (a random model's decays reach e^-20 a token; its prefill ran 4x slower). Exactly
# zero instead changes a result by under 1e-26 of its size. The model also flushes subnormals
# to zero on its own thread; this covers the others (intra-op threads) and any left.
FLOOR = -60.0


def decay_exp(x: torch.Tensor) -> torch.Tensor:
    """exp(x) for log-decays x <= 0, with exactly 0 below FLOOR."""
    return x.masked_fill(x < FLOOR, float("-inf")).exp_()


def l2norm(x: torch.Tensor, eps: float = 1e-6, scale: float = 1.0) -> torch.Tensor:
    """x * scale / sqrt(sum(x^2) + eps) over the last dim, as fla and transformers do it (eps
    inside the root of the sum, not the mean). One fused rms_norm pass: rms_norm's
    rsqrt(sum/d + eps/d) is sqrt(d) / sqrt(sum + eps), so its weight carries scale / sqrt(d)."""
    d = x.shape[-1]
    w = torch.full((d,), scale / d ** 0.5, dtype=x.dtype, device=x.device)
    return torch.nn.functional.rms_norm(x, (d,), w, eps / d)


def recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
              state: torch.Tensor) -> torch.Tensor:
    """One token per head, in place on `state`.

    q, k [N, dk]; v [N, dv]; g, beta [N]; state [N, dk, dv], all float32. Returns o [N, dv]."""
    state.mul_(decay_exp(g)[:, None, None])
    predicted = torch.bmm(k.unsqueeze(1), state).squeeze(1)  # [N, dv] = k^T S
    delta = (v - predicted) * beta[:, None]
    state.baddbmm_(k.unsqueeze(2), delta.unsqueeze(1))  # S += k delta^T
    return torch.bmm(q.unsqueeze(1), state).squeeze(1)


def chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
            state: torch.Tensor, chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """T tokens per head, continuing from `state`.

    q, k [N, T, dk]; v [N, T, dv]; g, beta [N, T]; state [N, dk, dv], all float32.
    Returns (o [N, T, dv], the final state [N, dk, dv]); `state` itself is not written.
    The whole chunks run together; a last partial chunk runs after them as a shorter chunk
    (rather than padded, which cost six passes over q, k and v)."""
    N, T, dk = k.shape
    # callers should pass contiguous head-major rows; strided, every pass below ran 3x slower
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    out = torch.empty(N, T, v.shape[-1], dtype=q.dtype, device=q.device)
    full = T - T % chunk
    s = state
    for lo, hi, c in ((0, full, chunk), (full, T, T - full)):
        if hi > lo:
            s = _chunks(q[:, lo:hi], k[:, lo:hi], v[:, lo:hi], g[:, lo:hi], beta[:, lo:hi], s, c, out[:, lo:hi])
    return out, s


def _chunks(q, k, v, g, beta, state, c: int, out) -> torch.Tensor:
    """`chunked` over a stretch that is a whole number of chunks of c tokens, writing o into
    `out` [N, T, dv]; returns the final state."""
    N, T, dk = k.shape
    dv = v.shape[-1]
    n = T // c
    q, k, v = q.view(N, n, c, dk), k.view(N, n, c, dk), v.view(N, n, c, dv)
    beta = beta.view(N, n, c, 1)
    out = out.view(N, n, c, dv)
    cum = g.reshape(N, n, c).cumsum(-1)  # [N, n, c]: log of the decay from the chunk's start to t
    later = torch.ones(c, c, dtype=torch.bool, device=q.device).triu(1)
    # decay[i, j] = exp(cum_i - cum_j): what position j's write has lost by position i (j <= i)
    diff = cum.unsqueeze(-1) - cum.unsqueeze(-2)
    decay = diff.masked_fill_(later | (diff < FLOOR), float("-inf")).exp_()  # [N, n, c, c]
    kb = k * beta
    # (I + strictly-lower(beta k k^T * decay)) solves the chunk's interleaved writes at once
    system = torch.matmul(kb, k.transpose(-1, -2)).mul_(decay)
    u = torch.linalg.solve_triangular(system, v * beta, upper=False, unitriangular=True)  # [N, n, c, dv]
    grow = decay_exp(cum).unsqueeze(-1)  # [N, n, c, 1]
    w = torch.linalg.solve_triangular(system, kb.mul_(grow), upper=False, unitriangular=True)  # [N, n, c, dk]
    inside = torch.matmul(q, k.transpose(-1, -2)).mul_(decay)  # [N, n, c, c]: reads of this chunk's own writes
    q_in = q * grow  # reads of the carried state, decayed to each position
    # writes, decayed to the chunk's end, transposed for the state update: [N, n, dk, c]
    k_out = (k * decay_exp(cum[..., -1:] - cum).unsqueeze(-1)).transpose(-1, -2)
    carry = decay_exp(cum[..., -1])[..., None, None]  # [N, n, 1, 1]
    s = state
    for i in range(n):
        fresh = torch.baddbmm(u[:, i], w[:, i], s, alpha=-1)  # [N, c, dv]: the writes, less what s predicts
        out[:, i] = torch.baddbmm(torch.bmm(q_in[:, i], s), inside[:, i], fresh)
        s = torch.baddbmm(s * carry[:, i], k_out[:, i], fresh)
    return s
