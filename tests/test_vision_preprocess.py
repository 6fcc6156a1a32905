"""caldrix/vision/preprocess.py against transformers' Idefics3 image processor and processor.

The reference is Idefics3ImageProcessorPil, the PIL processor SmolVLM was trained with (what
transformers 5 gives for Idefics3ImageProcessor without torchvision; named directly so an
installed torchvision cannot swap in its own resize), with SmolVLM-256M's published settings
and, for more examples in the time, a scaled-down copy of them.
"""

from __future__ import annotations

import io
import warnings

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from PIL import Image

from caldrix.vision import preprocess as pp
from caldrix.vision import resize
import vision_util
from caldrix.vision.preprocess import SMOLVLM_256M, Grid, ImageTokens, ProcessorSettings

SMALL = ProcessorSettings(longest_edge=256, tile=64, image_seq_len=4)
MODES = ["RGB", "RGBA", "LA", "L", "P", "P+transparency", "CMYK", "1", "I;16", "RGB+transparency"]


def reference_processor(s: ProcessorSettings, detail: str):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil
        return Idefics3ImageProcessorPil(
            size={"longest_edge": s.longest_edge}, max_image_size={"longest_edge": s.tile}, resample=1,
            rescale_factor=s.rescale_factor, image_mean=list(s.mean), image_std=list(s.std),
            do_image_splitting=detail != "low", do_pad=True, do_convert_rgb=True)


def make_image(width: int, height: int, mode: str, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    # Smooth colour ramps plus noise: Lanczos overshoots and clips on both.
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([(x * 255 // max(width - 1, 1)), (y * 255 // max(height - 1, 1)), (x + y) % 256], -1)
    noise = rng.integers(-40, 41, size=(height, width, 3))
    rgb = Image.fromarray(np.clip(base + noise, 0, 255).astype(np.uint8), "RGB")
    if mode == "RGB":
        return rgb
    if mode == "RGB+transparency":
        rgb.info["transparency"] = (int(base[0, 0, 0]), 0, 0)
        return rgb
    if mode in ("RGBA", "LA"):
        alpha = Image.fromarray(rng.integers(0, 256, size=(height, width), dtype=np.uint8), "L")
        im = rgb.convert(mode[:-1])
        im.putalpha(alpha)
        return im
    if mode == "P":
        return rgb.convert("P", palette=Image.ADAPTIVE, colors=64)
    if mode == "P+transparency":
        im = rgb.convert("P", palette=Image.ADAPTIVE, colors=64)
        im.info["transparency"] = 3
        return im
    if mode == "I;16":
        im = Image.fromarray(np.asarray(rgb.convert("L")).astype(np.uint16) * 257)
        assert im.mode == "I;16"
        return im
    return rgb.convert(mode)


def compare_pixels(im: Image.Image, detail: str, s: ProcessorSettings, kernel: bool | None = None):
    ref = reference_processor(s, detail)(images=[[im]], return_tensors="pt", return_row_col_info=True)
    ours = pp.preprocess(im, detail, s, kernel=kernel)
    want = ref["pixel_values"][0]
    assert ours.pixels.dtype == torch.float32
    assert ours.pixels.shape == want.shape, (ours.pixels.shape, want.shape)
    assert torch.all(ref["pixel_attention_mask"] == 1)  # every tile is whole: no padding
    assert (ours.grid.rows, ours.grid.cols) == (ref["rows"][0][0], ref["cols"][0][0])
    diff = (ours.pixels - want).abs().max().item()
    assert diff <= 1e-6, diff
    assert ours.grid == pp.grid_for(im.width, im.height, detail, s)
    return ours


sides = st.integers(1, 700)


@settings(max_examples=45, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(w=sides, h=sides, mode=st.sampled_from(MODES), detail=st.sampled_from(["auto", "high", "low"]),
       seed=st.integers(0, 2**16), pillow=st.booleans())
@example(w=1, h=700, mode="RGB", detail="auto", seed=0, pillow=False)
@example(w=700, h=1, mode="RGBA", detail="high", seed=0, pillow=False)
@example(w=64, h=64, mode="RGB", detail="auto", seed=0, pillow=False)
@example(w=65, h=3, mode="CMYK", detail="auto", seed=0, pillow=False)
@example(w=30, h=40, mode="I;16", detail="auto", seed=0, pillow=False)
@example(w=2, h=3, mode="RGB", detail="auto", seed=0, pillow=False)
@example(w=300, h=200, mode="RGB", detail="high", seed=0, pillow=True)
def test_pixels_match_transformers_small_settings(w, h, mode, detail, seed, pillow):
    """Both resizers: the compiled kernel where it was built (pillow False), and Pillow's."""
    compare_pixels(make_image(w, h, mode, seed), detail, SMALL, kernel=False if pillow else None)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(w=st.integers(1, 1400), h=st.integers(1, 1400), mode=st.sampled_from(MODES),
       detail=st.sampled_from(["auto", "low"]), seed=st.integers(0, 2**16))
@example(w=512, h=512, mode="RGB", detail="low", seed=1)
@example(w=1024, h=768, mode="RGB", detail="high", seed=2)
@example(w=300, h=4096, mode="L", detail="auto", seed=3)
def test_pixels_match_transformers_smolvlm_settings(w, h, mode, detail, seed):
    out = compare_pixels(make_image(w, h, mode, seed), detail, SMOLVLM_256M)
    if detail == "low":
        assert out.pixels.shape == (1, 3, 512, 512)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(w=sides, h=sides, mode=st.sampled_from(MODES), detail=st.sampled_from(["auto", "high", "low"]),
       seed=st.integers(0, 2**16))
def test_bfloat16_pixels_are_the_float32_ones_rounded(w, h, mode, detail, seed):
    """dtype=bfloat16 (what a bfloat16 tower takes): exactly the float32 pixels rounded once,
    the values the tower's own cast would make."""
    im = make_image(w, h, mode, seed)
    full = pp.preprocess(im, detail, SMALL)
    half = pp.preprocess(im, detail, SMALL, torch.bfloat16)
    assert half.pixels.dtype == torch.bfloat16 and half.grid == full.grid
    assert torch.equal(half.pixels, full.pixels.to(torch.bfloat16))


def test_pixels_refuse_other_dtypes():
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        pp.preprocess(Image.new("RGB", (8, 8)), "low", SMALL, torch.float16)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(w_in=st.integers(1, 3000), h_in=st.integers(1, 3000), long_out=st.sampled_from([1024, 2048, 1536, 1000]),
       short_out=st.integers(256, 2048), portrait=st.booleans(), seed=st.integers(0, 2**16))
@example(w_in=512, h_in=512, long_out=2048, short_out=2048, portrait=False, seed=0)
@example(w_in=1024, h_in=768, long_out=2048, short_out=1536, portrait=False, seed=0)
@example(w_in=2048, h_in=1536, long_out=512, short_out=512, portrait=True, seed=0)
@example(w_in=301, h_in=999, long_out=2048, short_out=618, portrait=True, seed=0)
def test_two_thread_lanczos_is_pillows_resize(w_in, h_in, long_out, short_out, portrait, seed):
    """resize.lanczos splits the longer output side in two halves on two threads where the halves'
    boxes give Pillow the same filters (a power-of-two denominator in in / out: 1024 and 2048
    always, 1536 sometimes, 1000 for some inputs), and is one plain call otherwise: the same
    bytes either way."""
    short_out = min(short_out, long_out)
    size = (short_out, long_out) if portrait else (long_out, short_out)
    rgb = np.random.default_rng(seed).integers(0, 256, (h_in, w_in, 3), dtype=np.uint8)
    im = Image.fromarray(rgb, "RGB")
    assert np.array_equal(np.asarray(resize.lanczos(im, size)), np.asarray(im.resize(size, Image.LANCZOS)))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(w_in=st.integers(2, 1500), h_in=st.integers(1, 1500), w_out=st.integers(1, 2100), h_out=st.integers(1, 2100),
       seed=st.integers(0, 2**16))
@example(w_in=512, h_in=512, w_out=2048, h_out=2048, seed=0)
@example(w_in=2048, h_in=2048, w_out=512, h_out=512, seed=0)
@example(w_in=1024, h_in=768, w_out=2048, h_out=1536, seed=0)
@example(w_in=2, h_in=1, w_out=9, h_out=7, seed=0)  # every output's taps reach both pixels
@example(w_in=1400, h_in=30, w_out=1, h_out=2100, seed=0)  # columns first: the height grows
@example(w_in=40, h_in=1500, w_out=39, h_out=3, seed=0)  # columns first: the height shrinks most
@example(w_in=333, h_in=333, w_out=333, h_out=334, seed=0)  # one pass only
def test_lanczos_kernel_is_pillows_resize(w_in, h_in, w_out, h_out, seed):
    """caldrix::lanczos_rgb (kernels/resample.cpp) gives Pillow's bytes, in either pass order,
    on one thread (small passes) or split in two halves (from 2^18 output bytes a pass)."""
    from caldrix.kernels import native

    if not native.has_lanczos_rgb():
        pytest.skip("caldrix::lanczos_rgb is built for CPUs with AVX-512 F and BW")
    rgb = np.random.default_rng(seed).integers(0, 256, (h_in, w_in, 3), dtype=np.uint8)
    want = np.asarray(Image.fromarray(rgb, "RGB").resize((w_out, h_out), Image.LANCZOS))
    order = resize._horizontal_first(w_in, h_in, w_out, h_out)
    got = torch.ops.caldrix.lanczos_rgb(torch.from_numpy(rgb), w_out, h_out, order).numpy()
    assert np.array_equal(got, want)


def test_lanczos_kernel_refuses_one_pixel_rows():
    from caldrix.kernels import native

    if not native.has_lanczos_rgb():
        pytest.skip("caldrix::lanczos_rgb is built for CPUs with AVX-512 F and BW")
    with pytest.raises(RuntimeError, match="it takes 2 x 1 and up"):
        torch.ops.caldrix.lanczos_rgb(torch.zeros((5, 1, 3), dtype=torch.uint8), 4, 4, True)


def test_known_grids():
    # 1024x768 goes to 2048x1536: 4 columns by 3 rows plus the global image.
    assert pp.grid_for(1024, 768, "high") == Grid(3, 4)
    assert pp.grid_for(512, 512, "auto") == Grid(4, 4)  # small images are scaled up to 2048 first
    assert pp.grid_for(512, 512, "low") == Grid(0, 0)
    assert pp.grid_for(4096, 1, "auto") == Grid(1, 4)
    assert pp.image_token_count(Grid(3, 4)) == 13 * 64


def test_decoded_files_match(tmp_path):
    # The same through real encoded files: PNG with alpha, JPEG (CMYK and greyscale), WebP.
    cases = [(make_image(333, 120, "RGBA", 1), "PNG"), (make_image(90, 200, "CMYK", 2), "JPEG"),
             (make_image(150, 150, "L", 3), "JPEG"), (make_image(401, 77, "RGB", 4), "WEBP"),
             (make_image(64, 300, "P+transparency", 5), "PNG")]
    for im, fmt in cases:
        buf = io.BytesIO()
        im.save(buf, format=fmt)
        compare_pixels(Image.open(io.BytesIO(buf.getvalue())), "auto", SMALL)


# ---------------------------------------------------------------------------------------------
# The prompt


@pytest.fixture(scope="module")
def smolvlm_tokenizer(smollm2_dir):
    return vision_util.smolvlm_tokenizer(smollm2_dir)


def reference_prompt_ids(tok, text, ims, detail, s):
    from transformers import Idefics3Processor

    proc = Idefics3Processor(image_processor=reference_processor(s, detail), tokenizer=tok,
                             image_seq_len=s.image_seq_len)
    return proc(text=[text], images=[ims])["input_ids"][0]


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sizes=st.lists(st.tuples(st.integers(1, 400), st.integers(1, 400)), min_size=1, max_size=3),
       detail=st.sampled_from(["auto", "low"]),
       words=st.lists(st.sampled_from(["Describe", " this", "\n", " image", ":", "  ", "é", "\n\n", ""]),
                      min_size=4, max_size=4))
def test_prompt_ids_match_the_processor(smolvlm_tokenizer, sizes, detail, words):
    tok = smolvlm_tokenizer
    s = SMALL
    ims = [make_image(w, h, "RGB", i) for i, (w, h) in enumerate(sizes)]
    body = "".join(f"{words[i % 4]}<image>" for i in range(len(ims))) + words[3]
    text = f"<|im_start|>User:{body}<end_of_utterance>\nAssistant:"
    want = reference_prompt_ids(tok, text, ims, detail, s)
    tokens = ImageTokens.lookup(lambda t: tok.convert_tokens_to_ids(t))
    grids = [pp.grid_for(im.width, im.height, detail, s) for im in ims]
    got = pp.layout_prompt(text, grids, tokens, lambda t: tok.encode(t, add_special_tokens=False), s)
    assert list(got.ids) == list(want)
    assert len(got.image_rows) == sum(pp.image_token_count(g, s) for g in grids)
    assert all(got.ids[r] == tokens.image for r in got.image_rows)


def test_prompt_ids_smolvlm_settings(smolvlm_tokenizer):
    tok = smolvlm_tokenizer
    ims = [make_image(1024, 768, "RGB", 0), make_image(512, 512, "RGB", 1)]
    text = "<|im_start|>User:<image>Compare<image>them.<end_of_utterance>\nAssistant:"
    want = reference_prompt_ids(tok, text, ims, "auto", SMOLVLM_256M)
    tokens = ImageTokens.lookup(lambda t: tok.convert_tokens_to_ids(t))
    got = pp.layout_prompt(text, [Grid(3, 4), Grid(4, 4)], tokens, lambda t: tok.encode(t, add_special_tokens=False))
    assert list(got.ids) == list(want)
    assert len(got.image_rows) == (13 + 17) * 64


def test_placeholder_count_must_match():
    tokens = ImageTokens(fake=1, image=2, global_img=3, row_col=tuple(tuple(range(10, 16)) for _ in range(6)))
    with pytest.raises(ValueError, match="2 image placeholders for 1 images"):
        pp.layout_prompt("<image><image>", [Grid(0, 0)], tokens, lambda t: [99])


def test_a_kernel_that_disagrees_with_pillow_is_not_used(monkeypatch):
    """resize.kernel_resizes() checks the kernel against the installed Pillow once a process,
    and where the bytes differ, preprocessing keeps Pillow's resize."""
    monkeypatch.setattr(resize.native, "has_lanczos_rgb", lambda: True)
    monkeypatch.setattr(resize, "resize_array", lambda a, size: np.zeros((size[1], size[0], 3), np.uint8))
    resize.kernel_resizes.cache_clear()
    try:
        assert resize.kernel_resizes() is False
    finally:
        resize.kernel_resizes.cache_clear()
    monkeypatch.undo()
    assert resize.kernel_resizes() is resize.native.has_lanczos_rgb()


def test_normalise_kernel_refuses_what_it_does_not_take():
    from caldrix.kernels import native

    if not native.has_lanczos_rgb():
        pytest.skip("resample.cpp is built for CPUs with AVX-512 F and BW")
    frames = torch.zeros((1, 4, 4, 3), dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="table is a contiguous"):
        torch.ops.caldrix.normalise_pixels(frames, torch.zeros((3, 256), dtype=torch.float16))
    with pytest.raises(RuntimeError, match="frames is a contiguous uint8"):
        torch.ops.caldrix.normalise_pixels(frames.float(), torch.zeros((3, 256)))
