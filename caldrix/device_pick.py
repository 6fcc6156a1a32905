"""The device pick: the AMD lane's batched token pick, exactly as docs/run.md "The device pick" states.

http-api.md "Sampling": on the AMD lane with batching on, the GPU picks each sampled token. It
keeps every token tied with (or within rounding of) the last one a top-k or top-p cut keeps,
walks the candidates in vocabulary order for the draw, and adds in 32-bit floats. The CPU pick
(sampler.py) is the reference everywhere else; the two agree on greedy rows and on which tokens
survive the cuts when nothing ties at a cut, and their draws generally differ (different walk
order), which is why the record of a request names the pick (`/debug/requests` "sampler").

Written in plain torch over a batch [N, V] of rows, so the same code runs on a CUDA or ROCm
tensor (one host sync per step, for the result) and on CPU tensors (the tests).

Definitions (every quantity float32 unless said otherwise):
  * Penalty: as the CPU pick (64-bit, rounded to 32-bit), over the row's seen-token mask.
  * Greedy rows (temperature 0 or top_k 1): arg-max, lowest id on ties.
  * m = the row's top logit; d_i = l_i - m; e_i = exp(d_i).
  * A cut at value c keeps every token with l_i >= below(c), where below(c) is the float32
    value one step below c toward -inf (torch.nextafter): tokens tied with c, and those one
    rounding step under it, survive. `CUT_STEPS` is that one step.
  * Top-k: c = the k-th largest logit counted with multiplicity.
  * Top-p: over the top-k survivors sorted by logit (highest first), E = scan32(e) and
    Z = E[-1]; c = the logit at the first rank j with E_j / Z >= top_p; no cut if none.
  * Min-p: drop survivors with e_i < min_p.
  * Draw: w_i = exp(d_i / T) for survivors, 0 otherwise; R = scan32(w) in vocabulary order;
    W = R[-1]; t = u * W computed in 64-bit and rounded to 32-bit, u = sampler.draw_uniform(seed,
    n); the pick is the lowest id with w_i > 0 and R_i > t, else the highest id with w_i > 0.
  * scan32 is the Hillis-Steele prefix sum in float32 (`scan32`): log2(V) rounds of element-wise
    adds, so the order of every addition is fixed, and the same on every device.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from caldrix.batch import Run
from caldrix.protocol import SamplingParams
from caldrix.sampler import draw_uniform, penalty_history

CUT_STEPS = 1  # float32 steps under a cut's value that still count as "within rounding" of it


def scan32(x: torch.Tensor) -> torch.Tensor:
    """Inclusive prefix sums along the last dimension, in x's dtype (float32 here), as the
    Hillis-Steele scan: S0 = x; S(r+1)_i = S(r)_i + S(r)_{i - 2^r} for i >= 2^r, else S(r)_i;
    the result is S after ceil(log2 V) rounds. Each addition is one IEEE add in x's dtype, in
    an order that does not depend on the device (torch.cumsum accumulates float32 in 64-bit on
    the CPU and by a scan of its own on GPUs)."""
    out = x
    n = x.shape[-1]
    s = 1
    while s < n:
        out = torch.cat([out[..., :s], out[..., s:] + out[..., :-s]], dim=-1)
        s *= 2
    return out


def below(c: torch.Tensor, steps: int = CUT_STEPS) -> torch.Tensor:
    """The float32 value `steps` steps under c toward -inf; c itself where c is not finite."""
    out = c
    ninf = torch.full_like(c, float("-inf"))
    for _ in range(steps):
        out = torch.nextafter(out, ninf)
    return torch.where(torch.isfinite(c), out, c)


def penalize(logits: torch.Tensor, penalty: torch.Tensor, seen: torch.Tensor | None) -> torch.Tensor:
    """float32 [N, V] logits with the repetition penalty applied where seen [N, V] (bool) is set:
    positive logits divided by the row's penalty, others multiplied, in 64-bit then rounded."""
    l = logits.float()
    if seen is None or not bool((penalty != 1.0).any()):
        return l
    r = l.double()
    p = penalty.to(torch.float64).unsqueeze(1)
    hit = seen & (p != 1.0)
    return torch.where(hit, torch.where(r > 0, r / p, r * p), r).float()


def weights(
    l: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
) -> torch.Tensor:
    """The draw's float32 weights w [N, V] of penalized logits l [N, V]: 0 for every token a cut
    drops. Per-row settings are [N] tensors on l's device; top_k <= 0 keeps every token.
    Greedy rows get weights too (temperature 0 taken as 1); the caller ignores them."""
    n, v = l.shape
    m = l.max(dim=1, keepdim=True).values
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    d = l - m
    e = torch.exp(d)
    keep = ~torch.isnan(l)
    k = torch.where((top_k <= 0) | (top_k >= v), torch.full_like(top_k, v), top_k).long()
    cut_k = bool((k < v).any())
    cut_p = bool((top_p < 1.0).any())
    if cut_k or cut_p:
        sv = torch.sort(l, dim=1, descending=True).values  # ties in any order: only values matter
        ck = sv.gather(1, (k - 1).unsqueeze(1))
        thr = torch.where((k < v).unsqueeze(1), below(ck), torch.full_like(ck, float("-inf")))
        keep &= l >= thr
        if cut_p:
            es = torch.where(sv >= thr, torch.exp(sv - m), torch.zeros_like(sv))
            big_e = scan32(es)
            z = big_e[:, -1:]
            reach = (big_e / z >= top_p.float().unsqueeze(1)) & (sv >= thr)
            ranks = torch.arange(v, device=l.device).expand(n, v)
            j = torch.where(reach, ranks, torch.full_like(ranks, v)).min(dim=1, keepdim=True).values
            found = (j < v) & (top_p < 1.0).unsqueeze(1)
            cp = sv.gather(1, j.clamp(max=v - 1))
            keep &= ~found | (l >= below(cp))
    if bool((min_p > 0.0).any()):
        keep &= e >= min_p.float().unsqueeze(1)
    t = torch.where(temperature > 0, temperature, torch.ones_like(temperature)).float().unsqueeze(1)
    w = torch.exp(d / t)
    return torch.where(keep, w, torch.zeros_like(w))


def draw(w: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The drawn id of each row [N] from weights w [N, V] and uniforms u [N] (float64): the lowest
    id with w > 0 whose vocabulary-order running sum R exceeds t = float32(u * R[-1]), else the
    highest id with w > 0."""
    n, v = w.shape
    r = scan32(w)
    t = (r[:, -1].double() * u.double()).float().unsqueeze(1)
    ids = torch.arange(v, device=w.device).expand(n, v)
    live = w > 0
    first = torch.where(live & (r > t), ids, torch.full_like(ids, v)).min(dim=1).values
    last = torch.where(live, ids, torch.full_like(ids, -1)).max(dim=1).values
    return torch.where(first < v, first, last)


def settings(params: Sequence[SamplingParams], device) -> tuple[torch.Tensor, ...]:
    """(temperature, top_k, top_p, min_p, penalty) as [N] tensors on `device`."""
    f32 = dict(device=device, dtype=torch.float32)
    return (
        torch.tensor([p.temperature for p in params], **f32),
        torch.tensor([p.top_k for p in params], device=device, dtype=torch.int64),
        torch.tensor([p.top_p for p in params], device=device, dtype=torch.float64),
        torch.tensor([min(p.min_p, 1.0) for p in params], device=device, dtype=torch.float64),
        torch.tensor([p.repetition_penalty for p in params], device=device, dtype=torch.float64),
    )


def seen_mask(seen_ids: Sequence[torch.Tensor | None], vocab: int, device) -> torch.Tensor | None:
    """A bool [N, V] mask of each row's seen token ids (None: nothing seen in any row)."""
    if all(s is None or s.numel() == 0 for s in seen_ids):
        return None
    mask = torch.zeros(len(seen_ids), vocab, dtype=torch.bool, device=device)
    for i, s in enumerate(seen_ids):
        if s is not None and s.numel():
            mask[i, s.to(device=device, dtype=torch.int64).reshape(-1)] = True
    return mask


def pick_rows(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    seen: torch.Tensor | None,
    u: torch.Tensor,
) -> torch.Tensor:
    """The picked id of each row, [N] int64 on the logits' device, without a host sync.

    logits: [N, V] float32 (never modified); params: one SamplingParams per row; seen: bool
    [N, V] (the prompt and reply tokens so far; None when no row has a penalty); u: [N]
    float64 uniforms, u[i] = draw_uniform(params[i].seed, draw_index[i]) (greedy rows: any)."""
    temperature, top_k, top_p, min_p, penalty = settings(params, logits.device)
    l = penalize(logits, penalty, seen)
    top = torch.argmax(l, dim=1)  # the lowest id on ties
    greedy = (temperature == 0) | (top_k == 1)
    finite = torch.isfinite(l.max(dim=1).values)
    sampled = ~greedy & finite
    if not bool(sampled.any()):
        return top
    w = weights(l, temperature, top_k, top_p, min_p)
    return torch.where(sampled, draw(w, u), top)


def device_pick(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    seen_ids: Sequence[torch.Tensor | None],
    draw_index: Sequence[int],
) -> list[int]:
    """The next token of each of N rows, as Python ints (one host sync).

    The batched counterpart of sampler.pick: seen_ids[i] are row i's distinct prompt and reply
    ids (None when its penalty is 1), draw_index[i] the token's index in row i's reply."""
    if logits.dim() != 2 or logits.shape[0] != len(params):
        raise ValueError(f"device_pick takes [N, V] logits for N params, got {tuple(logits.shape)} for {len(params)}")
    seen = seen_mask(seen_ids, logits.shape[1], logits.device)
    u = torch.tensor([draw_uniform(p.seed, n) for p, n in zip(params, draw_index)],
                     dtype=torch.float64, device=logits.device)
    return pick_rows(logits, params, seen, u).tolist()


def pick_runs(runs: Sequence[tuple[Run, torch.Tensor, list[int]]]) -> list[tuple[list[int], list[float]]]:
    """The engine's side: every pick of a step's runs in one device_pick call. Each run comes
    with its rows' fp32 logits [len(pick_at), V] (where the engine made them) and its slot's
    token ids (the penalty's history, as the CPU pick reads it); returns (tokens, read logits)
    for each run, as sampler.pick_run does."""
    params, seen, draws = [], [], []
    for r, _, rows in runs:
        for i, offset in enumerate(r.pick_at):
            params.append(r.sampling)
            seen.append(penalty_history(r, offset, rows))
            draws.append(r.draw_index + i)
    tokens = iter(device_pick(torch.cat([logits for _, logits, _ in runs]), params, seen, draws))
    return [([next(tokens) for _ in r.pick_at], logits[-1, list(r.read_ids)].tolist() if r.read_ids else [])
            for r, logits, _ in runs]


def device_distribution(
    logits: torch.Tensor, params: SamplingParams, seen_ids: torch.Tensor | None = None
) -> tuple[list[int], list[float]]:
    """The survivors of one row [V] in vocabulary order (the draw's walk) and w / W of each.
    Greedy settings give the arg-max with probability 1. For tests and debugging."""
    temperature, top_k, top_p, min_p, penalty = settings([params], logits.device)
    seen = seen_mask([seen_ids], logits.shape[-1], logits.device)
    l = penalize(logits.reshape(1, -1), penalty, seen)
    if params.is_greedy or not bool(torch.isfinite(l.max())):
        return [int(torch.argmax(l))], [1.0]
    w = weights(l, temperature, top_k, top_p, min_p)[0]
    total = scan32(w.unsqueeze(0))[0, -1]
    ids = (w > 0).nonzero().squeeze(1)
    return ids.tolist(), (w[ids] / total).tolist()
