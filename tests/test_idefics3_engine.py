"""A tiny random Idefics3 through the real Engine (loaded by its architecture's entry in
models/__init__.py) and Scheduler, against transformers' greedy tokens over 32 steps.

The image features reach the prompt as the route hands them over: `Engine.embed_images`, then
one `put_embeddings` key a run of consecutive <image> rows (vision/prompt.py `image_runs`), and
the Submission's EmbedSpans; the scheduler cuts the prompt into chunks that cut the runs."""

from __future__ import annotations

import pytest
import torch

from caldrix.engine import Engine
from caldrix.models import model_type
from caldrix.protocol import EmbedSpan
from caldrix.vision import preprocess as pp
from caldrix.vision.prompt import image_runs
from engine_util import generate
from test_idefics3 import CASES, IMAGE, SETTINGS, build, image, tiny_reference

STEPS = 32


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_idefics3_engine")
    ref = tiny_reference(path, seed=1)
    return ref, path


def hf_greedy(ref, ids: torch.Tensor, pixels: torch.Tensor, n: int) -> list[int]:
    """Plain arg-max decoding with transformers' model and its cache (no logits processors)."""
    from transformers import DynamicCache

    cache, out = DynamicCache(), []
    with torch.inference_mode():
        logits = ref(input_ids=ids[None], pixel_values=pixels[None], past_key_values=cache, use_cache=True).logits
        for _ in range(n):
            token = int(logits[0, -1].argmax())
            out.append(token)
            logits = ref(input_ids=torch.tensor([[token]]), past_key_values=cache, use_cache=True).logits
    return out


_keys = iter(range(1, 1 << 30))


def spans_for(engine: Engine, pixels: torch.Tensor, rows: torch.Tensor) -> tuple[EmbedSpan, ...]:
    feats = engine.embed_images(pixels)
    spans, used = [], 0
    for start, count in image_runs(rows.tolist()):
        key = next(_keys)
        engine.put_embeddings(key, feats[used : used + count])
        spans.append(EmbedSpan(key, start, count))
        used += count
    assert used == feats.shape[0]
    return tuple(spans)


def test_loads_through_the_architecture_map(tiny_dir):
    _, path = tiny_dir
    assert model_type(path) == "idefics3"
    engine = Engine.load(path, dtype=torch.float32, max_batch=2, context=512)
    assert engine.reuses_rows and engine.dtype == torch.float32


@pytest.mark.parametrize("together", [False, True], ids=["alone", "together"])
def test_engine_greedy_matches_transformers(tiny_dir, together):
    ref, path = tiny_dir
    engine = Engine.load(path, dtype=torch.float32, max_batch=2, context=512)
    prompts, spans, want = [], [], []
    for case in ("one image, tiled", "three images"):  # one image, then several
        sizes, text = CASES[case]
        ids, pixels, rows = build([(image(w, h, 20 + i), d) for i, (w, h, d) in enumerate(sizes)], text)
        want.append(hf_greedy(ref, ids, pixels, STEPS))
        prompts.append(tuple(ids.tolist()))
        spans.append(spans_for(engine, pixels, rows))
    got = generate(engine, prompts, STEPS, together=together, chunk=16, embeds=spans)
    assert got == want
    assert all(len(set(g)) > 3 for g in got)  # replies that move
    assert not engine.embeddings  # the scheduler dropped every key at the request's end


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bfloat16", "float32"])
def test_pixels_in_the_engines_dtype_give_the_same_features(tiny_dir, dtype):
    """The server preprocesses into Engine.pixel_dtype (vision/serving.py): a bfloat16 engine
    takes bfloat16 pixels, and its features are the ones float32 pixels give (its tower casts
    them to bfloat16 first); a float32 engine keeps float32 pixels."""
    _, path = tiny_dir
    engine = Engine.load(path, dtype=dtype, max_batch=1, context=512)
    assert engine.pixel_dtype == dtype
    im = image(70, 50, 3)
    full = pp.preprocess(im, "auto", SETTINGS)
    own = pp.preprocess(im, "auto", SETTINGS, engine.pixel_dtype)
    assert own.pixels.dtype == dtype
    assert torch.equal(engine.embed_images(own.pixels), engine.embed_images(full.pixels))
