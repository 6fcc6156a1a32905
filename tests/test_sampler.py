"""caldrix.sampler against a plain reference pick written here in Python loops.

The reference follows docs/run.md "Sampling" literally: rank by (penalized logit descending, id
ascending), keep the top k, keep the smallest prefix whose mass at temperature 1 reaches top_p,
drop candidates under min_p times the top probability, weigh the rest by exp((l - m) / T), and
take the first candidate whose running probability exceeds u.

Statistical tests use fixed seeds and a false-alarm rate alpha = 1e-3 each; the critical values
below were computed once with mpmath (chi-square quantile 0.999 for the given degrees of
freedom; the Kolmogorov-Smirnov bound is the asymptotic sqrt(-ln(alpha / 2) / 2) / sqrt(n)).
"""

from __future__ import annotations

import math
import random
import struct

import pytest
import torch

from caldrix import sampler
from caldrix.protocol import SamplingParams
from caldrix.sampler import distribution, draw_uniform, greedy_batch, pick

ALPHA = 1e-3
CHI2_CRIT_999 = {  # chi-square quantile at 1 - ALPHA, by degrees of freedom
    1: 10.827566, 2: 13.815511, 3: 16.266236, 4: 18.466827, 5: 20.515006, 6: 22.457744,
    7: 24.321886, 8: 26.124482, 9: 27.877165, 10: 29.588298, 11: 31.264134, 12: 32.90949,
    63: 103.44238, 255: 330.51974,
}
KS_CRIT_999 = 1.9494746  # sqrt(n) * D exceeds this with probability ALPHA (asymptotic)


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """Picks on one thread: a [V] pick gains nothing from two, and on a busy machine every
    parallel op waits for the other thread's time slice (the tests then take minutes)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ---- the reference -------------------------------------------------------------------------


def _f32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


def ref_penalize(logits: list[float], seen, penalty: float) -> list[float]:
    out = list(logits)
    if penalty != 1.0 and seen is not None:
        for i in set(int(t) for t in seen):
            out[i] = _f32(out[i] / penalty if out[i] > 0 else out[i] * penalty)
    return out


def ref_survivors(logits: list[float], p: SamplingParams, seen=None):
    """(ids in walk order, draw probabilities), or the greedy token with probability 1."""
    r = ref_penalize(logits, seen, p.repetition_penalty)
    vocab = len(r)
    order = sorted(range(vocab), key=lambda i: (-r[i], i))
    if p.temperature == 0 or p.top_k == 1:
        return [order[0]], [1.0]
    k = p.top_k if 0 < p.top_k < vocab else vocab
    cand = order[:k]
    m = r[cand[0]]
    prob1 = {i: math.exp(r[i] - m) for i in cand}  # temperature 1, over the top-k survivors
    z = math.fsum(prob1.values())
    prob1 = {i: v / z for i, v in prob1.items()}
    if p.top_p < 1.0:
        acc = 0.0
        for n, i in enumerate(cand):
            acc += prob1[i]
            if acc >= p.top_p:
                cand = cand[: n + 1]
                break
    if p.min_p > 0.0:
        top = prob1[cand[0]]
        cand = [i for i in cand if prob1[i] >= p.min_p * top]
    w = [math.exp((r[i] - m) / p.temperature) for i in cand]
    total = math.fsum(w)
    return cand, [x / total for x in w]


def ref_walk(cand: list[int], probs: list[float], u: float) -> tuple[int, float]:
    """The pick for u, and how far u lies from the nearest running-sum boundary."""
    acc, below = 0.0, 0.0
    for i, q in zip(cand, probs):
        acc += q
        if acc > u:
            return i, min(acc - u, u - below)
        below = acc
    return cand[-1], u - below  # rounding left the total at or under u: the last one


def ref_splitmix64(state: int):
    """Vigna's splitmix64.c, as a stream."""
    mask = (1 << 64) - 1
    while True:
        state = (state + 0x9E3779B97F4A7C15) & mask
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        yield z ^ (z >> 31)


def chi_square(counts: list[int], expected: list[float]) -> float:
    return sum((c - e) ** 2 / e for c, e in zip(counts, expected))


def logits_of(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def random_logits(vocab: int, seed: int, scale: float = 2.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(vocab, generator=g) * scale


def assert_same_distribution(x: torch.Tensor, p: SamplingParams, seen=None):
    ids, probs = distribution(x, p, seen)
    ref_ids, ref_probs = ref_survivors(x.tolist(), p, seen)
    assert ids == ref_ids
    assert probs == pytest.approx(ref_probs, rel=1e-9, abs=1e-15)
    return ids


def assert_picks_match(x: torch.Tensor, p: SamplingParams, seen=None, draws: int = 300):
    ref_ids, ref_probs = ref_survivors(x.tolist(), p, seen)
    checked = 0
    for index in range(draws):
        u = draw_uniform(p.seed, index)
        want, gap = ref_walk(ref_ids, ref_probs, u)
        if gap < 1e-9:  # u on a boundary up to rounding: either neighbour is right
            continue
        assert pick(x, p, seen, index) == want, (p, index, u)
        checked += 1
    assert checked >= draws * 0.9


# ---- the draw ------------------------------------------------------------------------------


def test_draw_uniform_is_splitmix64():
    # Published SplitMix64 outputs for seed 1234567 (Rosetta Code) and seed 0.
    known = [6457827717110365317, 3203168211198807973, 9817491932198370423,
             4593380528125082431, 16408922859458223821]
    for index, z in enumerate(known):
        assert draw_uniform(1234567, index) == (z >> 11) / 2**53
    assert draw_uniform(0, 0) == (0xE220A8397B1DCDAF >> 11) / 2**53
    for seed in (0, 1, 2**63 + 5, 2**64 - 1):
        stream = ref_splitmix64(seed)
        for index in range(50):
            assert draw_uniform(seed, index) == (next(stream) >> 11) / 2**53
    assert draw_uniform(2**64 + 7, 3) == draw_uniform(7, 3)  # the seed is taken mod 2**64
    with pytest.raises(ValueError):
        draw_uniform(1, -1)


def test_draw_uniform_range_and_repeatability():
    us = [draw_uniform(99, i) for i in range(2000)]
    assert all(0.0 <= u < 1.0 for u in us)
    assert us == [draw_uniform(99, i) for i in range(2000)]
    assert len(set(us)) == len(us)


def test_draw_uniform_chi_square_over_indices():
    n, bins = 128_000, 64
    counts = [0] * bins
    for index in range(n):
        counts[int(draw_uniform(20240917, index) * bins)] += 1
    stat = chi_square(counts, [n / bins] * bins)
    assert stat < CHI2_CRIT_999[bins - 1], stat


def test_draw_uniform_chi_square_over_seeds():
    # Users pick small consecutive seeds: the first draw must be uniform across them too.
    n, bins = 128_000, 64
    counts = [0] * bins
    for seed in range(n):
        counts[int(draw_uniform(seed, 0) * bins)] += 1
    stat = chi_square(counts, [n / bins] * bins)
    assert stat < CHI2_CRIT_999[bins - 1], stat


def test_draw_uniform_consecutive_pairs_independent():
    n, side = 128_000, 16
    counts = [0] * (side * side)
    prev = draw_uniform(7, 0)
    for index in range(1, n + 1):
        u = draw_uniform(7, index)
        counts[int(prev * side) * side + int(u * side)] += 1
        prev = u
    stat = chi_square(counts, [n / side**2] * side**2)
    assert stat < CHI2_CRIT_999[side * side - 1], stat


def test_draw_uniform_kolmogorov_smirnov():
    n = 20_000
    us = sorted(draw_uniform(31337, i) for i in range(n))
    d = max(max((i + 1) / n - u, u - i / n) for i, u in enumerate(us))
    assert math.sqrt(n) * d < KS_CRIT_999, d


def test_different_seeds_give_different_sequences():
    for a, b in ((0, 1), (1, 2), (41, 42), (5, 5 + 2**32)):
        assert [draw_uniform(a, i) for i in range(32)] != [draw_uniform(b, i) for i in range(32)]
    x = random_logits(40, 3, scale=1.0)
    seqs = {
        seed: [pick(x, SamplingParams(temperature=1.0, seed=seed), None, i) for i in range(64)]
        for seed in (1, 2, 3)
    }
    assert seqs[1] != seqs[2] != seqs[3] != seqs[1]


# ---- the filters, one at a time ------------------------------------------------------------


def test_top_k_keeps_the_k_highest_in_rank_order():
    x = random_logits(30, 1)
    for k in (1, 2, 5, 17, 29, 30, 31, 0):
        p = SamplingParams(temperature=1.0, top_k=k)
        ids, _ = distribution(x, p)
        want = sorted(range(30), key=lambda i: -float(x[i]))[: (k if 0 < k < 30 else 30)]
        assert ids == want
        assert_same_distribution(x, p)


def test_top_k_ties_keep_the_lowest_ids():
    x = logits_of([1.0, 3.0, 2.0, 3.0, 3.0, 0.5, 3.0, 2.0, 3.0, -1.0])
    ids, _ = distribution(x, SamplingParams(temperature=1.0, top_k=3))
    assert ids == [1, 3, 4]
    ids, _ = distribution(x, SamplingParams(temperature=1.0, top_k=6))
    assert ids == [1, 3, 4, 6, 8, 2]
    ids, _ = distribution(x, SamplingParams(temperature=1.0, top_k=0))
    assert ids == [1, 3, 4, 6, 8, 2, 7, 0, 5, 9]


@pytest.mark.parametrize("vocab", [64, 300])
def test_top_k_ties_across_the_cut_in_a_larger_vocabulary(vocab):
    # Few distinct values, so every cut falls inside a tie (exercises torch.topk's tie repair).
    g = random.Random(vocab)
    x = logits_of([float(g.randrange(6)) for _ in range(vocab)])
    for k in (1, 2, 3, 7, 10, 33, vocab - 1):
        p = SamplingParams(temperature=0.7, top_k=k, seed=k)
        assert_same_distribution(x, p)
        assert_picks_match(x, p, draws=100)


def test_top_p_boundary_reaches_exactly():
    x = logits_of([0.0] * 8)  # eight equal tokens: every running mass is exactly i / 8
    def kept(top_p, top_k=0):
        return distribution(x, SamplingParams(temperature=1.0, top_p=top_p, top_k=top_k))[0]
    assert kept(0.375) == [0, 1, 2]  # reaches 3/8 exactly: the prefix stops there
    assert kept(0.375 + 1e-12) == [0, 1, 2, 3]
    assert kept(0.125) == [0]
    assert kept(0.01) == [0]
    assert kept(0.5) == [0, 1, 2, 3]
    assert kept(0.875 + 1e-9) == list(range(8))
    assert kept(1.0) == list(range(8))
    # The mass is taken over the top-k survivors: 2 of 5 reach 0.4 (of 8 they would not).
    assert kept(0.4, top_k=5) == [0, 1]
    assert kept(0.4 + 1e-12, top_k=5) == [0, 1, 2]


def test_top_p_random_logits_against_reference():
    for seed in range(5):
        x = random_logits(37, 100 + seed)
        ref_ids_all, _ = ref_survivors(x.tolist(), SamplingParams(temperature=1.0))
        for top_p in (0.05, 0.3, 0.5, 0.77, 0.9, 0.99):
            p = SamplingParams(temperature=1.3, top_p=top_p, seed=seed)
            ids = assert_same_distribution(x, p)
            assert ids == ref_ids_all[: len(ids)]  # a prefix of the rank order
            assert_picks_match(x, p, draws=100)


def test_min_p_drops_under_a_fraction_of_the_top():
    x = random_logits(40, 7)
    r = x.tolist()
    top = max(r)
    for min_p in (0.001, 0.05, 0.2, 0.5, 0.9):
        # Stay clear of the boundary so float32 logits decide the same on both sides.
        assert all(abs(math.exp(v - top) - min_p) > 1e-6 for v in r)
        ids, _ = distribution(x, SamplingParams(temperature=1.0, min_p=min_p))
        assert set(ids) == {i for i, v in enumerate(r) if math.exp(v - top) >= min_p}
        assert_same_distribution(x, SamplingParams(temperature=0.6, min_p=min_p))
    # min_p 1 keeps the tokens tied with the top one, and only them.
    y = logits_of([0.5, 2.0, 1.0, 2.0, 2.0 - 1e-6])
    assert distribution(y, SamplingParams(temperature=1.0, min_p=1.0))[0] == [1, 3]


def test_repetition_penalty_positive_divided_negative_multiplied():
    x = logits_of([3.0, 2.0, 1.0, -1.0, -2.0, 0.0])
    seen = torch.tensor([0, 3, 5])
    before = x.clone()
    ids, probs = distribution(x, SamplingParams(temperature=1.0, repetition_penalty=2.0), seen)
    assert torch.equal(x, before)  # the caller's logits are untouched
    penalized = [1.5, 2.0, 1.0, -2.0, -2.0, 0.0]
    assert ids == [1, 0, 2, 5, 3, 4]  # -2 tie: lower id first
    z = sum(math.exp(v) for v in penalized)
    assert probs == pytest.approx([math.exp(penalized[i]) / z for i in ids], rel=1e-12)
    # Greedy sees the penalty too.
    assert pick(x, SamplingParams(temperature=0.0, repetition_penalty=2.0), seen, 0) == 1
    assert pick(x, SamplingParams(temperature=0.0), None, 0) == 0
    # Negative logits: multiplying pushes the seen one below the unseen one.
    y = logits_of([-1.0, -1.05, -3.0])
    assert pick(y, SamplingParams(temperature=0.0, repetition_penalty=1.1), torch.tensor([0]), 0) == 1
    assert torch.equal(y, logits_of([-1.0, -1.05, -3.0]))
    # A penalty under 1 boosts instead; None means nothing seen.
    assert pick(y, SamplingParams(temperature=0.0, repetition_penalty=0.5), torch.tensor([2]), 0) == 0
    assert pick(y, SamplingParams(temperature=0.0, repetition_penalty=0.5), torch.tensor([1]), 0) == 1
    assert pick(x, SamplingParams(temperature=0.0, repetition_penalty=2.0), None, 0) == 0


def test_repetition_penalty_random_against_reference():
    x = random_logits(50, 11)
    seen = torch.tensor(sorted(random.Random(3).sample(range(50), 15)))
    for penalty in (0.8, 1.1, 1.3, 2.5):
        p = SamplingParams(temperature=0.9, repetition_penalty=penalty, seed=4)
        assert_same_distribution(x, p, seen)
        assert_picks_match(x, p, seen, draws=200)


# ---- composition and the temperature -------------------------------------------------------


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.7, top_k=12, top_p=0.8, seed=1),
        SamplingParams(temperature=1.4, top_k=20, top_p=0.9, min_p=0.05, seed=2),
        SamplingParams(temperature=0.5, top_p=0.95, min_p=0.1, repetition_penalty=1.3, seed=3),
        SamplingParams(temperature=2.0, top_k=30, min_p=0.02, repetition_penalty=0.9, seed=4),
        SamplingParams(temperature=1.0, seed=5),
        SamplingParams(temperature=0.3, top_k=45, top_p=0.6, min_p=0.3, seed=6),
    ],
)
def test_composition_against_reference(params):
    x = random_logits(48, 21, scale=1.5)
    seen = torch.tensor([0, 3, 4, 9, 17, 30, 47])
    assert_same_distribution(x, params, seen)
    assert_picks_match(x, params, seen, draws=300)


def test_filters_use_temperature_one_and_temperature_shapes_only_the_draw():
    x = random_logits(30, 5)
    sets = {
        t: distribution(x, SamplingParams(temperature=t, top_p=0.7, min_p=0.05))[0]
        for t in (0.2, 1.0, 3.0)
    }
    assert sets[0.2] == sets[1.0] == sets[3.0]
    # ... while the draw's probabilities follow exp((l - m) / T).
    ids, hot = distribution(x, SamplingParams(temperature=3.0, top_p=0.7, min_p=0.05))
    _, cold = distribution(x, SamplingParams(temperature=0.2, top_p=0.7, min_p=0.05))
    assert hot[0] < cold[0]
    r = x.tolist()
    z = sum(math.exp((r[i] - r[ids[0]]) / 3.0) for i in ids)
    assert hot == pytest.approx([math.exp((r[i] - r[ids[0]]) / 3.0) / z for i in ids], rel=1e-9)


# ---- greedy --------------------------------------------------------------------------------


def test_greedy_is_the_lowest_id_arg_max_and_draws_nothing():
    x = logits_of([1.0, 5.0, 5.0, 2.0, -1.0])
    for params in (
        SamplingParams(temperature=0.0, seed=3),
        SamplingParams(temperature=1.3, top_k=1, seed=3),
        SamplingParams(temperature=0.0, top_k=3, top_p=0.1, min_p=0.5),
    ):
        assert {pick(x, params, None, i) for i in range(50)} == {1}
    y = random_logits(40, 2)
    assert pick(y, SamplingParams(temperature=0.0), None, 0) == max(range(40), key=lambda i: (y[i], -i))
    assert pick(y, SamplingParams(top_k=1, temperature=2.0), None, 9) == pick(y, SamplingParams(), None, 0)


def test_greedy_batch_rows():
    rows = torch.stack([random_logits(33, s) for s in range(6)] + [logits_of([2.0] * 33)])
    rows[2, 7] = rows[2, 20] = rows[2].max() + 1.0  # a tie: lower id
    want = [max(range(33), key=lambda i: (float(row[i]), -i)) for row in rows]
    assert greedy_batch(rows) == want
    assert want[2] == 7 and want[-1] == 0


# ---- reproducibility -----------------------------------------------------------------------


def test_same_seed_and_index_same_token_whatever_runs_between():
    x = random_logits(48, 8, scale=1.0)
    p = SamplingParams(temperature=1.1, top_p=0.95, seed=12345)
    first = [pick(x, p, None, i) for i in range(100)]
    state = torch.get_rng_state()
    other = random_logits(48, 9)
    again = []
    for i in range(100):
        torch.manual_seed(i)  # the global RNG has no say
        torch.rand(3)
        pick(other, SamplingParams(temperature=0.8, seed=i), None, i)  # a batch mate
        again.append(pick(x, p, None, i))
    assert first == again
    torch.set_rng_state(state)
    # pick leaves torch's global generator alone.
    before = torch.get_rng_state()
    pick(x, p, None, 0)
    assert torch.equal(before, torch.get_rng_state())
    # Not a constant either.
    assert len(set(first)) > 5


def test_pick_never_takes_a_masked_token():
    x = random_logits(32, 4, scale=0.5)
    x[::2] = float("-inf")
    p = SamplingParams(temperature=1.5, seed=77)
    assert all(pick(x, p, None, i) % 2 == 1 for i in range(500))
    assert_picks_match(x, p, draws=200)


def test_empirical_distribution_matches_reference_chi_square():
    x = random_logits(16, 13, scale=1.2)
    seen = torch.tensor([1, 2, 5])
    p = SamplingParams(
        temperature=0.9, top_k=12, top_p=0.97, min_p=0.03, repetition_penalty=1.2, seed=2024
    )
    ids, probs = ref_survivors(x.tolist(), p, seen)
    n = 20_000
    assert min(probs) * n >= 5  # every cell is large enough for the chi-square approximation
    counts = {i: 0 for i in ids}
    for index in range(n):
        token = pick(x, p, seen, index)
        assert token in counts  # nothing outside the kept set
        counts[token] += 1
    stat = chi_square([counts[i] for i in ids], [q * n for q in probs])
    df = len(ids) - 1
    assert df in CHI2_CRIT_999, df
    assert stat < CHI2_CRIT_999[df], (stat, df)


# ---- the real vocabulary size and the ranked-prefix fallback -------------------------------


@pytest.mark.parametrize("prefix", [1, 3, 8])
def test_prefix_fallback_matches_reference(monkeypatch, prefix):
    monkeypatch.setattr(sampler, "_FIRST_PREFIX", prefix)
    x = random_logits(40, 17, scale=0.7)  # flat: walks often run past a short prefix
    for params in (
        SamplingParams(temperature=1.2, seed=1),
        SamplingParams(temperature=1.0, top_p=0.9, seed=2),
        SamplingParams(temperature=0.8, min_p=0.2, seed=3),
        SamplingParams(temperature=1.0, min_p=0.1, seed=4),
        SamplingParams(temperature=1.5, top_p=0.999, min_p=0.05, repetition_penalty=1.2, seed=5),
    ):
        seen = torch.tensor([2, 3, 5]) if params.repetition_penalty != 1 else None
        assert_picks_match(x, params, seen, draws=200)


def test_vocabulary_49152_against_reference():
    vocab = 49152
    g = torch.Generator().manual_seed(0)
    rank = torch.randperm(vocab, generator=g).double() + 1
    peaked = (-3.2 * torch.log(rank) + 0.6 * torch.randn(vocab, generator=g, dtype=torch.float64)).float()
    flat = torch.randn(vocab, generator=g) * 2.0
    seen = torch.unique(torch.randint(0, vocab, (300,), generator=g))
    for x in (peaked, flat):
        for params in (
            SamplingParams(temperature=0.8, seed=1),
            SamplingParams(temperature=1.5, seed=2),
            SamplingParams(temperature=0.8, top_k=50, seed=3),
            SamplingParams(temperature=1.0, top_k=2000, seed=4),
            SamplingParams(temperature=0.7, top_p=0.9, seed=5),
            SamplingParams(temperature=0.7, top_k=40, top_p=0.9, min_p=0.05, repetition_penalty=1.1, seed=6),
        ):
            s = seen if params.repetition_penalty != 1 else None
            assert_picks_match(x, params, s, draws=20)


def test_input_forms():
    x = random_logits(64, 19)
    p = SamplingParams(temperature=0.9, top_k=20, repetition_penalty=1.2, seed=8)
    seen = torch.tensor([1, 2, 3])
    want = [pick(x, p, seen, i) for i in range(50)]
    wide = torch.stack([x, -x], dim=1)[:, 0]  # a strided view of the same values
    assert not wide.is_contiguous()
    assert [pick(wide, p, seen.to(torch.int32), i) for i in range(50)] == want
    assert [pick(x.double(), p, seen, i) for i in range(50)] == want
    assert torch.equal(wide, x)
    with pytest.raises(ValueError):
        pick(x.unsqueeze(0), p, seen, 0)
