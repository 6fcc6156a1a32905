"""kernels/prompt_attend.cpp: caldrix::prompt_attend, an image prompt chunk's causal attention
over its cache, and where models/base.attend_cached uses it.

Against a float64 reference of the same maths (causal, grouped heads), held to the error
torch's own bfloat16 SDPA makes against that reference, as tests/test_tower_kernels.py holds
tile_attend; its invariances (thread count, what the cache holds past the chunk); and an image
chunk through attend_cached against a text chunk's SDPA. Skipped where the CPU has no AMX-BF16.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import example, given, settings
from hypothesis import strategies as st

from caldrix.kernels import native
from caldrix.models.base import Attend, attend_cached

pytestmark = pytest.mark.skipif(not native.has_prompt_attend(), reason=f"prompt_attend.cpp not built here: "
                                f"{native.why_torch() or 'this CPU has no AMX-BF16'}")

E = 64


def causal(q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, start: int, scale: float) -> torch.Tensor:
    """SDPA of q [T, H, E] over cache rows [G, C, E], row i seeing keys 0..start + i, in q's dtype
    -> [T, H E]."""
    T, H, _ = q.shape
    n = start + T
    sees = torch.arange(n)[None] <= (torch.arange(T) + start)[:, None]
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], K[None, :, :n].to(q.dtype),
                                         V[None, :, :n].to(q.dtype), attn_mask=sees, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1).reshape(T, H * E)


def cache(groups: int, rows: int, filled: int, spread: float, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V [G, rows, E] bfloat16, NaN past `filled`: the kernel must not read them."""
    K = (torch.randn(groups, rows, E, generator=g) * spread).bfloat16()
    V = torch.randn(groups, rows, E, generator=g).bfloat16()
    K[:, filled:], V[:, filled:] = float("nan"), float("nan")
    return K, V


@settings(max_examples=30, deadline=None)
@given(groups=st.integers(1, 3), per_group=st.sampled_from([1, 3]), start=st.integers(0, 600),
       rows=st.integers(1, 600), spread=st.sampled_from([0.3, 1.0, 3.0]), scale=st.sampled_from([0.125, 0.3]),
       seed=st.integers(0, 2**16))
@example(groups=3, per_group=3, start=0, rows=512, spread=1.0, scale=0.125, seed=0)  # SmolVLM's first chunk
@example(groups=3, per_group=3, start=512, rows=365, spread=1.0, scale=0.125, seed=0)  # and its second
@example(groups=1, per_group=1, start=0, rows=1, spread=1.0, scale=0.125, seed=0)
@example(groups=2, per_group=3, start=255, rows=33, spread=3.0, scale=0.3, seed=1)
def test_prompt_attend_against_float64(groups, per_group, start, rows, spread, scale, seed):
    """Chunks from one row to several 256-key chunks, at any start, ragged against the 32-row
    tasks; the error against float64 held to 1.5x torch SDPA's in bfloat16, plus a bfloat16 step
    of the output's size."""
    g = torch.Generator().manual_seed(seed)
    heads = groups * per_group
    q = (torch.randn(rows, heads, E, generator=g) * spread).bfloat16()
    K, V = cache(groups, start + rows + 40, start + rows, spread, g)
    with torch.inference_mode():
        exact = causal(q.double(), K.double(), V.double(), start, scale)
        theirs = causal(q, K, V, start, scale).double()
        ours = torch.ops.caldrix.prompt_attend(q, K, V, start, scale)
    assert ours.shape == (rows, heads * E) and ours.dtype == torch.bfloat16
    assert torch.isfinite(ours).all()
    err, their_err = (ours.double() - exact).abs().max().item(), (theirs - exact).abs().max().item()
    assert err <= 1.5 * their_err + exact.abs().max().item() * 2**-8, (err, their_err)


def test_prompt_attend_depends_on_nothing_past_the_chunk_nor_the_threads():
    """The same bits on one thread or two, and whatever the cache holds past the chunk's rows;
    the first row sees only the first key (its value, to bfloat16 rounding)."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(77, 6, E, generator=g).bfloat16()
    K, V = cache(2, 300, 77, 1.0, g)
    one = torch.ops.caldrix.prompt_attend(q, K, V, 0, 0.125)
    K2, V2 = K.clone(), V.clone()
    K2[:, 77:], V2[:, 77:] = 1e4, -1e4
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        alone = torch.ops.caldrix.prompt_attend(q, K2, V2, 0, 0.125)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, alone)
    first = one[0].view(6, E)
    for h in range(6):
        assert torch.equal(first[h], V[h // 3, 0])


def test_prompt_attend_refuses_what_it_does_not_take():
    q = torch.zeros(4, 2, E, dtype=torch.bfloat16)
    K = torch.zeros(1, 8, E, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="are not in the cache's 8"):
        torch.ops.caldrix.prompt_attend(q, K, K, 5, 0.125)
    with pytest.raises(RuntimeError, match="3 query heads over 2 key heads"):
        torch.ops.caldrix.prompt_attend(torch.zeros(4, 3, E, dtype=torch.bfloat16), torch.zeros(2, 8, E, dtype=torch.bfloat16),
                                        torch.zeros(2, 8, E, dtype=torch.bfloat16), 0, 0.125)
    with pytest.raises(RuntimeError, match="q is a contiguous bfloat16"):
        torch.ops.caldrix.prompt_attend(q.float(), K, K, 0, 0.125)


def chunk_pass(embeds: bool, dtype: torch.dtype) -> torch.Tensor:
    """attend_cached over a 40-row chunk at row 30 of slot 1, with or without image rows."""
    g = torch.Generator().manual_seed(5)
    S, G, C, H = 2, 3, 128, 9
    K = torch.randn(S, G, C, E, generator=g).to(dtype)
    V = torch.randn(S, G, C, E, generator=g).to(dtype)
    q = torch.randn(40, H, E, generator=g).to(dtype)
    k, v = torch.randn(40, G, E, generator=g).to(dtype), torch.randn(40, G, E, generator=g).to(dtype)
    rows = torch.arange(30, 70)
    at = Attend("prefill", (1,), rows, rows, embeds=torch.zeros(4, 8) if embeds else None,
                embed_rows=torch.arange(4) if embeds else None)
    with torch.inference_mode():
        return attend_cached(q, k, v, at, K, V)


def test_an_image_chunk_attends_on_the_kernel_and_a_text_chunk_on_sdpa():
    """attend_cached: a bfloat16 chunk with image rows gives the kernel's result, within
    bfloat16 rounding of SDPA's; the same chunk as text keeps SDPA's bits (its reference's);
    a float32 image chunk keeps SDPA too."""
    image, text = chunk_pass(True, torch.bfloat16), chunk_pass(False, torch.bfloat16)
    g = torch.Generator().manual_seed(5)
    K = torch.randn(2, 3, 128, E, generator=g).bfloat16()
    V = torch.randn(2, 3, 128, E, generator=g).bfloat16()
    q = torch.randn(40, 9, E, generator=g).bfloat16()
    k, v = torch.randn(40, 3, E, generator=g).bfloat16(), torch.randn(40, 3, E, generator=g).bfloat16()
    K[1, :, 30:70], V[1, :, 30:70] = k.transpose(0, 1), v.transpose(0, 1)
    with torch.inference_mode():
        kernel = torch.ops.caldrix.prompt_attend(q, K[1], V[1], 30, 0.125)
        sdpa = causal(q, K[1], V[1], 30, 0.125)
    assert torch.equal(image, kernel)
    assert torch.equal(text, sdpa)
    assert (image.float() - text.float()).abs().max().item() <= 2**-6 * text.float().abs().max().item()
    assert torch.equal(chunk_pass(True, torch.float32), chunk_pass(False, torch.float32))
