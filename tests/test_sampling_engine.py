"""Sampling through the real scheduler and engine on the embedded SmolLM2 (bf16, the default
dtype here): greedy equivalences, seeded reproducibility alone and in a batch of 8, and the
repetition penalty against transformers' own processor."""

from __future__ import annotations

import pytest
import torch

from caldrix.engine import Engine
from caldrix.protocol import SamplingParams
from engine_util import generate

PROMPT = "Write a poem about the sea."


@pytest.fixture(scope="module")
def tok(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_dir))


@pytest.fixture(scope="module")
def engine8(smollm2_dir):
    return Engine.load(smollm2_dir, dtype=torch.bfloat16, max_batch=8, context=256)


def test_temperature_zero_and_top_k_one_are_greedy(engine8, tok):
    ids = tuple(tok.encode(PROMPT))
    greedy, t0, k1 = generate(engine8, [ids] * 3, 24, together=True, sampling=[
        SamplingParams(),
        SamplingParams(temperature=0.0, top_p=0.5, seed=3),
        SamplingParams(temperature=1.5, top_k=1, seed=4),
    ])
    assert greedy == t0 == k1


def test_same_seed_same_reply_alone_and_among_eight(engine8, tok):
    prompts = [tuple(tok.encode(p)) for p in (PROMPT, "Tell me a joke.", "Name a city.", "Count to five.")]
    # the same prompt with seed 42 twice, beside six other requests with other seeds
    group = [prompts[0], prompts[1], prompts[0], prompts[2], prompts[3], prompts[1], prompts[2], prompts[3]]
    params = [SamplingParams(temperature=1.0, top_p=0.95, seed=s) for s in (42, 1, 42, 2, 3, 4, 5, 6)]
    together = generate(engine8, group, 32, together=True, sampling=params)
    (alone,) = generate(engine8, [prompts[0]], 32, together=True, sampling=[params[0]])
    assert together[0] == together[2] == alone


def test_different_seeds_give_different_replies(engine8, tok):
    ids = tuple(tok.encode(PROMPT))
    a, b = generate(engine8, [ids, ids], 32, together=True, sampling=[
        SamplingParams(temperature=1.0, seed=1), SamplingParams(temperature=1.0, seed=2)])
    assert a != b


def test_repetition_penalty_under_greedy_matches_transformers(smollm2_dir, tok):
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32).eval()
    ids = tuple(tok.encode("one two three one two three one two three"))
    with torch.inference_mode():
        out = ref.generate(torch.tensor([ids]), max_new_tokens=20, do_sample=False, repetition_penalty=1.3,
                           attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    want = out[0, len(ids):].tolist()
    eos = tok.eos_token_id
    want = want[: want.index(eos)] if eos in want else want
    engine = Engine.load(smollm2_dir, dtype=torch.float32, max_batch=1, context=128)
    (got,) = generate(engine, [ids], 20, together=True, stop=frozenset({eos}),
                      sampling=[SamplingParams(repetition_penalty=1.3)])
    (plain,) = generate(engine, [ids], 20, together=True, stop=frozenset({eos}))
    assert got == want
    assert got != plain  # the penalty changed the reply on this repetitive prompt
