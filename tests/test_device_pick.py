"""The AMD lane's device pick (caldrix/device_pick.py) on CPU tensors, against a plain reference.

The reference below is written independently of the module: Python loops over numpy float32
scalars, one row at a time, following docs/run.md "The device pick" step by step. exp is the
one operation the two compute differently (libm in double vs torch's float32 kernel, within an
ulp or two), so the property test skips the rare draws whose decision sits within 1e-5 of a
boundary; everything else must agree token for token.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from caldrix import sampler
from caldrix.device_pick import (device_distribution, device_pick, pick_rows, scan32, seen_mask)
from caldrix.protocol import SamplingParams

F = np.float32
NINF = F(-np.inf)
MARGIN = 1e-5


def ref_scan(xs):
    """Hillis-Steele inclusive scan, float32, with explicit loops."""
    cur = [F(x) for x in xs]
    step = 1
    while step < len(cur):
        cur = [cur[i] if i < step else F(cur[i] + cur[i - step]) for i in range(len(cur))]
        step *= 2
    return cur


def ref_exp(x) -> np.float32:
    return F(math.exp(float(x)))


class Tight(Exception):
    """A decision of the reference lies within MARGIN of a boundary (exp rounding could flip it)."""


def ref_pick(logits, p: SamplingParams, seen: set[int], u: float) -> int:
    v = len(logits)
    l = [F(x) for x in logits]
    if p.repetition_penalty != 1.0:
        for i in seen:
            x = float(l[i])
            l[i] = F(x / p.repetition_penalty if x > 0 else x * p.repetition_penalty)
    best = max(range(v), key=lambda i: (l[i], -i))
    if p.temperature == 0.0 or p.top_k == 1:
        return best
    m = l[best]
    d = [F(x - m) for x in l]
    e = [ref_exp(x) for x in d]
    keep = [True] * v
    desc = sorted(l, reverse=True)
    k = v if p.top_k <= 0 or p.top_k >= v else p.top_k
    thr = NINF
    if k < v:
        thr = np.nextafter(desc[k - 1], NINF)
        keep = [keep[i] and l[i] >= thr for i in range(v)]
    if p.top_p < 1.0:
        es = [ref_exp(F(x - m)) if x >= thr else F(0) for x in desc]
        big = ref_scan(es)
        z = big[-1]
        mass = [F(b / z) for b in big]
        for j in range(v):
            if desc[j] >= thr and abs(float(mass[j]) - float(F(p.top_p))) < MARGIN:
                raise Tight
        hit = [j for j in range(v) if desc[j] >= thr and mass[j] >= F(p.top_p)]
        if hit:
            cp = np.nextafter(desc[hit[0]], NINF)
            keep = [keep[i] and l[i] >= cp for i in range(v)]
    if p.min_p > 0.0:
        for i in range(v):
            if keep[i] and d[i] != 0 and abs(float(e[i]) - float(F(p.min_p))) < MARGIN * max(p.min_p, 1e-30):
                raise Tight
        keep = [keep[i] and e[i] >= F(p.min_p) for i in range(v)]
    t_ = F(p.temperature)
    w = [ref_exp(F(d[i] / t_)) if keep[i] else F(0) for i in range(v)]
    r = ref_scan(w)
    t = F(float(r[-1]) * u)
    if any(w[i] > 0 and abs(float(r[i]) - float(t)) < MARGIN * float(r[-1]) for i in range(v)):
        raise Tight
    for i in range(v):
        if w[i] > 0 and r[i] > t:
            return i
    return max(i for i in range(v) if w[i] > 0)


def P(**kw) -> SamplingParams:
    base = dict(temperature=1.0, seed=42)
    base.update(kw)
    return SamplingParams(**base)


def one(logits, p, seen=None, n=0) -> int:
    t = torch.tensor(logits, dtype=torch.float32)
    s = None if seen is None else torch.tensor(sorted(seen))
    return device_pick(t.unsqueeze(0), [p], [s], [n])[0]


def test_scan32_is_hillis_steele_in_float32():
    g = torch.Generator().manual_seed(3)
    for n in (1, 2, 3, 7, 8, 33, 100):
        x = torch.rand(2, n, generator=g) * torch.logspace(-6, 2, n)
        got = scan32(x)
        assert got.dtype == torch.float32
        for row in range(2):
            assert got[row].tolist() == [float(v) for v in ref_scan(x[row].numpy())]
    # torch.cumsum accumulates float32 in 64-bit on the CPU: not the device pick's sums
    x = torch.rand(1, 4096, generator=g)
    assert not torch.equal(scan32(x), torch.cumsum(x, 1))


def test_worked_example_of_run_md():
    """docs/run.md's device-pick example: the tie at the top-k cut keeps id 3 as well."""
    logits = [2.4, 1.0, 3.0, 1.0, -0.5, 0.2, 2.0, -2.0]
    p = SamplingParams(temperature=0.5, top_k=4, top_p=0.95, min_p=0.2, repetition_penalty=1.5, seed=42)
    seen = torch.tensor([2, 4])
    ids, probs = device_distribution(torch.tensor(logits), p, seen)
    assert ids == [0, 1, 2, 3, 6]
    cpu_ids, cpu_probs = sampler.distribution(torch.tensor(logits), p, seen)
    assert cpu_ids == [0, 2, 6, 1]  # the CPU pick's walk, as run.md gives it
    assert cpu_probs == pytest.approx([0.5104, 0.2293, 0.2293, 0.0310], abs=1e-4)
    assert probs == pytest.approx([0.4950, 0.0301, 0.2224, 0.0301, 0.2224], abs=1e-4)
    # u = U(42, 0) = 0.7416: running sums 0.4950, 0.5251, 0.7475, 0.7776, 1.0 -> id 2
    assert one(logits, p, {2, 4}, 0) == 2 == ref_pick(logits, p, {2, 4}, sampler.draw_uniform(42, 0))
    assert sampler.pick(torch.tensor(logits), p, seen, 0) == 6  # the CPU pick: same seed, another token
    assert one(logits, p, {2, 4}, 1) == 0 == sampler.pick(torch.tensor(logits), p, seen, 1)  # u = 0.1599


def test_ties_and_one_step_under_the_top_k_cut_survive():
    c = F(1.0)
    under1 = float(np.nextafter(c, NINF))
    under2 = float(np.nextafter(np.nextafter(c, NINF), NINF))
    logits = [3.0, 1.0, 2.0, 1.0, under1, under2, -1.0]
    ids, _ = device_distribution(torch.tensor(logits), P(top_k=3))
    assert ids == [0, 1, 2, 3, 4]  # the tie (id 3) and one float32 step under it (id 4); not id 5
    cpu_ids, _ = sampler.distribution(torch.tensor(logits), P(top_k=3))
    assert cpu_ids == [0, 2, 1]  # exactly k, the lower id of the tie


def test_ties_at_the_top_p_cut_survive():
    # probabilities at T=1 of [ln 4, 0, 0, 0]: 4/7, 1/7, 1/7, 1/7; top_p 0.6 cuts at the first 0
    logits = [math.log(4.0), 0.0, 0.0, 0.0, -30.0]
    ids, probs = device_distribution(torch.tensor(logits), P(top_p=0.6))
    assert ids == [0, 1, 2, 3]
    assert sum(probs) == pytest.approx(1.0, abs=1e-6)
    cpu_ids, _ = sampler.distribution(torch.tensor(logits), P(top_p=0.6))
    assert cpu_ids == [0, 1]


def test_the_walk_is_in_vocabulary_order():
    """q = 0.3 for id 0 and 0.7 for id 1: the CPU walks id 1 first, the device walks id 0 first."""
    logits = [0.0, math.log(7 / 3)]
    p = P()
    u0, u1 = sampler.draw_uniform(42, 0), sampler.draw_uniform(42, 1)  # 0.7416, 0.1599
    assert (one(logits, p, n=0), one(logits, p, n=1)) == (1, 0)
    assert (sampler.pick(torch.tensor(logits), p, None, 0), sampler.pick(torch.tensor(logits), p, None, 1)) == (0, 1)
    assert ref_pick(logits, p, set(), u0) == 1 and ref_pick(logits, p, set(), u1) == 0


def test_rounding_past_the_total_takes_the_last_survivor():
    logits = torch.tensor([[0.0, 0.0, -50.0, 0.0]])
    got = pick_rows(logits, [P()], None, torch.tensor([1.0 - 2**-40], dtype=torch.float64))
    assert got.tolist() == [3]  # float32(u * W) == W: no running sum exceeds it


def test_greedy_rows_agree_with_the_cpu_pick():
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(6, 300, generator=g)
    logits[2, 7] = logits[2, 9] = logits[2].max() + 1  # a tie at the top: the lower id
    params = [SamplingParams(temperature=0.0, repetition_penalty=1.0 + 0.2 * i, seed=i) for i in range(5)]
    params.append(SamplingParams(temperature=0.8, top_k=1, seed=9))
    seen = [torch.randint(0, 300, (20,), generator=g).unique() for _ in range(6)]
    got = device_pick(logits, params, seen, [0] * 6)
    want = [sampler.pick(logits[i], params[i], seen[i], 0) for i in range(6)]
    assert got == want and got[2] == 7


def test_survivors_agree_with_the_cpu_pick_without_ties():
    g = torch.Generator().manual_seed(6)
    for trial in range(20):
        logits = torch.randn(500, generator=g) * 3
        p = SamplingParams(temperature=0.7, top_k=int(torch.randint(0, 60, (1,), generator=g)),
                           top_p=float(torch.rand(1, generator=g)) * 0.9 + 0.1, min_p=0.01, seed=trial)
        ids, probs = device_distribution(logits, p)
        cpu_ids, cpu_probs = sampler.distribution(logits, p)
        assert sorted(ids) == sorted(cpu_ids)
        assert dict(zip(ids, probs)) == pytest.approx(dict(zip(cpu_ids, cpu_probs)), rel=1e-5, abs=1e-7)


def test_seeded_picks_are_reproducible_and_batch_independent():
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(8, 1000, generator=g) * 2
    params = [SamplingParams(temperature=1.1, top_p=0.9, top_k=50, seed=1234 + i) for i in range(8)]
    first = device_pick(logits, params, [None] * 8, list(range(8)))
    assert device_pick(logits, params, [None] * 8, list(range(8))) == first
    alone = [device_pick(logits[i:i + 1], [params[i]], [None], [i])[0] for i in range(8)]
    assert alone == first  # a row's pick does not depend on the other rows
    other_seed = [attrs_evolve(p, seed=p.seed + 1) for p in params]
    assert device_pick(logits, other_seed, [None] * 8, list(range(8))) != first


def attrs_evolve(p: SamplingParams, **kw) -> SamplingParams:
    import attrs

    return attrs.evolve(p, **kw)


def test_seen_mask():
    m = seen_mask([torch.tensor([1, 3, 3]), None], 5, "cpu")
    assert m.tolist() == [[False, True, False, True, False], [False] * 5]
    assert seen_mask([None, torch.tensor([], dtype=torch.long)], 5, "cpu") is None


_values = st.sampled_from([-3.0, -1.0, -0.5, 0.0, 0.25, 1.0, 2.0]) | st.floats(-8, 8, width=32)


@settings(max_examples=150, deadline=None)
@given(
    rows=st.lists(
        st.tuples(
            st.lists(_values, min_size=2, max_size=40),
            st.sampled_from([0.0, 0.3, 0.7, 1.0, 1.6]),
            st.integers(-1, 45),
            st.sampled_from([1.0, 0.95, 0.8, 0.5, 0.2]) | st.floats(0.01, 1.0),
            st.sampled_from([0.0, 0.0, 0.05, 0.3, 1.0]),
            st.sampled_from([1.0, 1.0, 1.3, 0.7]),
            st.integers(0, 2**64 - 1),
            st.integers(0, 50),
            st.data(),
        ),
        min_size=1, max_size=4,
    )
)
def test_matches_the_reference(rows):
    v = min(len(r[0]) for r in rows)
    logits, params, seen, idx, want = [], [], [], [], []
    for vals, temp, k, top_p, min_p, pen, seed, n, data in rows:
        vals = vals[:v]
        s = set(data.draw(st.lists(st.integers(0, v - 1), max_size=5)))
        p = SamplingParams(temperature=temp, top_k=max(k, 0), top_p=top_p, min_p=min_p,
                           repetition_penalty=pen, seed=seed)
        try:
            want.append(ref_pick(vals, p, s, sampler.draw_uniform(seed, n)))
        except Tight:
            assume(False)
        logits.append(vals)
        params.append(p)
        seen.append(torch.tensor(sorted(s), dtype=torch.long) if s else None)
        idx.append(n)
    got = device_pick(torch.tensor(logits, dtype=torch.float32), params, seen, idx)
    assert got == want


def test_the_draw_compares_against_the_float32_scan_exactly():
    """t placed exactly on a running sum R_i of scan32: the pick is the next token, not i."""
    g = torch.Generator().manual_seed(8)
    logits = torch.randn(1, 3000, generator=g) * 4
    w = torch.exp((logits - logits.max(dim=1, keepdim=True).values) / 1.0)
    r = scan32(w)[0]
    total = float(r[-1])
    checked = 0
    for i in torch.randint(100, 2900, (40,), generator=g).tolist():
        u = float(r[i]) / total
        if float(np.float32(u * total)) != float(r[i]) or float(r[i + 1]) == float(r[i]):
            continue
        got = pick_rows(logits, [P()], None, torch.tensor([u], dtype=torch.float64)).item()
        rs = r.tolist()
        want = next(j for j in range(3000) if rs[j] > rs[i])  # the scan need not be monotone
        assert got == want
        checked += 1
    assert checked > 20
