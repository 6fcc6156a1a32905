"""caldrix/models/idefics3.py and siglip.py against transformers' Idefics3 on a tiny random model.

The model is built at test time from transformers' config classes (fixed seed), saved as
safetensors in the Hugging Face layout and loaded back by `load_idefics3`. Prompts and pixels
come from caldrix/vision/preprocess.py with settings scaled to the tiny tower (32 px tiles,
4 <image> tokens a tile), so the whole path from an image to logits is the one the server runs.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from caldrix.kernels.packed import can_pack
from caldrix.models.base import Attend
from caldrix.models.idefics3 import Idefics3, Idefics3Config, load_idefics3, pixel_shuffle
from caldrix.vision import preprocess as pp

IMAGE, FAKE, GLOBAL = 150, 151, 152
TOKENS = pp.ImageTokens(fake=FAKE, image=IMAGE, global_img=GLOBAL,
                        row_col=tuple(tuple(104 + 6 * r + c for c in range(6)) for r in range(6)))
SETTINGS = pp.ProcessorSettings(longest_edge=64, tile=32, image_seq_len=4)


def encode(text: str) -> list[int]:
    return [3 + ord(ch) % 97 for ch in text]  # a stand-in tokenizer: ids 3..99


def tiny_reference(path, seed: int):
    """A tiny random Idefics3 (transformers' own classes: 2 SigLIP layers, 32-pixel tiles of 16
    patches, a 3-layer llama), saved at `path`; returns the reference model."""
    from transformers import Idefics3Config as HFConfig
    from transformers import Idefics3ForConditionalGeneration

    cfg = HFConfig(
        vision_config=dict(hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                           image_size=32, patch_size=8, initializer_range=0.2),
        text_config=dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=160, max_position_embeddings=1024,
                         rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=False, initializer_range=0.2),
        scale_factor=2, image_token_id=IMAGE, tie_word_embeddings=False)
    torch.manual_seed(seed)
    ref = Idefics3ForConditionalGeneration(cfg).eval()
    ref.save_pretrained(path)
    return ref


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_idefics3")
    ref = tiny_reference(path, seed=0)
    ours = load_idefics3(path, torch.float32)
    assert ours.cfg.image_seq_len == SETTINGS.image_seq_len
    return ref, ours


def image(w: int, h: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, size=(h, w, 3), dtype=np.uint8), "RGB")


def build(images: list[tuple[Image.Image, str]], text: str):
    """(ids [T], pixels [N, 3, 32, 32], <image> rows) for `text` holding one <image> per image."""
    prepared = [pp.preprocess(im, detail, SETTINGS) for im, detail in images]
    prompt = pp.layout_prompt(text, [p.grid for p in prepared], TOKENS, encode, SETTINGS)
    pixels = torch.cat([p.pixels for p in prepared])
    return torch.tensor(prompt.ids), pixels, torch.tensor(prompt.image_rows)


def run_prompt(model: Idefics3, ids, pixels, rows, kv, *, chunk: int) -> torch.Tensor:
    """Prefill in chunks of `chunk` rows as the engine does (image rows may span chunks);
    logits for every row."""
    feats = model.image_features(pixels)
    out = []
    for s in range(0, len(ids), chunk):
        e = min(s + chunk, len(ids))
        inside = (rows >= s) & (rows < e)
        embeds, where = (feats[inside], rows[inside] - s) if inside.any() else (None, None)
        at = Attend("prefill", (0,), torch.arange(s, e), torch.arange(s, e), embeds=embeds, embed_rows=where)
        h = model(ids[s:e], at, kv)
        out.append(model.logits(h))
    return torch.cat(out)


CASES = {
    "one image, tiled": ([(64, 40, "auto")], "User:<image>What is it?\nAssistant:"),
    "one image, low": ([(50, 90, "low")], "User:<image>Say.\nAssistant:"),
    "three images": ([(70, 30, "high"), (20, 20, "auto"), (33, 64, "low")],
                     "User:<image>and<image>\nthen <image> compare.\nAssistant:"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(tiny, case):
    ref, ours = tiny
    sizes, text = CASES[case]
    ids, pixels, rows = build([(image(w, h, i), d) for i, (w, h, d) in enumerate(sizes)], text)
    with torch.no_grad():
        want = ref(input_ids=ids[None], pixel_values=pixels[None]).logits[0].float()
        ours.setup_rope(512)
        kv = Idefics3.new_state(ours.cfg, 1, 512, torch.float32, "cpu")
        for chunk in (len(ids), 7):
            got = run_prompt(ours, ids, pixels, rows, kv, chunk=chunk)
            assert (got - want).abs().max().item() < 1e-4, chunk


def test_image_features_match_transformers(tiny):
    ref, ours = tiny
    _, pixels, _ = build([(image(64, 64, 5), "auto"), (image(10, 10, 6), "low")], "<image><image>")
    with torch.no_grad():
        want = ref.model.get_image_features(pixels[None]).pooler_output[0]
        got = ours.image_features(pixels)
    assert got.shape == want.shape == (pixels.shape[0] * 4, 64)
    assert (got - want).abs().max().item() < 1e-5


@pytest.mark.skipif(not can_pack(torch.bfloat16, "cpu"), reason="this CPU has no oneDNN bfloat16 kernels")
def test_packed_bf16_tower_matches_transformers_bf16(tiny, tmp_path):
    """In bfloat16 on a CPU with oneDNN's bf16 kernels the tower's Linears are packed, the GELU
    fused into fc1 (kernels/packed.py): its features stay as close to transformers' own bf16
    tower as the unpacked tower's are, measured against the float32 reference."""
    from transformers import Idefics3ForConditionalGeneration

    ref, _ = tiny
    ref.save_pretrained(tmp_path)
    packed = load_idefics3(tmp_path, torch.bfloat16)
    ref_bf16 = Idefics3ForConditionalGeneration.from_pretrained(tmp_path, dtype=torch.bfloat16).eval()
    assert packed.vision.layers[0].packing == "onednn"
    _, pixels, _ = build([(image(64, 64, 5), "auto"), (image(10, 10, 6), "low")], "<image><image>")
    with torch.no_grad():
        exact = ref.model.get_image_features(pixels[None]).pooler_output[0].float()
        theirs = ref_bf16.model.get_image_features(pixels[None].bfloat16()).pooler_output[0].float()
        ours = packed.image_features(pixels).float()
    scale = exact.abs().max().item()
    assert (ours - exact).abs().max().item() <= max(2 * (theirs - exact).abs().max().item(), 0.02 * scale)


def test_pixel_shuffle_matches_transformers():
    from transformers.models.idefics3.modeling_idefics3 import Idefics3Connector

    x = torch.randn(3, 64, 10)
    want = Idefics3Connector.pixel_shuffle(None, x, 2)
    assert torch.equal(pixel_shuffle(x, 2), want)
    x = torch.randn(2, 1024, 6)
    assert torch.equal(pixel_shuffle(x, 4), Idefics3Connector.pixel_shuffle(None, x, 4))


@pytest.mark.parametrize("case", ["one image, tiled", "three images"])
def test_greedy_tokens_match_transformers(tiny, case):
    ref, ours = tiny
    sizes, text = CASES[case]
    ids, pixels, rows = build([(image(w, h, 10 + i), d) for i, (w, h, d) in enumerate(sizes)], text)
    steps = 32
    with torch.no_grad():
        want = ref.generate(input_ids=ids[None], pixel_values=pixels[None], max_new_tokens=steps,
                            min_new_tokens=steps, do_sample=False)[0, len(ids):].tolist()
        ours.setup_rope(512)
        kv = Idefics3.new_state(ours.cfg, 1, 512, torch.float32, "cpu")
        # As the engine runs a prompt: chunks, the last prompt token alone in the decode form,
        # then one decode row per step.
        run_prompt(ours, ids[:-1], pixels, rows, kv, chunk=16)
        got, token, pos = [], int(ids[-1]), len(ids) - 1
        for _ in range(steps):
            at = Attend("decode", (0,), torch.tensor([pos]), torch.tensor([pos]), (pos + 1,), torch.tensor([0]))
            token = int(ours.logits(ours(torch.tensor([token]), at, kv)).argmax(-1))
            got.append(token)
            pos += 1
    assert got == want
    assert len(set(got)) > 3  # a reply that moves, not one token repeated


def test_full_tile_positions():
    from caldrix.models.siglip import full_tile_positions

    assert torch.equal(full_tile_positions(32), torch.arange(1024))  # SmolVLM: 512 px / 16 px patches
    assert torch.equal(full_tile_positions(4), torch.arange(16))


def test_config_of_the_published_shape():
    # SmolVLM-256M-Instruct's config.json values (docs/vision.md says where they come from).
    cfg = Idefics3Config.from_dict({
        "architectures": ["Idefics3ForConditionalGeneration"], "image_token_id": 49190, "scale_factor": 4,
        "text_config": {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
                        "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 49280,
                        "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 100000},
        "vision_config": {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
                          "num_attention_heads": 12, "image_size": 512, "patch_size": 16}})
    assert cfg.image_seq_len == 64 == pp.SMOLVLM_256M.image_seq_len
    assert cfg.vision.image_size == pp.SMOLVLM_256M.tile
    assert cfg.text.head_dim == 64 and not cfg.text.tie_embeddings
