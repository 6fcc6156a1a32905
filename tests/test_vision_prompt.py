"""caldrix/vision/prompt.py: a chat request with images becomes the ids SmolVLM's processor makes,
and its length is known before any image is decoded."""

from __future__ import annotations

import base64
import io

import pytest
from PIL import Image

import vision_util
from caldrix.protocol import SamplingParams
from caldrix.routes.schemas import ModelLimits, parse_chat
from caldrix.vision import prompt as vp
from caldrix.vision.images import DecodeFailure
from caldrix.vision.preprocess import SMOLVLM_256M, ImageTokens, Prepared

VISION = ModelLimits(served_name="smolvlm", vocab_size=49280, context=8192, has_chat_template=True, has_vision=True)


@pytest.fixture(scope="module")
def tok(smollm2_dir):
    return vision_util.smolvlm_tokenizer(smollm2_dir)


def png_url(w: int, h: int, seed: int = 0) -> str:
    import numpy as np

    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, size=(h, w, 3), dtype=np.uint8), "RGB").save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def plan(tok, messages):
    req = parse_chat({"model": "smolvlm", "messages": messages}, VISION, SamplingParams())
    render = lambda conv: tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)  # noqa: E731
    encode = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    return vp.plan_prompt(render, encode, req.messages, ImageTokens.lookup(tok.convert_tokens_to_ids))


def test_the_http_api_example_counts_82_prompt_tokens(tok, monkeypatch):
    # http-api.md's captured image request: a 1100x700 PNG (its IHDR in the cut base64),
    # detail low, "Describe this image in one sentence." -> usage.prompt_tokens 82.
    import caldrix.vision.images as images
    monkeypatch.setattr(images, "decode_image", lambda *a: pytest.fail("decoded while planning"))
    p = plan(tok, [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"detail": "low", "url": png_url(1100, 700)}},
        {"type": "text", "text": "Describe this image in one sentence."}]}])
    assert png_url(1100, 700).startswith("data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAABEwAAAK8")
    assert len(p.prompt.ids) == 82
    assert len(p.prompt.image_rows) == 64


def test_ids_match_the_processor(tok):
    from transformers import Idefics3Processor
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "First:"},
                                     {"type": "image_url", "image_url": {"url": png_url(300, 200, 1)}}]},
        {"role": "assistant", "content": "A picture."},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": png_url(90, 700, 2), "detail": "high"}},
                                     {"type": "text", "text": "And this one?"}]},
    ]
    ours = plan(tok, messages)
    s = SMOLVLM_256M
    ip = Idefics3ImageProcessorPil(size={"longest_edge": s.longest_edge}, max_image_size={"longest_edge": s.tile},
                                resample=1, image_mean=list(s.mean), image_std=list(s.std))
    proc = Idefics3Processor(image_processor=ip, tokenizer=tok, image_seq_len=s.image_seq_len,
                             chat_template=vision_util.SMOLVLM_CHAT_TEMPLATE)
    hf_messages = [
        {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": [{"type": "text", "text": "First:"}, {"type": "image"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "A picture."}]},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "And this one?"}]},
    ]
    text = proc.apply_chat_template(hf_messages, add_generation_prompt=True)
    ims = [Image.open(io.BytesIO(base64.b64decode(png_url(300, 200, 1).split(",")[1]))),
           Image.open(io.BytesIO(base64.b64decode(png_url(90, 700, 2).split(",")[1])))]
    want = proc(text=[text], images=[ims])["input_ids"][0]
    assert list(ours.prompt.ids) == list(want)
    assert [p.where for p in ours.images] == ["messages[1].content[1]", "messages[3].content[0]"]

    prepared = [vp.prepare_image(p) for p in ours.images]
    assert all(isinstance(p, Prepared) for p in prepared)
    assert sum(p.pixels.shape[0] for p in prepared) * 64 == len(ours.prompt.image_rows)


def test_a_cut_short_image_fails_when_prepared(tok):
    url = png_url(200, 200, 3)
    raw = base64.b64decode(url.split(",")[1])
    cut = "data:image/png;base64," + base64.b64encode(raw[: len(raw) * 2 // 3]).decode()
    p = plan(tok, [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": cut}}]}])
    failed = vp.prepare_image(p.images[0])
    assert isinstance(failed, DecodeFailure) and failed.param == "messages[0].content[0]"
