"""The decider reading over HTTP, against real servers (tests/server_harness.py): a tiny random
llama saved with SmolLM2's tokenizer files and a tiny random Qwen3.5 with the rebuilt Qwen3.5
tokenizer, each with a decider_config.json beside its weights.

References: decider-ai 1.10.0 builds every prompt (prompt_fast.build_rows) and reads every answer
(temperature.scaled_softmax, systemone.assemble with its rounding switched off), from
transformers' float32 logits of each prompt read whole. caldrix reads the state once and each
later prompt from the kept state, so the comparison also checks that reuse does not move an
answer by more than 1e-5; the same questions asked one request each (nothing reused) are
compared with the many-question request directly. Refusals and config errors are checked with
their exact wording and param; usage.input_tokens counts the state once.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch

from server_harness import ServerProcess

pytest.importorskip("decider.systemone")
from decider import prompt_fast, systemone, temperature  # noqa: E402
from decider.prompt import letter_ids  # noqa: E402

PREFIX = "this model is a decider: "
STATE = {"ticket": {"text": "I was charged twice for my order\nand want one payment back.", "amount": 12.5},
         "history": [f"event {i}" for i in range(9)], "customer": "Zoë"}
QUESTIONS = {
    "team": {"type": "choice", "instructions": "Which team should handle this?",
             "criteria": {"billing": "payments and refunds", "shipping": "deliveries", "technical": None}},
    "urgency": {"type": "score", "instructions": "How urgent is it?",
                "criteria": ["0: not urgent", "1: somewhat urgent", {"level": 2, "means": "very urgent"}]},
    "angry": {"type": "noul", "criteria": {"true": "the customer is angry"}},
    "refund": {"type": "noul", "instructions": "Does the customer ask for a refund?"},
}
LLAMA_CONFIG = {"version": "test", "temperature": 1.3, "neutralize_none": False, "isolated_levels": True,
                "max_options": 40, "max_state_tokens": 400}
QWEN_CONFIG = {"temperature": 0.8, "neutralize_none": False, "isolated_levels": False}


# --- models ---------------------------------------------------------------------------------------


def _copy_tokenizer(src: Path, dst: Path) -> None:
    # A decider needs no chat template: none is copied.
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, dst / name)
    cfg = json.loads((dst / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (dst / "tokenizer_config.json").write_text(json.dumps(cfg))


@pytest.fixture(scope="module")
def llama_decider(tmp_path_factory, smollm2_dir):
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("decider-llama")
    torch.manual_seed(2727)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                      tie_word_embeddings=True, rope_theta=10000.0)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # spread the logits, so a wrong reading shows
        model.model.embed_tokens.weight.mul_(40)
    model.save_pretrained(path)
    _copy_tokenizer(smollm2_dir, path)
    (path / "decider_config.json").write_text(json.dumps(LLAMA_CONFIG))
    return path, model


@pytest.fixture(scope="module")
def qwen_decider(tmp_path_factory, qwen35_tokenizer_dir):
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    from test_qwen3_5 import TEXT

    path = tmp_path_factory.mktemp("decider-qwen35")
    torch.manual_seed(2728)
    text = {**TEXT, "vocab_size": 248320}  # the rebuilt tokenizer's ids, labels included
    model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**text, num_hidden_layers=3, tie_word_embeddings=True,
                                                 layer_types=["linear_attention", "full_attention",
                                                              "linear_attention"]))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3 if p.dim() == 1 else 0.12)
    model.save_pretrained(path)
    _copy_tokenizer(qwen35_tokenizer_dir, path)
    (path / "decider_config.json").write_text(json.dumps(QWEN_CONFIG))
    return path, model.eval()


@pytest.fixture(scope="module")
def llama_server(llama_decider):
    path, _ = llama_decider
    with ServerProcess.start(path, "--dtype", "float32", "--max-batch", "1", "--context", "512",
                             "--prefill-chunk", "32") as srv:
        yield srv


# --- the reference -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def no_rounding():
    mp = pytest.MonkeyPatch()
    mp.setattr(systemone, "round", lambda x, nd=None: x, raising=False)
    yield
    mp.undo()


def reference(model, path: Path, body: dict, config: dict) -> tuple[dict, int, int]:
    """decider-ai's answers from transformers' float32 logits of every prompt read whole, then
    (answers, tokens with the state read once, tokens with every prompt whole)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    rqs = {k: systemone.render_question(v) for k, v in body["questions"].items()}
    flat, index = systemone.plan_rows(rqs, config.get("isolated_levels", False))
    items, ctx_len = prompt_fast.build_rows(tok, systemone.render_state(body["state"]),
                                            [[(r["question"], list(r["options"]))] for r in flat],
                                            max_ctx_tokens=1 << 30)
    letters = letter_ids(tok)
    probs = []
    with torch.inference_mode():
        for it in items:
            hidden = model.float().model(torch.tensor([it["ids"]])).last_hidden_state[0, -1]
            logits = model.lm_head(hidden)  # the last row only: the vocabulary is large
            lg = logits[letters[: it["nopts"][0]]].float()
            probs.append(temperature.scaled_softmax(lg[None], config["temperature"])[0])
    whole = sum(len(it["ids"]) for it in items)
    once = ctx_len + sum(len(it["ids"]) - ctx_len for it in items) if len(items) > 1 else whole
    return systemone.assemble(rqs, index, probs), once, whole


def post(srv, body, timeout=300) -> httpx.Response:
    return httpx.post(srv.url + "/v1/systemone", json=body, timeout=timeout)


def check_answers(got: dict, want: dict) -> float:
    """Every answer within 1e-5 of the package's; returns how far the readings are from uniform."""
    spread = 0.0
    assert list(got) == list(want)
    for name, a in got.items():
        w = want[name]
        if a["type"] == "noul":
            assert abs(a["noul"] - w["noul"]) < 1e-5, name
            spread = max(spread, abs(a["noul"] - 0.5))
            continue
        ps = list(a["probabilities"].values())
        assert max(abs(x - y) for x, y in zip(ps, w["probabilities"].values())) < 1e-5, name
        assert abs(a["confidence"] - w["confidence"]) < 1e-5, name
        if a["type"] == "choice":
            assert a["choice"] == w["choice"], name
        else:
            assert abs(a["score"] - w["score"]) < 1e-5, name
        spread = max(spread, max(abs(p - 1 / len(ps)) for p in ps))
    return spread


def check_server(srv, model, path, config):
    name = httpx.get(srv.url + "/v1/models").json()["data"][0]["id"]
    body = {"model": name, "state": STATE, "questions": QUESTIONS}
    r = post(srv, body)
    assert r.status_code == 200, r.text
    want, once, whole = reference(model, path, body, config)
    got = r.json()
    assert got["model"] == name
    assert check_answers(got["answers"], want) > 0.02  # not a vacuous match
    assert once < whole
    assert got["usage"] == {"input_tokens": once, "output_tokens": 0}  # the state read once
    # Each question alone, with nothing to reuse (one prompt; isolated levels ask several).
    alone = {}
    for q, spec in QUESTIONS.items():
        one = {"model": name, "state": STATE, "questions": {q: spec}}
        r1 = post(srv, one)
        assert r1.status_code == 200, r1.text
        _, once1, _ = reference(model, path, one, config)
        assert r1.json()["usage"]["input_tokens"] == once1
        alone[q] = r1.json()["answers"][q]
    check_answers(alone, want)
    for q in QUESTIONS:  # reuse moves no answer by more than 1e-5
        check_answers({q: got["answers"][q]}, {q: _as_reference(alone[q])})
    return srv


def _as_reference(a: dict) -> dict:
    return {k: v for k, v in a.items() if k != "legend"}


def test_llama_decider_against_the_package(llama_server, llama_decider, no_rounding):
    path, model = llama_decider
    check_server(llama_server, model, path, LLAMA_CONFIG)
    assert "caldrix: a decider test (decider_config.json)" in llama_server.stderr
    assert ("caldrix: decider temperature 1.3, up to 40 options a choice, score levels: one yes/no prompt per "
            "level, states up to 400 tokens") in llama_server.stderr


def test_qwen35_decider_against_the_package(qwen_decider, no_rounding):
    path, model = qwen_decider
    with ServerProcess.start(path, "--dtype", "float32", "--max-batch", "1", "--context", "1024",
                             "--prefill-chunk", "32") as srv:
        check_server(srv, model, path, QWEN_CONFIG)
        assert "score levels: all levels in one prompt, states up to 32768 tokens" in srv.stderr


# --- refusals ----------------------------------------------------------------------------------------


def _refusal(srv, body) -> tuple[str, str | None]:
    r = post(srv, body)
    assert r.status_code == 400, r.text[:400]
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error"
    return err["message"], err["param"]


def _choice(n: int) -> dict:
    return {"type": "choice", "instructions": "pick", "criteria": {f"o{i}": None for i in range(n)}}


def test_refusals(llama_server):
    srv = llama_server
    base = {"model": httpx.get(srv.url + "/v1/models").json()["data"][0]["id"], "state": "short"}
    cases = [
        ({f"q{i}": {"type": "noul", "instructions": "?"} for i in range(65)},
         (f"{PREFIX}questions must hold 1 to 64 questions, got 65", "questions")),
        ({"q": _choice(41)}, (f"{PREFIX}a choice question takes 2 to 40 options, got 41", "questions.q.criteria")),
        ({"q": {"type": "score", "instructions": "rate", "criteria": [str(i) for i in range(11)]}},
         (f"{PREFIX}a score question takes 2 to 10 levels, got 11", "questions.q.criteria")),
        ({"q": {"type": "choice", "instructions": "", "criteria": {"a": None, "b": None}}},
         (f'{PREFIX}instructions are required on a choice question and may not be null or ""',
          "questions.q.instructions")),
        ({"q": {"type": "score", "instructions": None, "criteria": ["low", "high"]}},
         (f'{PREFIX}instructions are required on a score question and may not be null or ""',
          "questions.q.instructions")),
        ({"q": {"type": "noul", "criteria": {"false": None}}},
         (f"{PREFIX}a noul question without instructions needs criteria describing true or false",
          "questions.q.criteria")),
    ]
    for questions, want in cases:
        assert _refusal(srv, {**base, "questions": questions}) == want, questions
    q = {"q": {"type": "noul", "instructions": "?"}}
    # the state cap, counted on the ids: 'Context:\n' and 'word ' x n
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(Path(srv.args[4])))
    for n in (380, 420):
        state = "word " * n
        count = len(tok("Context:\n" + state, add_special_tokens=False)["input_ids"])
        r = post(srv, {**base, "state": state, "questions": q})
        if count <= 400:
            assert r.status_code == 200, r.text
        else:
            assert (r.json()["error"]["message"], r.json()["error"]["param"]) == (
                f'the state is {count} tokens with its "Context:" line, and this decider reads at most 400 '
                "(max_state_tokens)", "state")
    assert {count <= 400 for count in (len(tok("Context:\n" + "word " * n, add_special_tokens=False)["input_ids"])
                                       for n in (380, 420))} == {True, False}  # both sides of the cap
    # Too long even at the longest token (81 bytes in SmolLM2's vocabulary): refused on its length.
    state = "x" * 81 * 500
    assert _refusal(srv, {**base, "state": state, "questions": q}) == (
        f'the state is at least {-(-(len(state) + 9) // 81)} tokens with its "Context:" line, and this decider '
        "reads at most 400 (max_state_tokens)", "state")
    # The read step: a prompt of the whole context (512) has no room.
    big = {"q": {"type": "choice", "instructions": "pick " * 600, "criteria": {"a": None, "b": None}}}
    msg, param = _refusal(srv, {**base, "questions": big})
    assert post(srv, {**base, "questions": big}).json()["error"]["code"] == "context_length_exceeded"
    assert param == "questions.q" and msg.startswith("the prompt of question q is ")
    assert msg.endswith(" tokens and the context holds 512; that leaves no room for the read step")
    assert int(msg.split(" is ")[1].split()[0]) >= 512
    # 64 times the context: 64 score questions of 10 levels, each level its own prompt.
    many = {f"s{i}": {"type": "score", "instructions": "rate this " * 3, "criteria": [f"level {k}" for k in range(10)]}
            for i in range(64)}
    msg, param = _refusal(srv, {**base, "state": "word " * 100, "questions": many})
    assert param == "questions" and msg.startswith("the prompts of this request are ")
    assert msg.endswith(" tokens together, and at most 64 times the context (32768) are read for one request")
    assert int(msg.split(" are ")[1].split()[0]) > 32768
    assert srv.alive


# --- config errors at load ---------------------------------------------------------------------------


def test_config_errors_stop_the_load(llama_decider, tmp_path):
    src, _ = llama_decider
    path = tmp_path / "m"
    shutil.copytree(src, path)
    cfg = path / "decider_config.json"
    big = json.dumps({"temperature": 1.0, "neutralize_none": False, "pad": "x" * 65536})
    cases = [
        (json.dumps({"temperature": 1.0, "neutralize_none": False, "temperature_by_type": {}}),
         f'{cfg}: "temperature_by_type" (a temperature per answer type) is not built in this release; '
         'caldrix reads every answer at the one "temperature"'),
        (json.dumps({"temperature": 1.0, "neutralize_none": True}),
         f'{cfg}: "neutralize_none": true is not built in this release (caldrix writes every option as the '
         "request gives it); set it to false"),
        (big, f"{cfg}: {len(big)} bytes; a decider_config.json may be at most 65536 bytes (64 KiB)"),
    ]
    for text, message in cases:
        cfg.write_text(text)
        proc = subprocess.run([sys.executable, "-m", "caldrix", "serve", str(path), "--port", "1",
                               "--dtype", "float32"], capture_output=True, text=True, timeout=180,
                              cwd=Path(__file__).resolve().parent.parent)
        assert proc.returncode == 1, proc.stderr
        assert f"caldrix: {message}" in proc.stderr.splitlines(), proc.stderr
