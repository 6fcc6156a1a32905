"""The GGUF's Q4_1 blocks kept 4-bit (caldrix/models/q4.py) on the embedded SmolLM2."""

from __future__ import annotations

import pytest
import torch

from caldrix.engine import Engine
from caldrix.models import q4
from caldrix.models.decoder import Attend, KVCache, load_decoder
from caldrix.models.gguf import source_gguf
from engine_util import generate

pytestmark = pytest.mark.skipif(not q4.available(), reason="this torch has no int4 CPU matmul")


@pytest.fixture(scope="module")
def gguf_file(smollm2_dir):
    path = source_gguf(smollm2_dir)
    assert path is not None and path.suffix == ".gguf"
    return path


@pytest.fixture(scope="module")
def models(smollm2_dir, gguf_file):
    dense = load_decoder(smollm2_dir, torch.float32)
    quant = load_decoder(smollm2_dir, torch.bfloat16)
    assert q4.quantize_from_gguf(quant, gguf_file) == 4 * dense.cfg.num_layers
    return dense, quant


@pytest.mark.parametrize("layer", [0, 29])
@pytest.mark.parametrize("name", ["wqkv", "wo", "w_gate_up", "w_down"])
def test_4bit_weights_are_the_dequantized_weights(models, layer, name):
    """Multiplying by the identity reads each 4-bit weight back; it must equal the weight
    transformers dequantized from the same file, up to bfloat16 rounding. A wrong nibble order
    or q/k row permutation would be off by the weights' own size."""
    dense, quant = models
    lin = getattr(quant.layers[layer], name)
    assert isinstance(lin, q4.Int4Linear)
    want = getattr(dense.layers[layer], name).weight
    got = lin(torch.eye(lin.in_features, dtype=torch.bfloat16)).float().T
    rel = (got - want).abs().max() / want.abs().max()
    assert rel < 0.01


def test_4bit_logits_follow_the_reference(smollm2_dir, models):
    dense, quant = models
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(str(smollm2_dir)).encode("The history of the printing press begins in " * 8)[:64]
    logits = []
    for model in (dense, quant):
        model.setup_rope(64)
        kv = KVCache(model.cfg, 1, 64, model.embed.weight.dtype, "cpu")
        with torch.inference_mode():
            at = Attend("prefill", (0,), torch.arange(64), torch.arange(64))
            logits.append(model.logits(model(torch.tensor(ids), at, kv)))
    ref, got = logits
    agree = (ref.argmax(-1) == got.argmax(-1)).float().mean().item()
    assert agree >= 0.9, f"top-1 agreement {agree:.2f}"


def test_4bit_batch_invariance(smollm2_dir, gguf_file):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(smollm2_dir))
    prompts = [tuple(tok.encode(p)) for p in ("The capital of France is", "def add(a, b):", "Once upon a time",
                                              "Water boils at", "My name is", "List three fruits:")]
    engine = Engine.load(smollm2_dir, dtype=torch.bfloat16, max_batch=8, context=128, int4_from=gguf_file)
    alone = generate(engine, prompts, 24, together=False)
    together = generate(engine, prompts, 24, together=True)
    assert alone == together
