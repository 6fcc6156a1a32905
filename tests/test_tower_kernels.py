"""kernels/tower.cpp: caldrix::tile_attend, the vision tower's AMX attention.

Against a float64 reference of the same maths, held to the error torch's own bfloat16 SDPA
makes against that reference; its invariances (thread count, the other tiles of a call); and
a tiny Idefics3 whose tower takes the AMX kernels (this and tile_linear.cpp), against
transformers. Skipped where the CPU has no AMX-BF16 (the kernels are not built there).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from caldrix.kernels import native

pytestmark = pytest.mark.skipif(not native.has_tower_kernels(), reason=f"tower.cpp not built here: "
                                f"{native.why_torch() or 'this CPU has no AMX-BF16'}")

E = 64


def split(qkv: torch.Tensor, heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[N, n, 3 D] -> q, k, v [N, H, n, E] (views)."""
    N, n, _ = qkv.shape
    q, k, v = qkv.view(N, n, 3, heads, E).permute(2, 0, 3, 1, 4)
    return q, k, v


def joined(out: torch.Tensor) -> torch.Tensor:
    """[N, H, n, E] -> [N, n, H E], the kernel's layout."""
    N, H, n, _ = out.shape
    return out.transpose(1, 2).reshape(N, n, H * E)


@settings(max_examples=25, deadline=None)
@given(tiles=st.integers(1, 3), heads=st.integers(1, 3), blocks=st.sampled_from([1, 2, 3, 8, 9, 17]),
       spread=st.sampled_from([0.3, 1.0, 3.0, 8.0]), scale=st.sampled_from([0.125, 0.2, 1.0]), seed=st.integers(0, 2**16))
def test_tile_attend_against_float64(tiles, heads, blocks, spread, scale, seed):
    """n = 32 x blocks covers one chunk, part of one, and several with a ragged last (256 keys a
    chunk); spread and scale make the softmax flat or sharp (at spread 8 many numerators fall
    below float32's smallest normal, which the kernel flushes to 0). The kernel's error against float64
    is held to 1.5x torch SDPA's in bfloat16 on the same input, plus a bfloat16 step of the
    output's size for draws where SDPA happens to round almost every element right."""
    g = torch.Generator().manual_seed(seed)
    n = 32 * blocks
    qkv = (torch.randn(tiles, n, 3 * heads * E, generator=g) * spread).bfloat16()
    q, k, v = split(qkv, heads)
    with torch.inference_mode():
        exact = joined(F.scaled_dot_product_attention(q.double(), k.double(), v.double(), scale=scale))
        theirs = joined(F.scaled_dot_product_attention(q, k, v, scale=scale)).double()
        ours = torch.ops.caldrix.tile_attend(qkv, heads, scale)
    assert ours.shape == (tiles, n, heads * E) and ours.dtype == torch.bfloat16
    err, their_err = (ours.double() - exact).abs().max().item(), (theirs - exact).abs().max().item()
    assert err <= 1.5 * their_err + exact.abs().max().item() * 2**-8, (err, their_err)


def test_tile_attend_depends_on_nothing_but_its_tile():
    """A tile's result is the same bits alone, among other tiles, and on one thread or two: a
    (tile, head, 32 rows) task is computed whole by one thread."""
    g = torch.Generator().manual_seed(7)
    qkv = torch.randn(3, 288, 3 * 2 * E, generator=g).bfloat16()
    with torch.inference_mode():
        together = torch.ops.caldrix.tile_attend(qkv, 2, 0.125)
        alone = torch.cat([torch.ops.caldrix.tile_attend(qkv[i:i + 1].clone(), 2, 0.125) for i in range(3)])
        threads = torch.get_num_threads()
        try:
            torch.set_num_threads(1)
            single = torch.ops.caldrix.tile_attend(qkv, 2, 0.125)
        finally:
            torch.set_num_threads(threads)
    assert torch.equal(together, alone) and torch.equal(together, single)


def test_the_kernels_leave_the_callers_denormals_as_they_were():
    """The tile kernels flush denormals while they run (amx.h's FlushDenormals) and restore the
    thread's MXCSR after: torch's float32 arithmetic on the calling thread still makes a
    denormal afterwards, with the kernels' work on this thread included (one thread)."""
    from caldrix.kernels.packed import TileLinear

    tiny = torch.tensor([2.0**-127])
    assert (tiny * 0.5).item() == 2.0**-128  # a denormal, before any kernel
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        with torch.inference_mode():
            qkv = (torch.randn(1, 64, 3 * 2 * E) * 8).bfloat16()
            torch.ops.caldrix.tile_attend(qkv, 2, 0.125)
            K = torch.randn(1, 64, E).bfloat16()
            torch.ops.caldrix.prompt_attend(torch.randn(32, 2, E).bfloat16(), K, K.clone(), 0, 0.125)
            TileLinear(torch.randn(32, 32).bfloat16())(torch.randn(32, 32).bfloat16() * 20, gelu=True)
    finally:
        torch.set_num_threads(threads)
    assert (tiny * 0.5).item() == 2.0**-128


def test_tile_attend_refuses_what_it_does_not_take():
    x = torch.randn(1, 64, 3 * 2 * E).bfloat16()
    with pytest.raises(RuntimeError, match="not a multiple of 32"):
        torch.ops.caldrix.tile_attend(x[:, :48].contiguous(), 2, 0.125)
    with pytest.raises(RuntimeError, match="is not 3 x 3 heads"):
        torch.ops.caldrix.tile_attend(x, 3, 0.125)
    with pytest.raises(RuntimeError, match="contiguous bfloat16"):
        torch.ops.caldrix.tile_attend(x.float(), 2, 0.125)


def test_tiny_tower_on_the_kernels_matches_transformers_bf16(tmp_path):
    """A tiny Idefics3 whose tiles are 64 patches of 64-wide heads, so pack() takes the AMX
    kernels: its image features stay as close to the float32 reference as transformers' own
    bfloat16 tower does."""
    from transformers import Idefics3Config as HFConfig
    from transformers import Idefics3ForConditionalGeneration

    from caldrix.models.idefics3 import load_idefics3

    cfg = HFConfig(
        vision_config=dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                           image_size=64, patch_size=8, initializer_range=0.2),
        text_config=dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=160, max_position_embeddings=256,
                         tie_word_embeddings=False),
        scale_factor=2, image_token_id=150, tie_word_embeddings=False)
    torch.manual_seed(3)
    ref = Idefics3ForConditionalGeneration(cfg).eval()
    ref.save_pretrained(tmp_path)
    ours = load_idefics3(tmp_path, torch.bfloat16)
    layer = ours.vision.layers[0]
    assert layer.packing == "tiles"
    ref_bf16 = Idefics3ForConditionalGeneration.from_pretrained(tmp_path, dtype=torch.bfloat16).eval()
    pixels = torch.randn(3, 3, 64, 64, generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        exact = ref.model.get_image_features(pixels[None]).pooler_output[0].double()
        theirs = ref_bf16.model.get_image_features(pixels[None].bfloat16()).pooler_output[0].double()
        got = ours.image_features(pixels).double()
    assert got.shape == exact.shape
    assert (got - exact).abs().max().item() <= 1.5 * (theirs - exact).abs().max().item()
