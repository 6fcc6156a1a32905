"""kernels/tile_linear.cpp: caldrix::tile_linear and tile_pack_weight, the vision tower's AMX
linear layer (kernels/packed.TileLinear).

The packed layout against its definition; each output against float64 within the rounding
the contract names (float32 sums, one rounding to bfloat16); the residual form; the LayerNorm
applied to the rows as they are read; the GELU
epilogue (amx.h's gelu_tanh_ps) against float64 and against torch's, and as the two ops it
fuses; a row's bits independent of the other rows and of the thread count; the refusals. Skipped where
the CPU has no AMX-BF16 (the kernel is not built there).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from caldrix.kernels import native

pytestmark = pytest.mark.skipif(not native.has_tile_linear(), reason=f"tile_linear.cpp not built here: "
                                f"{native.why_torch() or 'this CPU has no AMX-BF16'}")

ops = torch.ops.caldrix


def bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    """The spacing of bfloat16 values at |x| (float64), the smallest normal's below it."""
    e = torch.floor(torch.log2(x.abs().clamp_min(2.0 ** -126)))
    return torch.exp2(e - 7)


def drift(x: torch.Tensor, w: torch.Tensor, extra: torch.Tensor) -> torch.Tensor:
    """What float32 summing of K products and the added terms (`extra`: |bias| + |residual|)
    can drift from the exact sum: (K + 2) 2^-24 of the absolute sum."""
    return (x.shape[-1] + 2) * 2.0 ** -24 * (x.double().abs() @ w.double().abs().T + extra)


def tolerance(x: torch.Tensor, w: torch.Tensor, extra: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    """Half a bfloat16 step at the result, plus float32's drift."""
    d = drift(x, w, extra)
    return bf16_ulp(exact.abs() + d) / 2 + d


def test_packed_layout_is_its_definition():
    """wp[p, kb, h, r, 2n + j] = w[32p + 16h + n, 32kb + 2r + j]."""
    N, K = 64, 96
    w = (torch.arange(N * K) % 251).reshape(N, K).to(torch.bfloat16)  # exact below 256: the values tell the places
    wp = ops.tile_pack_weight(w)
    assert wp.shape == (N // 32, K // 32, 2, 16, 32)
    want = w.view(N // 32, 2, 16, K // 32, 16, 2).permute(0, 3, 1, 4, 2, 5).reshape(wp.shape)
    assert torch.equal(wp, want)


@settings(max_examples=30, deadline=None)
@given(rows=st.sampled_from([32, 64, 96, 160]), k=st.sampled_from([32, 64, 96, 768, 3072]),
       n=st.sampled_from([32, 64, 192, 768]), bias=st.booleans(), residual=st.booleans(),
       spread=st.sampled_from([0.01, 1.0, 30.0]), seed=st.integers(0, 2**16))
def test_tile_linear_against_float64(rows, k, n, bias, residual, spread, seed):
    """x w^T + b + residual in float32 sums, rounded once: within half a bfloat16 step of the
    exact value plus float32's summing drift. k covers one block of 32 inputs and the tower's
    768 and 3072 (which change the kernel's row and weight blocking)."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, k, generator=g) * spread).bfloat16()
    w = (torch.randn(n, k, generator=g) / k ** 0.5).bfloat16()
    b = (torch.randn(n, generator=g) * spread).bfloat16() if bias else None
    r = (torch.randn(rows, n, generator=g) * spread).bfloat16() if residual else None
    got = ops.tile_linear(x, ops.tile_pack_weight(w), b, r, False)
    assert got.shape == (rows, n) and got.dtype == torch.bfloat16
    exact = x.double() @ w.double().T
    extra = torch.zeros(rows, n, dtype=torch.float64)
    if b is not None:
        exact, extra = exact + b.double(), extra + b.double().abs()
    if r is not None:
        exact, extra = exact + r.double(), extra + r.double().abs()
    err = (got.double() - exact).abs()
    assert (err <= tolerance(x, w, extra, exact)).all(), err.max().item()


def test_tile_linear_is_torch_linear_to_rounding():
    """Against torch's own bfloat16 linear on the tower's widths: the same bits almost
    everywhere, and never further apart than a bfloat16 step plus both sides' float32 drift
    (the two sum in different orders; where the sum nearly cancels, the drift is the step)."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1024, 768, generator=g).bfloat16()
    w = (torch.randn(2304, 768, generator=g) / 768 ** 0.5).bfloat16()
    b = torch.randn(2304, generator=g).bfloat16()
    ours = ops.tile_linear(x, ops.tile_pack_weight(w), b, None, False).double()
    theirs = F.linear(x, w, b).double()
    assert ((ours - theirs).abs() <= bf16_ulp(theirs) + 2 * drift(x, w, b.double().abs())).all()
    assert (ours != theirs).double().mean().item() < 0.01


def gelu_float64(x: torch.Tensor) -> torch.Tensor:
    """The tanh-approximated GELU in float64, 0.5 (1 + tanh u) written as sigmoid(2u): the tanh
    form cancels to 0 in float64 too for x below -9."""
    x = x.double()
    return x * torch.sigmoid(2 * (2 / torch.pi) ** 0.5 * (x + 0.044715 * x ** 3))


def gelu(x: torch.Tensor) -> torch.Tensor:
    """tile_linear's GELU alone: x through an identity weight (x 1 + 0s, exact in float32), so
    the epilogue sees x itself. Any length: padded into 32-wide rows, 32 rows at a time."""
    n = x.numel()
    cells = -(-n // 1024) * 1024
    padded = torch.cat([x.flatten(), x.new_zeros(cells - n)]).view(-1, 32)
    eye = ops.tile_pack_weight(torch.eye(32, dtype=torch.bfloat16))
    return ops.tile_linear(padded, eye, None, None, True).flatten()[:n].view(x.shape)


@settings(max_examples=20, deadline=None)
@given(count=st.integers(1, 5000), spread=st.sampled_from([0.5, 3.0, 20.0]), seed=st.integers(0, 2**16))
def test_gelu_is_the_rounded_float64_value(count, spread, seed):
    """Every element within half a bfloat16 step of the float64 GELU plus 2^-20 of it (the
    float32 arithmetic before the one rounding), so it is the correctly rounded value but at
    rounding ties; values below the smallest normal (2^-126) may come out as zero (AVX512-BF16's
    conversion flushes them). torch's bfloat16 GELU, 0.5 x (1 + tanh u), loses bits to
    cancellation where x is very negative; x sigmoid(2u) does not."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(count, generator=g) * spread).bfloat16()
    exact = gelu_float64(x)
    bound = bf16_ulp(exact) / 2 + exact.abs() * 2**-20 + 2.0**-126
    assert ((gelu(x).double() - exact).abs() <= bound).all()


def test_gelu_agrees_with_torch_to_a_bfloat16_step():
    """Within one bfloat16 step of torch's bfloat16 GELU, or, for negative x where torch's
    1 + tanh u cancels, within that cancellation's error (|x| 2^-24 before the halving)."""
    x = torch.linspace(-12, 12, 100_001).bfloat16()
    theirs = F.gelu(x, approximate="tanh").double()
    assert ((gelu(x).double() - theirs).abs() <= bf16_ulp(theirs) + x.double().abs() * 2**-22).all()


def test_gelu_is_the_rounded_linears_gelu():
    """With gelu: the GELU of the rounded linear output, bit for bit: what F.gelu(F.linear(x,
    w, b), approximate="tanh") does in two bfloat16 ops, with this GELU."""
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(64, 768, generator=g) * 3).bfloat16()
    w = (torch.randn(3072, 768, generator=g) / 768 ** 0.5).bfloat16()
    b = torch.randn(3072, generator=g).bfloat16()
    wp = ops.tile_pack_weight(w)
    assert torch.equal(ops.tile_linear(x, wp, b, None, True), gelu(ops.tile_linear(x, wp, b, None, False)))


@settings(max_examples=15, deadline=None)
@given(k=st.sampled_from([32, 96, 768]), spread=st.sampled_from([0.01, 1.0, 50.0]), offset=st.sampled_from([0.0, 3.0]),
       eps=st.sampled_from([1e-6, 1e-5]), seed=st.integers(0, 2**16))
def test_norm_is_layer_norm_as_the_rows_are_read(k, spread, offset, eps, seed):
    """With a norm, the rows are LayerNorm(x) before the product: through an identity weight,
    each value within half a bfloat16 step of the float64 LayerNorm plus float32's drift, and
    within a step of torch's own bfloat16 layer_norm."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(64, k, generator=g) * spread + offset).bfloat16()
    w = (torch.randn(k, generator=g) * 0.5 + 1).bfloat16()
    b = torch.randn(k, generator=g).bfloat16()
    eye = ops.tile_pack_weight(torch.eye(k, dtype=torch.bfloat16))
    got = ops.tile_linear(x, eye, None, None, False, w, b, eps).double()
    exact = F.layer_norm(x.double(), (k,), w.double(), b.double(), eps)
    xd = x.double()
    sigma = (xd.var(-1, unbiased=False, keepdim=True) + eps).sqrt()
    normed = (xd - xd.mean(-1, keepdim=True)) / sigma
    # float32's drift: the products' rounding, and the mean's own error (16 lanes of k / 16
    # terms, then their sum) over sigma, which is large where the row is nearly constant
    mean_err = (k / 16 + 4) * 2.0 ** -24 * xd.abs().mean(-1, keepdim=True)
    drift = w.double().abs() * (2.0 ** -18 * normed.abs() + 2 * mean_err / sigma) + 2.0 ** -22 * b.double().abs()
    assert ((got - exact).abs() <= bf16_ulp(exact) / 2 + drift).all()
    theirs = F.layer_norm(x, (k,), w, b, eps).double()
    assert ((got - theirs).abs() <= bf16_ulp(theirs) + 2 * drift).all()


def test_a_row_depends_on_nothing_but_itself():
    """A row's bits are the same in a 32-row call and a 2048-row one (which blocks its rows in
    chunks per thread), at any position, on one thread or two."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2048, 768, generator=g).bfloat16()
    w = (torch.randn(768, 768, generator=g) / 768 ** 0.5).bfloat16()
    r = torch.randn(2048, 768, generator=g).bfloat16()
    wp = ops.tile_pack_weight(w)
    whole = ops.tile_linear(x, wp, None, r, False)
    for at in (0, 512, 1504, 2016):
        assert torch.equal(ops.tile_linear(x[at:at + 32], wp, None, r[at:at + 32], False), whole[at:at + 32])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = ops.tile_linear(x, wp, None, r, False)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(alone, whole)


def test_leading_dims_are_kept():
    x = torch.randn(2, 32, 64).bfloat16()
    w = torch.randn(96, 64).bfloat16()
    got = ops.tile_linear(x, ops.tile_pack_weight(w), None, None, False)
    assert got.shape == (2, 32, 96)
    assert torch.equal(got.view(64, 96), ops.tile_linear(x.view(64, 64), ops.tile_pack_weight(w), None, None, False))


@pytest.mark.parametrize("case, message", [
    ("rows", "40 rows is not a multiple of 32"),
    ("inputs", "x has 96 inputs, the weight 64"),
    ("gelu+residual", "a residual sum takes no GELU"),
    ("bias", "bias is not bfloat16 [32]"),
    ("residual", "residual is not"),
    ("float32", "x is a bfloat16 CPU tensor"),
    ("weight", "wp is not from tile_pack_weight"),
    ("norm half", "a norm takes both its weight and bias"),
    ("norm width", "the norm's weight and bias are not bfloat16 [64]"),
])
def test_refusals(case, message):
    x, w = torch.randn(32, 64).bfloat16(), torch.randn(32, 64).bfloat16()
    wp, b, r, gelu = ops.tile_pack_weight(w), None, None, False
    if case == "rows":
        x = torch.randn(40, 64).bfloat16()
    elif case == "inputs":
        x = torch.randn(32, 96).bfloat16()
    elif case == "gelu+residual":
        r, gelu = torch.randn(32, 32).bfloat16(), True
    elif case == "bias":
        b = torch.randn(31).bfloat16()
    elif case == "residual":
        r = torch.randn(32, 31).bfloat16()
    elif case == "float32":
        x = x.float()
    elif case == "weight":
        wp = w
    norm = ()
    if case == "norm half":
        norm = (torch.ones(64).bfloat16(), None, 1e-6)
    elif case == "norm width":
        norm = (torch.ones(32).bfloat16(), torch.zeros(32).bfloat16(), 1e-6)
    with pytest.raises(RuntimeError, match=message.replace("[", r"\[").replace("]", r"\]")):
        ops.tile_linear(x, wp, b, r, gelu, *norm)


def test_pack_refuses_shapes_off_32():
    with pytest.raises(RuntimeError, match="not in multiples of 32"):
        ops.tile_pack_weight(torch.randn(48, 64).bfloat16())
