"""The CPU pick: one token from one position's logits, exactly as docs/run.md "Sampling" states.

The order is cli.md's: the repetition penalty, top-k, top-p, min-p, the temperature, one draw.

  * Rank order: candidates are ranked by penalized logit, highest first, ties by lower token id.
    Every cut keeps a prefix of this order (top-k keeps exactly k tokens, so a tie at the k-th
    value keeps the lowest ids), and the draw walks it.
  * The penalty is computed in 64-bit floats and rounded to a 32-bit float; everything after it
    is 64-bit, relative to the top logit m: e_i = exp(l_i - m) at temperature 1 for top-p and
    min-p, w_i = exp((l_i - m) / T) for the draw. The temperature only shapes the draw.
  * The draw's u is the (index + 1)-th output of SplitMix64 seeded with the request's seed
    (`draw_uniform`): pure Python, the same on every machine, independent of torch's RNG and of
    the other requests in the batch.

Sums are 64-bit but their order is not part of the contract (torch.sum); on one machine and
build every pick is deterministic, and an exact-arithmetic hand computation agrees unless u,
top_p or min_p sits within rounding of a boundary.

Cost: a small top_k ranks its k tokens with torch.topk. With top_k 0, `pick` ranks a prefix of
`_FIRST_PREFIX` tokens and ranks the whole vocabulary (one radix sort of int32 keys) only if
top-p, min-p or the walk reach past it; totals come from sums over the whole vocabulary.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from caldrix.protocol import SamplingParams

if TYPE_CHECKING:
    from caldrix.batch import Run

_MASK64 = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15  # SplitMix64's increment (the golden ratio, odd)
_MUL1 = 0xBF58476D1CE4E5B9
_MUL2 = 0x94D049BB133111EB
_TWO_POW_M53 = 2.0**-53
_LOW32 = 0xFFFFFFFF

# With top_k 0 the walk first ranks this many tokens; it ranks the whole vocabulary only when
# top-p, min-p or the draw reach past them. Tests shrink it to exercise the fallback.
_FIRST_PREFIX = 256


def draw_uniform(seed: int, index: int) -> float:
    """The uniform in [0, 1) of draw `index` (0 for a reply's first sampled token) under `seed`.

    SplitMix64 (Steele, Lea, Flood 2014; Vigna's splitmix64.c): with s = seed mod 2**64,
        z = (s + (index + 1) * 0x9E3779B97F4A7C15) mod 2**64
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) mod 2**64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) mod 2**64
        z = z ^ (z >> 31)
        u = (z >> 11) / 2**53
    which is the (index + 1)-th output of the SplitMix64 generator started at state s.
    Counter-based: no state is kept, so any draw can be recomputed on its own.
    """
    if index < 0:
        raise ValueError(f"draw index must be >= 0, got {index}")
    z = (seed + (index + 1) * _GAMMA) & _MASK64
    z = ((z ^ (z >> 30)) * _MUL1) & _MASK64
    z = ((z ^ (z >> 27)) * _MUL2) & _MASK64
    z ^= z >> 31
    return (z >> 11) * _TWO_POW_M53


def greedy_batch(logits: torch.Tensor) -> list[int]:
    """Arg-max of each row of [N, V] logits (lowest id on ties), for rows with no penalty."""
    return torch.argmax(logits, dim=-1).tolist()


def pick(
    logits: torch.Tensor,
    params: SamplingParams,
    seen_ids: torch.Tensor | None,
    draw_index: int,
) -> int:
    """The next token for one position.

    logits: [V] scores of one position (float32, CPU or not; never modified). seen_ids: the
    distinct token ids of the prompt and the reply so far, needed only when
    params.repetition_penalty != 1 (None: nothing is penalized). draw_index: how many tokens
    this request has drawn before this one, i.e. the token's index in the reply; it keys the
    draw, so the pick does not depend on the rest of the batch. A greedy pick uses no draw.
    """
    r = _penalized(logits, params, seen_ids)
    if params.is_greedy:
        return int(torch.argmax(r))
    return _sample(r, params, draw_uniform(params.seed, draw_index))


def distribution(
    logits: torch.Tensor,
    params: SamplingParams,
    seen_ids: torch.Tensor | None = None,
) -> tuple[list[int], list[float]]:
    """The candidates that survive every cut, in walk order, and the draw's probability of each.

    For tests and debugging: `pick` walks this list with u = draw_uniform(seed, draw_index) and
    takes the first token whose running sum of probabilities exceeds u. Greedy settings give
    the arg-max with probability 1.
    """
    r = _penalized(logits, params, seen_ids)
    if params.is_greedy:
        return [int(torch.argmax(r))], [1.0]
    return _sample(r, params, None)


def _penalized(
    logits: torch.Tensor, params: SamplingParams, seen_ids: torch.Tensor | None
) -> torch.Tensor:
    """1-D float32 CPU logits with the repetition penalty applied (a copy when it applies)."""
    r = logits.detach()
    if r.dim() != 1:
        raise ValueError(f"pick takes the logits of one position, got shape {tuple(r.shape)}")
    if r.device.type != "cpu" or r.dtype != torch.float32:
        r = r.to(device="cpu", dtype=torch.float32)
    penalty = params.repetition_penalty
    if penalty != 1.0 and seen_ids is not None and seen_ids.numel():
        ids = seen_ids.to(device="cpu", dtype=torch.int64).reshape(-1)
        r = r.clone() if r.data_ptr() == logits.data_ptr() else r
        v = r[ids].double()
        r[ids] = torch.where(v > 0, v / penalty, v * penalty).float()
    return r


def _ordered(vals: torch.Tensor) -> torch.Tensor:
    """int32 keys in the order of the float32 values (-0.0 and +0.0 share one key)."""
    bits = (vals + 0.0).view(torch.int32)  # + 0.0 folds -0.0 into +0.0
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)  # negative floats: flip all but the sign bit


def _ranked(r: torch.Tensor, k: int) -> torch.Tensor:
    """The int64 ids of the first k tokens of the rank order."""
    n = r.numel()
    # torch.topk is quick while it can partial-sort (k + 1 <= n / 64); past that one radix sort
    # of the whole vocabulary is quicker.
    if k >= n or k + 1 > max(n // 64, 64):
        # A stable sort keeps equal values in id order; on integers it is a radix sort.
        return torch.sort(-_ordered(r), stable=True).indices[:k]
    vals, ids = torch.topk(r, k + 1)
    cut = vals[k - 1]
    if bool(vals[k] == cut):
        # The k-th value is tied past the cut: topk chose among the tied ids arbitrarily, so
        # take every token above it and the lowest ids of the tied ones.
        above = (r > cut).nonzero().squeeze(1)
        tied = (r == cut).nonzero().squeeze(1)[: k - above.numel()]
        ids = torch.cat([above, tied])
        vals = r[ids]
    else:
        ids, vals = ids[:k], vals[:k]
    # Order the k by (value descending, id ascending): one sort of unique int64 keys.
    keys = -_ordered(vals).to(torch.int64) * (1 << 32) + ids
    return torch.sort(keys).values & _LOW32


def _sample(r: torch.Tensor, params: SamplingParams, u: float | None):
    """Token drawn with u, or (ids, probabilities) of every survivor when u is None."""
    vocab = r.numel()
    top_k = params.top_k if 0 < params.top_k < vocab else vocab
    top_p, temperature = params.top_p, params.temperature
    min_p = min(params.min_p, 1.0)  # above 1 nothing would survive; routes/ refuses it anyway
    m = float(r.max())
    if not math.isfinite(m):  # no finite top logit: nothing to weigh, take the top one
        top = int(torch.argmax(r))
        return top if u is not None else ([top], [1.0])

    whole = top_k == vocab
    if whole:
        # Every token is a candidate: the totals come from sums over the whole vocabulary, so
        # only the prefix of the rank order that the cuts and the walk reach has to be ranked.
        d_full = r.double().sub_(m)
        e_full = torch.exp(d_full) if (top_p < 1.0 or min_p > 0.0) else None
        z = float(e_full.sum()) if top_p < 1.0 else 0.0
        n_min = int((e_full >= min_p).sum()) if min_p > 0.0 else vocab
        w_full: torch.Tensor | None = None
        k = vocab if u is None else min(vocab, _FIRST_PREFIX)
    else:
        k = top_k

    while True:
        ids = _ranked(r, k)
        if whole:
            d = None  # gathered from d_full for the survivors only
            e = e_full[ids] if e_full is not None else None
        else:
            d = r[ids].double().sub_(m)
            e = torch.exp(d)
            z = float(e.sum())
        ranked_all = k == top_k  # the prefix holds every top-k survivor

        # top-p: the smallest prefix whose mass (at temperature 1) reaches top_p.
        complete = ranked_all
        n = k
        if top_p < 1.0:
            mass = torch.cumsum(e, 0).div_(z)
            j = int((mass < top_p).sum())  # mass never decreases: the first rank reaching top_p
            if j < k:
                n, complete = j + 1, True
            elif not ranked_all:
                k = vocab
                continue
        # min-p: drop candidates under min_p times the top probability (whose e is 1).
        if min_p > 0.0:
            sel = (e[:n] >= min_p).nonzero().squeeze(1)
            complete = complete or sel.numel() == n_min
            ids_s = ids[sel]
        else:
            sel = None
            ids_s = ids[:n]

        # The temperature: w = exp((l - m) / T) over the survivors, over their sum.
        # Once a whole-vocabulary total exists it stays the one used, so a longer prefix
        # ranked after a short one walks the same weights.
        if complete and not (whole and w_full is not None):
            if temperature == 1.0 and e is not None:
                w = e[:n] if sel is None else e[sel]
            else:
                d_s = d_full[ids_s] if whole else (d[:n] if sel is None else d[sel])
                w = torch.exp(d_s / temperature)
            w_total = float(w.sum())
        else:
            # Survivors lie past the prefix: the total comes from the whole vocabulary.
            if w_full is None:
                w_full = e_full.clone() if temperature == 1.0 and e_full is not None else (
                    torch.exp(d_full / temperature)
                )
                if min_p > 0.0:
                    w_full.masked_fill_(e_full < min_p, 0.0)
                w_total_full = float(w_full.sum())
            w = w_full[ids_s]
            w_total = w_total_full
        if u is None:
            return ids_s.tolist(), (w / w_total).tolist()

        # One draw: the first survivor whose running mass exceeds u.
        running = torch.cumsum(w, 0).div_(w_total)
        j = int((running <= u).sum())
        if j < running.numel():
            return int(ids_s[j])
        if not complete:
            k = vocab
            continue
        # Rounding left the total mass at or under u: the last survivor with any weight.
        return int(ids_s[int((w > 0).nonzero()[-1])])


def pick_run(r: Run, logits: torch.Tensor, rows: list[int]) -> tuple[list[int], list[float]]:
    """Pick r's tokens from its fp32 logits [len(pick_at), V]; `rows` are the slot's token ids
    (the repetition penalty's history). Returns (tokens, read logits)."""
    read = logits[-1, list(r.read_ids)].tolist() if r.read_ids else []
    params = r.sampling
    if plain_greedy(r):
        return greedy_batch(logits), read
    out = [pick(logits[i], params, penalty_history(r, offset, rows), r.draw_index + i)
           for i, offset in enumerate(r.pick_at)]
    return out, read


def penalty_history(r: Run, offset: int, rows: list[int]) -> torch.Tensor | None:
    """The distinct ids the repetition penalty sees for r's pick at `offset` (prompt and reply
    up to that row; `rows`: the slot's token ids), or None where the penalty is 1."""
    if r.sampling.repetition_penalty == 1.0:
        return None
    return torch.tensor(rows[: r.start + offset + 1]).unique()


def plain_greedy(r: Run) -> bool:
    """Greedy with no repetition penalty: the pick is the arg-max of the raw logits."""
    return r.sampling.is_greedy and r.sampling.repetition_penalty == 1.0
