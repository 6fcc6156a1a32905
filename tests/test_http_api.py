"""The HTTP API against shared/spec/http-api.md, through a real `caldrix serve` process.

Two servers for the whole module (each costs ~8 s to start on two cores):

- `server`: the embedded SmolLM2-135M-Instruct as a float32 HF directory (`smollm2_dir`), with
  `--dtype float32` so greedy output can be compared token for token with transformers. Most
  tests share it; they keep max_tokens short, since decoding shares two cores with the tests.
- `tight`: the same model with `--max-batch 1 --queue-depth 1 --served-name tight`, for the
  queue-full 429, the freed slot after a disconnect, and (last, since it stops the server)
  SIGTERM with a stream running.

Clients: the official `openai` client (max_retries=0, so a 429 is seen, not retried) and httpx
for raw bodies, status codes and server-sent events.
"""

from __future__ import annotations

import json
import random
import threading
import time
from pathlib import Path

import httpx
import pytest

from server_harness import ServerProcess

openai = pytest.importorskip("openai")

TIMEOUT = httpx.Timeout(120.0, connect=10.0)
PROMPT = "The capital of France is"
QUESTION = "What is the capital of France?"


# ---------------------------------------------------------------------------------------------
# Servers and clients


@pytest.fixture(scope="module")
def server(smollm2_dir: Path):
    srv = ServerProcess.start(smollm2_dir, "--dtype", "float32")
    yield srv
    status = srv.stop()
    assert status == 0, f"the server exited with status {status}:\n{srv.stderr}"


@pytest.fixture(scope="module")
def model(smollm2_dir: Path) -> str:
    """The served name of a directory: the directory's name."""
    return smollm2_dir.name


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=TIMEOUT) as client:
        yield client


@pytest.fixture(scope="module")
def oai(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    yield client
    client.close()


@pytest.fixture(scope="module")
def tight_holder(smollm2_dir: Path):
    """A list holding the tight server, started on first use; stopped at the end if still up."""
    holder: list[ServerProcess] = []
    yield holder, smollm2_dir
    for srv in holder:
        if srv.alive:
            srv.stop()


@pytest.fixture
def tight(tight_holder) -> ServerProcess:
    """The `--max-batch 1 --queue-depth 1` server; a fresh one if the last was stopped."""
    holder, model_dir = tight_holder
    if not holder or not holder[-1].alive:
        holder.append(ServerProcess.start(
            model_dir, "--dtype", "float32", "--max-batch", "1", "--queue-depth", "1",
            "--served-name", "tight",
        ))
    return holder[-1]


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_dir))


@pytest.fixture(scope="module")
def vocab_size(smollm2_dir: Path) -> int:
    return json.loads((smollm2_dir / "config.json").read_text())["vocab_size"]


@pytest.fixture(scope="module")
def reference(smollm2_dir: Path, tokenizer) -> tuple[list[int], list[int]]:
    """(prompt ids, greedy reply ids) of PROMPT from transformers' own generate, float32."""
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32)
    hf.eval()
    prompt_ids = tokenizer(PROMPT)["input_ids"]
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            do_sample=False, max_new_tokens=16, pad_token_id=tokenizer.eos_token_id,
        )
    del hf
    return list(prompt_ids), out[0, len(prompt_ids):].tolist()


@pytest.fixture(scope="module")
def greedy(http, model) -> dict:
    """The server's greedy /v1/completions reply to PROMPT, 16 tokens, with its token ids."""
    r = http.post("/v1/completions", json={
        "model": model, "prompt": PROMPT, "max_tokens": 16, "return_token_ids": True,
    })
    assert r.status_code == 200, r.text
    return r.json()


# ---------------------------------------------------------------------------------------------
# Helpers


def iter_events(lines):
    """The data of each server-sent event in `lines`, JSON-decoded ("[DONE]" as the string).

    Checks the framing on the way: each event is one `data: ` line followed by a blank line.
    """
    blank_expected = False
    for line in lines:
        if blank_expected:
            assert line == "", f"an event is not followed by a blank line: {line!r}"
            blank_expected = False
            continue
        assert line.startswith("data: "), f"not an SSE data line: {line!r}"
        data = line[len("data: "):]
        yield data if data == "[DONE]" else json.loads(data)
        blank_expected = True


def sse_events(response: httpx.Response) -> list:
    return list(iter_events(response.iter_lines()))


def stream_post(client: httpx.Client, path: str, body: dict) -> list:
    with client.stream("POST", path, json=body) as r:
        assert r.status_code == 200, r.read().decode()
        assert r.headers["content-type"].startswith("text/event-stream")
        return sse_events(r)


def chunk_text(event: dict) -> str:
    choice = event["choices"][0]
    if "delta" in choice:
        return choice["delta"].get("content") or ""
    return choice["text"]


def assert_error(r: httpx.Response, status: int, param: str | None, message: str | None = None,
                 *, contains: str | None = None, type_: str | None = None, code: str | None = None) -> dict:
    """The OpenAI error shape: {"error": {"message", "type", "param", "code"}}, nothing else."""
    assert r.status_code == status, f"{r.status_code}: {r.text}"
    assert r.headers["content-type"].startswith("application/json")
    body = r.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"], err
    assert err["param"] == param, err
    assert err["code"] == code, err
    expected_type = type_ or {400: "invalid_request_error", 413: "invalid_request_error",
                              404: "not_found_error", 405: "invalid_request_error",
                              429: "rate_limit_error"}.get(status)
    if expected_type:
        assert err["type"] == expected_type, err
    if message is not None:
        assert err["message"] == message, err
    if contains is not None:
        assert contains in err["message"], err
    return err


# ---------------------------------------------------------------------------------------------
# The openai client


def test_models_list_gives_the_directory_name(oai, model):
    models = oai.models.list()
    assert [m.id for m in models.data] == [model]
    assert models.data[0].object == "model"
    # OpenAI's Model type requires `created`: it validates, as a strict client would check it
    openai.types.Model.model_validate(models.data[0].model_dump())
    assert 0 < models.data[0].created <= time.time()


def test_models_retrieve_gives_the_served_model_and_a_404_for_others(oai, http, model):
    """OpenAI's GET /v1/models/{id}, as the official client's models.retrieve calls it."""
    got = oai.models.retrieve(model)
    assert (got.id, got.object) == (model, "model")
    with pytest.raises(openai.NotFoundError) as missing:
        oai.models.retrieve("org/not-served")
    assert missing.value.body["code"] == "model_not_found" and missing.value.body["param"] == "model"
    assert http.get("/v1/models/org%2Fnot-served").status_code == 404
    long = http.get("/v1/models/" + "m" * 8000)  # quoted cut short, as every refusal quotes
    assert long.status_code == 404 and long.json()["error"]["message"] == f"The model '{'m' * 63}…' does not exist"


def test_chat_non_stream(oai, model):
    r = oai.chat.completions.create(
        model=model, messages=[{"role": "user", "content": QUESTION}], max_tokens=12,
    )
    assert r.object == "chat.completion"
    assert r.id.startswith("chatcmpl-")
    assert r.model == model
    assert len(r.choices) == 1
    choice = r.choices[0]
    assert choice.index == 0
    assert choice.message.role == "assistant"
    assert "Paris" in choice.message.content
    assert choice.finish_reason in ("stop", "length")
    u = r.usage
    assert u.completion_tokens >= 1 and u.prompt_tokens > 10
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens


def test_chat_stream_with_usage_matches_non_stream(oai, model):
    messages = [{"role": "user", "content": QUESTION}]
    whole = oai.chat.completions.create(model=model, messages=messages, max_tokens=12)
    chunks = list(oai.chat.completions.create(
        model=model, messages=messages, max_tokens=12, stream=True,
        stream_options={"include_usage": True},
    ))
    *body, last = chunks
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert len({c.id for c in chunks}) == 1
    # The final chunk is usage only, with no choices.
    assert last.choices == []
    assert last.usage is not None
    assert last.usage.prompt_tokens == whole.usage.prompt_tokens
    assert last.usage.completion_tokens == whole.usage.completion_tokens
    assert last.usage.total_tokens == last.usage.prompt_tokens + last.usage.completion_tokens
    assert all(c.usage is None for c in body)
    text = "".join(c.choices[0].delta.content or "" for c in body)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in body]
    assert finishes[-1] == whole.choices[0].finish_reason
    assert all(f is None for f in finishes[:-1])


def test_the_openai_stream_helper_builds_the_whole_message(oai, model):
    """The package's stream helper assembles the reply from the deltas: the role must come in
    one of them (the Node package's helper refuses a stream without it), and the message it
    builds is the non-streamed one."""
    messages = [{"role": "user", "content": QUESTION}]
    whole = oai.chat.completions.create(model=model, messages=messages, max_tokens=12)
    with oai.chat.completions.stream(model=model, messages=messages, max_tokens=12) as stream:
        final = stream.get_final_completion()
    assert final.choices[0].message.role == "assistant"
    assert final.choices[0].message.content == whole.choices[0].message.content
    assert final.choices[0].finish_reason == whole.choices[0].finish_reason


def test_an_empty_streamed_reply_says_its_empty_content(oai, http, model):
    """A stop string at the first token: the one delta carries the role and content "", so the
    stream helper's message is the non-streamed one ("" , not None)."""
    messages = [{"role": "user", "content": QUESTION}]
    whole = oai.chat.completions.create(model=model, messages=messages, max_tokens=12, stop=["The"])
    assert whole.choices[0].message.content == "" and whole.choices[0].finish_reason == "stop"
    events = stream_post(http, "/v1/chat/completions", {"model": model, "messages": messages, "max_tokens": 12,
                                                        "stop": ["The"], "stream": True})
    assert [c["choices"] for c in events[:-1]] == [
        [{"delta": {"role": "assistant", "content": ""}, "finish_reason": "stop", "index": 0}]]
    with oai.chat.completions.stream(model=model, messages=messages, max_tokens=12, stop=["The"]) as stream:
        final = stream.get_final_completion()
    assert final.choices[0].message.content == "" and final.choices[0].message.role == "assistant"


def greedy_text(greedy: dict, tokenizer, n: int) -> str:
    return tokenizer.decode(greedy["choices"][0]["token_ids"][:n], clean_up_tokenization_spaces=False)


def test_completion_non_stream(oai, model, greedy, tokenizer):
    r = oai.completions.create(model=model, prompt=PROMPT, max_tokens=8)
    assert r.object == "text_completion"
    assert r.id.startswith("cmpl-")
    assert r.model == model
    assert r.choices[0].index == 0
    assert r.choices[0].text == greedy_text(greedy, tokenizer, 8)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 8
    assert r.usage.prompt_tokens == greedy["usage"]["prompt_tokens"]
    assert r.usage.total_tokens == r.usage.prompt_tokens + 8


def test_completion_stream_with_usage(oai, model, greedy, tokenizer):
    chunks = list(oai.completions.create(
        model=model, prompt=PROMPT, max_tokens=8, stream=True, stream_options={"include_usage": True},
    ))
    *body, last = chunks
    assert all(c.object == "text_completion" for c in chunks)
    assert last.choices == [] and last.usage is not None
    assert last.usage.completion_tokens == 8
    assert last.usage.prompt_tokens == greedy["usage"]["prompt_tokens"]
    assert "".join(c.choices[0].text for c in body) == greedy_text(greedy, tokenizer, 8)
    assert body[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in body[:-1])


# ---------------------------------------------------------------------------------------------
# Correctness against transformers


def test_greedy_completion_equals_transformers_generate(greedy, reference, tokenizer):
    prompt_ids, want = reference
    choice = greedy["choices"][0]
    assert greedy["usage"]["prompt_tokens"] == len(prompt_ids)
    assert choice["token_ids"] == want
    assert choice["text"] == tokenizer.decode(want, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def test_token_id_prompt_is_the_same_prompt(http, model, greedy, reference):
    prompt_ids, _ = reference
    want = greedy["choices"][0]["token_ids"]
    # The ids themselves, and a batch of one (its single prompt), shorter to save time.
    for prompt, n in ((prompt_ids, 16), ([prompt_ids], 4)):
        r = http.post("/v1/completions", json={
            "model": model, "prompt": prompt, "max_tokens": n, "return_token_ids": True,
        })
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["choices"][0]["token_ids"] == want[:n]
        assert greedy["choices"][0]["text"].startswith(body["choices"][0]["text"])
        assert body["usage"]["prompt_tokens"] == len(prompt_ids)
    r = http.post("/v1/completions", json={"model": model, "prompt": [[1], [2]], "max_tokens": 1})
    assert_error(r, 400, "prompt", contains="one prompt a request")


# ---------------------------------------------------------------------------------------------
# The spec's curl examples, adapted to this model


def test_spec_example_chat(http, model):
    r = http.post("/v1/chat/completions", json={
        "model": model, "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 16,
    })
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("application/json")
    body = r.json()
    assert set(body) == {"choices", "created", "id", "model", "object", "usage"}
    assert body["object"] == "chat.completion" and body["model"] == model
    assert isinstance(body["created"], int) and abs(body["created"] - time.time()) < 600
    (choice,) = body["choices"]
    assert set(choice) == {"finish_reason", "index", "message"}
    assert set(choice["message"]) == {"content", "role"}
    assert choice["message"]["content"] == "The capital of France is Paris."
    assert choice["finish_reason"] == "stop"  # the model's end of sequence, before 16 tokens
    assert body["usage"]["completion_tokens"] < 16


def test_spec_example_streamed_chat_max_tokens_2(http, model):
    events = stream_post(http, "/v1/chat/completions", {
        "model": model, "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 2,
        "stream": True,
    })
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(set(c) == {"choices", "created", "id", "model", "object"} for c in chunks)
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1 and chunks[0]["id"].startswith("chatcmpl-")
    *content, final = chunks
    assert final["choices"] == [{"delta": {}, "finish_reason": "length", "index": 0}]
    assert 1 <= len(content) <= 2
    for c in content:
        assert c["choices"][0]["finish_reason"] is None
    # the first delta says whose it is (the openai packages' stream helpers need it), no other does
    assert content[0]["choices"][0]["delta"]["role"] == "assistant"
    assert [set(c["choices"][0]["delta"]) for c in content] == [{"role", "content"}] + [{"content"}] * (len(content) - 1)
    assert "".join(chunk_text(c) for c in content) == "The capital"


def test_spec_example_top_p_2(http, model):
    r = http.post("/v1/chat/completions", json={
        "model": model, "messages": [{"role": "user", "content": "hi"}], "top_p": 2,
    })
    assert r.status_code == 400
    assert r.json() == {"error": {"code": None, "message": "must be 0 < p <= 1, got 2",
                                  "param": "top_p", "type": "invalid_request_error"}}


def test_healthz_and_health(http):
    for path in ("/healthz", "/health"):
        r = http.get(path)
        assert r.status_code == 200 and r.text == "ok"


# ---------------------------------------------------------------------------------------------
# Errors: every row of the spec


def post_raw(http, path: str, content: bytes) -> httpx.Response:
    return http.post(path, content=content, headers={"Content-Type": "application/json"})


@pytest.mark.parametrize("raw, param, contains", [
    (b'{"model": ', None, "not valid JSON"),
    (b"", None, "empty"),
    (b"[1, 2]", None, "must be a JSON object"),
    (b'{"prompt": NaN}', None, None),
    (b"\xff\xfe{}", None, "not UTF-8"),
    (b'{"model": "M", "model": "M", "prompt": "x"}', "model", 'duplicate key "model"'),
    (b'{"prompt": "x", "stream_options": {"include_usage": true, "include_usage": false}}',
     "stream_options.include_usage", "duplicate key"),
])
def test_malformed_bodies(http, raw, param, contains):
    assert_error(post_raw(http, "/v1/completions", raw), 400, param, contains=contains)


def test_duplicate_key_inside_a_message(http, model):
    raw = ('{"model": "%s", "messages": [{"role": "user", "role": "system", "content": "hi"}]}'
           % model).encode()
    assert_error(post_raw(http, "/v1/chat/completions", raw), 400, "messages[0].role",
                 contains="duplicate key")


WRONG_TYPES = [
    ("/v1/completions", {"max_tokens": "16"}, "max_tokens", "must be an integer, got string"),
    ("/v1/completions", {"max_tokens": 16.0}, "max_tokens", "must be an integer, got number 16.0"),
    ("/v1/completions", {"max_tokens": True}, "max_tokens", "must be an integer, got boolean"),
    ("/v1/completions", {"stream": 1}, "stream", "must be a boolean, got number"),
    ("/v1/completions", {"temperature": "hot"}, "temperature", "must be a number, got string"),
    ("/v1/completions", {"seed": 2.5}, "seed", "must be an integer, got number 2.5"),
    ("/v1/completions", {"return_token_ids": "yes"}, "return_token_ids", "must be a boolean"),
    ("/v1/completions", {"prompt": 5}, "prompt", "must be a string or an array of token ids"),
    ("/v1/completions", {"prompt": [1, "a"]}, "prompt", "must be a token id"),
    ("/v1/completions", {"model": 7}, "model", "must be a string, got number"),
    ("/v1/completions", {"stop": 3}, "stop", "must be a string or an array of strings"),
    ("/v1/completions", {"user": 3}, "user", "must be a string"),
    ("/v1/chat/completions", {"messages": "hi"}, "messages", "must be an array of messages"),
    ("/v1/chat/completions", {"messages": [{"role": 1, "content": "hi"}]}, "messages[0].role",
     "must be a string"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, "messages[0].content",
     "must be a string or an array of content parts"),
    ("/v1/chat/completions", {"stream": True, "stream_options": {"include_usage": 1}},
     "stream_options.include_usage", "must be a boolean"),
]


def base_body(path: str, model: str) -> dict:
    if path == "/v1/completions":
        return {"model": model, "prompt": "Hi", "max_tokens": 1}
    return {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}


@pytest.mark.parametrize("path, fields, param, contains", WRONG_TYPES)
def test_wrong_types(http, model, path, fields, param, contains):
    body = {**base_body(path, model), **fields}
    assert_error(http.post(path, json=body), 400, param, contains=contains)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_unknown_and_missing_model(http, model, path):
    body = base_body(path, model)
    err = assert_error(http.post(path, json={**body, "model": "gpt-4o"}), 400, "model")
    assert "gpt-4o" in err["message"] and model in err["message"]
    del body["model"]
    assert_error(http.post(path, json=body), 400, "model", contains="required")


def test_prompt_on_chat_and_messages_on_completions(http, model):
    chat = {**base_body("/v1/chat/completions", model), "prompt": "Hi"}
    assert_error(http.post("/v1/chat/completions", json=chat), 400, "prompt",
                 "prompt is refused here; send messages")
    comp = {**base_body("/v1/completions", model), "messages": [{"role": "user", "content": "Hi"}]}
    assert_error(http.post("/v1/completions", json=comp), 400, "messages", contains="messages is refused here")


NOT_IMPLEMENTED = [  # (field, a non-neutral value, the neutral values)
    ("n", 2, [1]),
    ("presence_penalty", 0.5, [0, 0.0]),
    ("frequency_penalty", 1, [0]),
    ("top_logprobs", 2, [0]),
    ("best_of", 2, [1]),
    ("logprobs", True, [False, 0]),
    ("logit_bias", {"42": 5}, [{}]),
    ("tools", [{"type": "function", "function": {"name": "f", "parameters": {}}}], [[]]),
    ("tool_choice", "auto", ["none"]),
    ("response_format", {"type": "json_object"}, [{"type": "text"}]),
]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("field, value, neutral", NOT_IMPLEMENTED, ids=[f[0] for f in NOT_IMPLEMENTED])
def test_not_implemented_fields_refused(http, model, path, field, value, neutral):
    err = assert_error(http.post(path, json={**base_body(path, model), field: value}), 400, field)
    assert err["message"].startswith(f"{field} is not supported by this server")
    # Another type is refused too: only the neutral value (or null) passes.
    assert_error(http.post(path, json={**base_body(path, model), field: "x"}), 400, field)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_not_implemented_fields_accepted_at_neutral_and_null(http, model, path):
    # On completions each field alone at each neutral value; on both, all of them at once
    # and all of them null. One token each.
    bodies = []
    if path == "/v1/completions":
        bodies = [{field: v} for field, _, neutral in NOT_IMPLEMENTED for v in neutral]
    bodies.append({field: neutral[0] for field, _, neutral in NOT_IMPLEMENTED})
    bodies.append({field: None for field, _, _ in NOT_IMPLEMENTED})
    for extra in bodies:
        r = http.post(path, json={**base_body(path, model), **extra})
        assert r.status_code == 200, (extra, r.text)
        assert r.json()["usage"]["completion_tokens"] == 1


def test_peer_feature_fields_refused_by_name_and_accepted_off(http, model):
    """Every feature field of OpenAI's, vLLM's and llama-server's requests that routes/fields.py
    lists, through the live route: at a value that would change the reply, a 400 naming it; at
    its off value (what this server does anyway), answered. One token each."""
    from caldrix.routes.fields import PEER_FEATURES

    path = "/v1/completions"
    for f in PEER_FEATURES:
        err = assert_error(http.post(path, json={**base_body(path, model), f.name: 12345}), 400, f.name)
        assert err["message"].startswith(f"{f.name} is not supported by this server"), err
        assert f.shown in err["message"], err
        for off in (*f.neutral, None):
            r = http.post(path, json={**base_body(path, model), f.name: off})
            assert r.status_code == 200, (f.name, off, r.text)


def test_unknown_fields_seed_and_user_accepted(http, model):
    body = {**base_body("/v1/completions", model), "seed": 7, "user": "u", "echo": False,
            "metadata": {"a": 1}}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text


def test_image_part_on_text_model(http, model):
    messages = [
        {"role": "user", "content": "Hello"},
        {"role": "user", "content": [
            {"type": "text", "text": "Describe this image."},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo=", "detail": "low"}},
        ]},
    ]
    r = http.post("/v1/chat/completions", json={"model": model, "messages": messages, "max_tokens": 1})
    assert_error(r, 400, "messages[1].content[1]", "this model takes text only")


def test_image_placeholder_typed_into_text(http, model):
    r = http.post("/v1/chat/completions", json={
        "model": model, "messages": [{"role": "user", "content": "look: <image>"}], "max_tokens": 1})
    err = assert_error(r, 400, "messages[0].content")
    assert err["message"].startswith("image placeholder count")
    r = http.post("/v1/chat/completions", json={"model": model, "max_tokens": 1, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "ok"}, {"type": "text", "text": "<image>"}]}]})
    err = assert_error(r, 400, "messages[0].content[1]")
    assert err["message"].startswith("image placeholder count")


@pytest.mark.parametrize("part, contains", [
    ({"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}, 'content part type "input_audio"'),
    ({"text": "no type"}, 'needs a "type"'),
    ({"type": "text"}, 'a text part needs "text" as a string'),
    ({"type": "text", "text": 5}, 'a text part needs "text" as a string'),
    ("just a string", "a content part must be an object"),
    ({"type": 3}, "must be a string"),
])
def test_bad_content_part(http, model, part, contains):
    messages = [{"role": "user", "content": [{"type": "text", "text": "hi"}, part]}]
    r = http.post("/v1/chat/completions", json={"model": model, "messages": messages, "max_tokens": 1})
    assert_error(r, 400, "messages[0].content[1]", contains=contains)


def test_text_parts_are_accepted(http, model):
    messages = [{"role": "user", "content": [{"type": "text", "text": "What is the capital"},
                                             {"type": "text", "text": "of France?"}]}]
    r = http.post("/v1/chat/completions", json={"model": model, "messages": messages, "max_tokens": 1})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("messages, param", [
    ([], "messages"),
    ([{"role": "user", "content": "hi"}] * 257, "messages"),
    ([{"role": "tool", "content": "x"}], "messages[0].role"),
    ([{"role": "robot", "content": "x"}], "messages[0].role"),
    ([{"role": "user"}], "messages[0].content"),
    (["hi"], "messages[0]"),
])
def test_bad_messages(http, model, messages, param):
    r = http.post("/v1/chat/completions", json={"model": model, "messages": messages, "max_tokens": 1})
    assert_error(r, 400, param)


@pytest.mark.parametrize("stop, contains", [
    (["a", "b", "c", "d", "e"], "at most 4"),
    ("x" * 257, "257 bytes"),
    (["ok", "é" * 129], "stop[1] is 258 bytes"),
    ("", "0 bytes"),
    ([1], "stop[0] must be a string"),
])
def test_stop_limits(http, model, stop, contains):
    r = http.post("/v1/completions", json={**base_body("/v1/completions", model), "stop": stop})
    assert_error(r, 400, "stop", contains=contains)


def test_stop_limits_at_the_edge_are_accepted(http, model):
    stop = ["a", "b", "c", "é" * 128]  # four strings, the last 256 bytes
    r = http.post("/v1/completions", json={**base_body("/v1/completions", model), "stop": stop})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_max_tokens_zero(http, model, path, field):
    body = {**base_body(path, model)}
    del body["max_tokens"]
    body[field] = 0
    assert_error(http.post(path, json=body), 400, field, "must be an integer >= 1, got 0")


def test_max_tokens_disagreeing(http, model):
    body = {**base_body("/v1/completions", model), "max_completion_tokens": 2}
    assert_error(http.post("/v1/completions", json=body), 400, "max_completion_tokens", contains="disagree")


def test_prompt_too_long_for_the_context(http, server, model):
    ctx = server.context
    r = http.post("/v1/completions", json={"model": model, "prompt": [42] * ctx, "max_tokens": 1})
    past = "context_length_exceeded"  # OpenAI's code, which LangChain and litellm read as a context overflow
    assert_error(r, 400, "prompt", contains=f"the context holds {ctx}", code=past)
    # A text prompt past the context, and chat messages past it.
    long_text = "hello " * (ctx + 100)
    r = http.post("/v1/completions", json={"model": model, "prompt": long_text, "max_tokens": 1})
    assert_error(r, 400, "prompt", contains="leaves no room for a reply", code=past)
    r = http.post("/v1/chat/completions", json={
        "model": model, "messages": [{"role": "user", "content": long_text}], "max_tokens": 1})
    assert_error(r, 400, "messages", contains="leaves no room for a reply", code=past)


def words_of(n_bytes: int) -> str:
    rng = random.Random(n_bytes)
    text = " ".join(f"w{rng.randrange(10**6)}" for _ in range(n_bytes // 4))
    return text[:n_bytes]


def test_a_prompt_that_cannot_fit_is_refused_before_it_is_tokenized(http, server, model, tokenizer):
    """Past the vocabulary's longest token per token, a text cannot fit whatever it spells: the
    400 says "at least" (a bound, not a count), and comes without tokenizing megabytes."""
    longest = max(len(t.encode()) for t in tokenizer.get_vocab())
    text = words_of(longest * server.context + 1)
    for path, body in (("/v1/completions", {"prompt": text}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": text}]})):
        r = http.post(path, json={"model": model, "max_tokens": 1, **body})
        err = assert_error(r, 400, "prompt" if "prompt" in body else "messages", code="context_length_exceeded")
        assert err["message"] == (f"the prompt is at least {server.context + 1} tokens and the context holds "
                                  f"{server.context}; that leaves no room for a reply")


def test_a_long_prompt_is_tokenized_off_the_event_loop(http, server, model, tokenizer):
    """A prompt just under that bound is tokenized, which takes a while; meanwhile the server
    answers others. Done on the event loop, /healthz sent while it ran waited for its 400."""
    longest = max(len(t.encode()) for t in tokenizer.get_vocab())
    text = words_of(longest * server.context - longest)
    done: dict[str, float] = {}

    def big() -> None:
        with httpx.Client(base_url=server.url, timeout=TIMEOUT) as c:
            r = c.post("/v1/completions", json={"model": model, "prompt": text, "max_tokens": 1})
        done["big"] = time.monotonic()
        err = assert_error(r, 400, "prompt")
        assert "at least" not in err["message"]  # counted, so it was tokenized

    thread = threading.Thread(target=big)
    thread.start()
    time.sleep(0.3)  # the body is up and parsed; tokenizing it takes seconds on two cores
    assert http.get("/healthz").status_code == 200
    done["health"] = time.monotonic()
    thread.join()
    assert done["health"] < done["big"]


def test_a_large_body_is_parsed_off_the_event_loop(http, server, model):
    """Just under 4 MiB of a two-million-element array and a duplicate key: parsing it (twice,
    the second time to find the duplicate) takes about a second, and on the event loop /healthz
    sent meanwhile waited for its 400, as every stream did."""
    pad = b"0," * (2 * 2**20 - 64)
    body = b'{"model": "%s", "prompt": "hi", "pad": [%s0], "pad": 1}' % (model.encode(), pad)
    assert len(body) < 4 * 2**20
    done: dict[str, float] = {}

    def big() -> None:
        with httpx.Client(base_url=server.url, timeout=TIMEOUT) as c:
            r = c.post("/v1/completions", content=body, headers={"Content-Type": "application/json"})
        done["big"] = time.monotonic()
        assert_error(r, 400, "pad", 'duplicate key "pad" in the request body')

    thread = threading.Thread(target=big)
    thread.start()
    time.sleep(0.3)  # the body is up; parsing it takes about a second on two cores
    assert http.get("/healthz").status_code == 200
    done["health"] = time.monotonic()
    thread.join()
    assert done["health"] < done["big"]


@pytest.mark.parametrize("bad", ["vocab", -1])
def test_token_ids_out_of_vocabulary(http, model, vocab_size, bad):
    tid = vocab_size if bad == "vocab" else bad
    r = http.post("/v1/completions", json={"model": model, "prompt": [1, 2, tid], "max_tokens": 1})
    err = assert_error(r, 400, "prompt")
    assert f"prompt[2] is token id {tid}, outside the vocabulary (0 to {vocab_size - 1})" == err["message"]


@pytest.mark.parametrize("prompt", ["", [], ["a", "b"]])
def test_bad_prompts(http, model, prompt):
    r = http.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 1})
    assert_error(r, 400, "prompt")


def test_body_over_4_mib_is_413(http, model):
    pad = "x" * (4 * 2**20)
    body = json.dumps({"model": model, "prompt": "hi", "pad": pad}).encode()
    assert len(body) > 4 * 2**20
    # Twice on one keep-alive client, then a good request on it: the refused body's unread
    # rest must not wedge the connection (the 413 closes it; the client opens a new one).
    for path in ("/v1/completions", "/v1/chat/completions"):
        r = post_raw(http, path, body)
        assert_error(r, 413, None, "the request body is over 4 MiB")
        assert r.headers.get("connection") == "close"
    assert http.get("/healthz", timeout=10).text == "ok"


def test_a_compressed_body_is_415_naming_its_encoding(http, model):
    import gzip

    body = gzip.compress(json.dumps({"model": model, "prompt": "hi", "max_tokens": 1}).encode())
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/systemone"):
        r = http.post(path, content=body, headers={"Content-Type": "application/json", "Content-Encoding": "gzip"})
        assert_error(r, 415, None, "Content-Encoding gzip is not supported; send the body uncompressed")
    r = http.post("/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 1},
                  headers={"Content-Encoding": "identity"})
    assert r.status_code == 200, r.text


def test_clients_that_hang_up_on_a_refused_body_leave_the_server_up(server, http, model):
    """Part of a body, then the client hangs up while the 413 (or 415) is written: hypercorn's
    own error response for the cut body met the refusal on the socket, its connection task
    raised, and that ended the whole server (connections.mend_tcp_server)."""
    import socket

    heads = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
             b"Content-Length: 5000000\r\n\r\n",
             b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
             b"Content-Encoding: gzip\r\nContent-Length: 5000\r\n\r\n")
    for i in range(40):
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
            s.sendall(heads[i % 2] + b'{"model": "x", "prompt": "' + b"a" * 1000)
            s.shutdown(socket.SHUT_WR)
            try:
                s.recv(65536)
            except OSError:
                pass
    assert server.proc.poll() is None, server.stderr
    assert http.get("/healthz", timeout=10).text == "ok"
    r = http.post("/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 1})
    assert r.status_code == 200, r.text


def test_a_client_that_leaves_mid_upload_leaves_a_log_line(server, http, model):
    """No response is ever written for it, so the log line is the request's only trace."""
    import socket

    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 1234\r\n\r\n" + b'{"model": "x", ')
        time.sleep(0.3)
    line = ("request - POST /v1/chat/completions cancelled before its body was read (Content-Length 1234): "
            "the client left, or the server is stopping")
    deadline = time.monotonic() + 10
    while line not in server.stderr and time.monotonic() < deadline:
        time.sleep(0.05)
    assert line in server.stderr
    assert http.get("/healthz", timeout=10).text == "ok"


def test_a_body_that_stalls_is_a_408_that_closes_the_connection(smollm2_dir):
    """A body still arriving after the body timeout (app.py's BODY_TIMEOUT_S, 300 s; 1 s here)
    is a 408 in the error shape, with Connection: close since the rest of the body is still on
    the wire; the server then serves others as usual."""
    import socket

    with ServerProcess.start(smollm2_dir, "--served-name", "m",
                             before="import caldrix.app\ncaldrix.app.BODY_TIMEOUT_S = 1") as srv:
        body = json.dumps({"model": "m", "prompt": "hi", "max_tokens": 1}).encode()
        with socket.create_connection(("127.0.0.1", srv.port), timeout=30) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: %d\r\n\r\n" % len(body) + body[:5])
            began = time.monotonic()
            got = _read_until_closed(s)
            waited = time.monotonic() - began
        head, _, payload = got.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408"), got[:300]
        assert b"connection: close" in head.lower(), head
        assert json.loads(payload) == {"error": {"message": "the request body did not arrive in time",
                                                 "type": "invalid_request_error", "param": None, "code": None}}
        assert 0.9 <= waited < 20, waited
        with httpx.Client(base_url=srv.url, timeout=30) as http:
            r = http.post("/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 1})
        assert r.status_code == 200, r.text


def test_content_length_with_transfer_encoding_is_refused_and_closed(server, http, model):
    """RFC 9112 6.3: a server must close a connection after a request that carries both: a
    request sent after the answer on the same connection is never answered."""
    import socket

    body = json.dumps({"model": model, "prompt": "hi", "max_tokens": 1}).encode()
    chunked = b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\nTransfer-Encoding: chunked\r\n\r\n" % len(chunked))
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as s:
        s.sendall(head + chunked)
        got = b""
        while b"\r\n\r\n" not in got or not got.endswith(b"}"):
            chunk = s.recv(65536)
            assert chunk, got
            got += chunk
        assert got.startswith(b"HTTP/1.1 400"), got[:200]
        assert b"both Content-Length and Transfer-Encoding" in got and b"connection: close" in got.lower(), got
        try:  # (not pipelined with the first: a close with unread bytes is a reset, losing the answer)
            s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            after = s.recv(65536)
        except (ConnectionResetError, BrokenPipeError):
            after = b""
    assert after == b"", after
    assert http.get("/healthz", timeout=10).text == "ok"


def _read_until_closed(s) -> bytes:
    got = b""
    while True:
        try:
            chunk = s.recv(65536)
        except ConnectionResetError:
            return got + b"<reset>"
        if not chunk:
            return got
        got += chunk


def test_a_refusal_is_written_whole_when_more_bytes_follow_its_request(server, model):
    """A 415 closes its connection (the body is left unread), and h11 then expects nothing more
    from the client. Bytes already sent behind the request (a pipelined request, or junk) met
    hypercorn's reader while the 415 was being written, and it closed the connection between
    the head and the body: about half the answers were lost (connections.MendedConnection)."""
    import socket

    body = json.dumps({"model": model, "prompt": "hi", "max_tokens": 1}).encode()
    req = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
           b"Content-Encoding: gzip\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    tails = (b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n", b"y" * 5000)
    for i in range(20):
        with socket.create_connection(("127.0.0.1", server.port), timeout=30) as s:
            s.sendall(req + tails[i % 2])
            got = _read_until_closed(s)
        head, _, rest = got.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 415"), (i, got[:200])
        assert json.loads(rest)["error"]["message"] == \
            "Content-Encoding gzip is not supported; send the body uncompressed", (i, got)


def test_a_close_request_with_bytes_behind_it_gets_its_answer(server, model):
    """A client that says Connection: close may send nothing more; bytes it sends anyway are
    dropped, and its request is answered (hypercorn answered them with a bare 400 and closed)."""
    import socket

    body = json.dumps({"model": model, "prompt": "Hello", "max_tokens": 3, "ignore_eos": True}).encode()
    req = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
           b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    for tail in (b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n", b"y" * 5000):
        with socket.create_connection(("127.0.0.1", server.port), timeout=60) as s:
            s.sendall(req + tail)
            got = _read_until_closed(s)
        head, _, rest = got.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200"), got[:300]
        assert json.loads(rest)["usage"]["completion_tokens"] == 3
        assert got.count(b"HTTP/1.1") == 1  # the bytes behind it were not taken for a request


def test_chunked_body_over_4_mib_is_413(http, model):
    """Without a Content-Length the limit is found while reading."""
    def chunks():
        yield b'{"model": "%s", "prompt": "hi", "pad": "' % model.encode()
        for _ in range(5):
            yield b"x" * 2**20
        yield b'"}'

    r = http.post("/v1/completions", content=chunks(), headers={"Content-Type": "application/json"})
    assert "content-length" not in r.request.headers
    assert_error(r, 413, None, "the request body is over 4 MiB")
    assert http.get("/healthz", timeout=10).text == "ok"


def test_body_just_under_4_mib_is_read(http, model):
    body = {"model": model, "prompt": "hi", "max_tokens": 0}
    raw = json.dumps(body).encode()
    body["pad"] = "x" * (4 * 2**20 - len(raw) - 20)
    raw = json.dumps(body).encode()
    assert len(raw) <= 4 * 2**20
    # Read whole and validated: the refusal is max_tokens', not the body size's.
    assert_error(post_raw(http, "/v1/completions", raw), 400, "max_tokens")


def test_browser_origins_loopback_pages_yes_others_no(http, model):
    """routes/origins.py, as Ollama does it: a page from this machine may call the API (its
    preflight answered, its responses naming it), any other page is a 403 before the route
    runs, a text/plain "simple" POST included; clients that send no Origin are untouched."""
    body = {"model": model, "prompt": "hi", "max_tokens": 1}
    local = "http://localhost:3000"
    pre = http.options("/v1/chat/completions", headers={"Origin": local, "Access-Control-Request-Method": "POST",
                                                        "Access-Control-Request-Headers": "authorization, content-type"})
    assert pre.status_code == 204 and pre.headers["access-control-allow-origin"] == local
    assert "POST" in pre.headers["access-control-allow-methods"]
    assert pre.headers["access-control-allow-headers"] == "authorization, content-type"
    ok = http.post("/v1/completions", json=body, headers={"Origin": "http://127.0.0.1:8080"})
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "http://127.0.0.1:8080"
    for foreign in ("https://evil.example", "null", "http://localhost.evil.example"):
        r = http.post("/v1/completions", content=json.dumps(body), headers={"Origin": foreign, "Content-Type": "text/plain"})
        err = assert_error(r, 403, None)
        assert "not allowed" in err["message"] and "access-control-allow-origin" not in r.headers
    assert "access-control-allow-origin" not in http.post("/v1/completions", json=body).headers


def test_allowed_origins_flag():
    from caldrix import cli
    from caldrix.routes import origins

    args = cli.build_parser().parse_args(["serve", "--allowed-origins", "https://app.example.com/, http://x:1"])
    assert args.allowed_origins == ("https://app.example.com", "http://x:1")
    assert origins.allowed("https://app.example.com", args.allowed_origins)
    assert not origins.allowed("https://other.example.com", args.allowed_origins)
    assert origins.allowed("https://anything.example", ("*",)) and origins.allowed("https://[::1]:9", ())
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["serve", "--allowed-origins", "example.com"])


def test_unknown_route_is_404_and_wrong_method_405(http):
    assert_error(http.get("/v1/nope"), 404, None)
    assert_error(http.post("/v1/embeddings", json={}), 404, None)
    assert_error(http.post("/v1//completions", json={}), 404, None)  # not an HTML redirect
    assert_error(http.get("/v1/models/"), 404, None)
    wrong = http.get("/v1/completions")
    err = assert_error(wrong, 405, None)
    assert "method" in err["message"]
    assert "POST" in wrong.headers["allow"]  # RFC 9110: a 405 names the methods the route takes


# ---------------------------------------------------------------------------------------------
# Generation behaviour


def test_stop_string_across_a_token_boundary(http, model, greedy, tokenizer):
    ids = greedy["choices"][0]["token_ids"]
    reply = greedy["choices"][0]["text"]
    pieces = [tokenizer.decode(ids[:i], clean_up_tokenization_spaces=False) for i in range(len(ids) + 1)]
    stop = cut = None
    # A stop string of the last two characters of one token's text and the first two of the
    # next's, whose first occurrence in the reply is that one.
    for i in range(2, len(ids) - 1):
        left, right = pieces[i], pieces[i + 1]
        if len(left) - len(pieces[i - 1]) < 2 or len(right) - len(left) < 2:
            continue
        candidate = left[-2:] + right[len(left):len(left) + 2]
        if candidate.strip() and reply.find(candidate) == len(left) - 2:
            stop, cut = candidate, len(left) - 2
            break
    assert stop is not None, f"no two-token stop string found in {reply!r}"
    want = reply[:cut]
    body = {"model": model, "prompt": PROMPT, "max_tokens": 16, "stop": ["@@never@@", stop]}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert (choice["text"], choice["finish_reason"]) == (want, "stop"), stop
    events = stream_post(http, "/v1/completions", {**body, "stream": True})
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert "".join(chunk_text(c) for c in chunks) == want
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert all(stop not in chunk_text(c) for c in chunks)


def test_return_token_ids_on_choices_and_chunks(http, model, greedy):
    want = greedy["choices"][0]["token_ids"]
    body = {"model": model, "prompt": PROMPT, "max_tokens": 16, "return_token_ids": True, "stream": True}
    events = stream_post(http, "/v1/completions", body)
    chunks = events[:-1]
    assert all("token_ids" in c["choices"][0] for c in chunks)
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == want
    # Without the flag, no token_ids anywhere.
    body.update(return_token_ids=False, max_tokens=3)
    chunks = stream_post(http, "/v1/completions", body)[:-1]
    assert all("token_ids" not in c["choices"][0] for c in chunks)
    r = http.post("/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": 2})
    assert "token_ids" not in r.json()["choices"][0]


def test_chat_return_token_ids_and_ignore_eos(http, model, tokenizer):
    messages = [{"role": "user", "content": QUESTION}]
    plain = http.post("/v1/chat/completions", json={
        "model": model, "messages": messages, "max_tokens": 12, "return_token_ids": True}).json()
    choice = plain["choices"][0]
    assert choice["finish_reason"] == "stop"  # the model ends its reply before 12 tokens
    n = plain["usage"]["completion_tokens"]
    # The end-of-sequence token ends the reply; it is neither counted nor returned.
    assert n < 12 and len(choice["token_ids"]) == n
    assert tokenizer.eos_token_id not in choice["token_ids"]
    assert choice["message"]["content"] == tokenizer.decode(choice["token_ids"], skip_special_tokens=True)
    # ignore_eos: the eos is an ordinary token and generation runs on to max_tokens.
    cap = n + 2
    r = http.post("/v1/chat/completions", json={
        "model": model, "messages": messages, "max_tokens": cap, "return_token_ids": True,
        "ignore_eos": True}).json()
    assert r["choices"][0]["finish_reason"] == "length"
    assert r["usage"]["completion_tokens"] == cap
    assert len(r["choices"][0]["token_ids"]) == cap
    assert r["choices"][0]["token_ids"][:n] == choice["token_ids"]
    assert r["choices"][0]["token_ids"][n] == tokenizer.eos_token_id  # now an ordinary token
    assert r["choices"][0]["message"]["content"].startswith(choice["message"]["content"])


def test_multibyte_characters_in_streams(http, model, tokenizer):
    """Japanese from this model comes as byte tokens that split characters. A stream holds a
    split character back until its last byte arrives, so no chunk carries U+FFFD, and the
    chunks joined are the decode of the whole reply."""
    messages = [{"role": "user", "content": "How do you say 'thank you' in Japanese?"}]
    body = {"model": model, "messages": messages, "max_tokens": 12, "return_token_ids": True,
            "ignore_eos": True}
    probe = http.post("/v1/chat/completions", json=body).json()["choices"][0]
    ids = probe["token_ids"]
    # Cut mid-character by max_tokens, the unfinished bytes come out as U+FFFD at the end.
    assert probe["message"]["content"] == tokenizer.decode(ids, skip_special_tokens=True)
    # The longest prefix of the reply that ends on a whole character.
    n = next((k for k in range(len(ids), 0, -1)
              if not tokenizer.decode(ids[:k], skip_special_tokens=True).endswith("\ufffd")), 0)
    text = tokenizer.decode(ids[:n], skip_special_tokens=True)
    if not any(ord(ch) > 127 for ch in text):
        pytest.skip(f"the model did not answer with non-ASCII text: {text!r}")
    assert "\ufffd" not in text
    chunks = stream_post(http, "/v1/chat/completions", {**body, "max_tokens": n, "stream": True})[:-1]
    deltas = [chunk_text(c) for c in chunks]
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas), deltas
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == ids[:n]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    # Where a character's bytes spanned tokens, its chunk carries more than one token id.
    if any("\ufffd" in tokenizer.decode([t]) for t in ids[:n]):
        assert any(len(c["choices"][0]["token_ids"]) > 1 for c in chunks)


# ---------------------------------------------------------------------------------------------
# The server survives bad requests


def test_bad_requests_never_take_the_server_down(http, model, server):
    bads = [
        (b'{"model": ', "/v1/completions"),
        (b"\x00\x01\x02", "/v1/chat/completions"),
        (json.dumps({"model": model, "prompt": [10**30]}).encode(), "/v1/completions"),
        (json.dumps({"model": model, "prompt": "x", "seed": 10**40}).encode(), "/v1/completions"),
        (b'{"model": "%s", "prompt": "x", "temperature": 1e400}' % model.encode(), "/v1/completions"),
        (b'{"model": "%s", "prompt": "\\ud800"}' % model.encode(), "/v1/completions"),
        (b"[" * 100_000, "/v1/completions"),
        (json.dumps({"model": model, "messages": [{"role": "user", "content": [None]}]}).encode(),
         "/v1/chat/completions"),
    ]
    for raw, path in bads:
        r = post_raw(http, path, raw)
        assert 400 <= r.status_code < 500, (raw[:60], r.status_code, r.text)
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert server.alive
    r = http.post("/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": 2})
    assert r.status_code == 200 and r.json()["choices"][0]["text"]
    assert "Traceback" not in server.stderr, server.stderr


# ---------------------------------------------------------------------------------------------
# The tight server: queue full, disconnect, SIGTERM (last: it stops the server)


def long_stream_body(model: str, max_tokens: int = 4000) -> dict:
    return {"model": model, "prompt": "Once upon a time", "max_tokens": max_tokens,
            "ignore_eos": True, "stream": True}


def test_tight_models_list_gives_the_served_name(tight):
    client = openai.OpenAI(base_url=tight.url + "/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list().data] == ["tight"]
    client.close()


def test_queue_full_is_429(tight):
    with httpx.Client(base_url=tight.url, timeout=TIMEOUT) as a_client, \
            httpx.Client(base_url=tight.url, timeout=TIMEOUT) as b_client, \
            httpx.Client(base_url=tight.url, timeout=TIMEOUT) as c_client:
        with a_client.stream("POST", "/v1/completions", json=long_stream_body("tight")) as a:
            assert a.status_code == 200
            # Keep the iterator: dropping a half-read httpx line iterator closes the connection,
            # which would abort `a` and let `b` take the slot.
            a_events = iter_events(a.iter_lines())
            next(a_events)  # running: it holds the only slot
            with b_client.stream("POST", "/v1/completions", json=long_stream_body("tight")) as b:
                assert b.status_code == 200  # queued: the one place in the queue
                c = c_client.post("/v1/completions", json={"model": "tight", "prompt": "hi", "max_tokens": 1})
                assert_error(c, 429, None, "the request queue is full")
                chat = c_client.post("/v1/chat/completions", json={
                    "model": "tight", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
                assert_error(chat, 429, None, "the request queue is full")
                oai_client = openai.OpenAI(base_url=tight.url + "/v1", api_key="unused", max_retries=0, timeout=60)
                with pytest.raises(openai.RateLimitError) as exc_info:
                    oai_client.completions.create(model="tight", prompt="hi", max_tokens=1)
                assert exc_info.value.status_code == 429
                oai_client.close()
    # Both streams closed. The scheduler notices within a step or so; until then the queue
    # may still be full. Once it has, the queued stream must be gone as well: had it taken the
    # slot, it would run 4000 tokens and this request would wait far past its 60 s.
    deadline = time.monotonic() + 30
    with httpx.Client(base_url=tight.url, timeout=httpx.Timeout(60.0)) as client:
        while True:
            r = client.post("/v1/completions", json={"model": "tight", "prompt": "hi", "max_tokens": 2})
            if r.status_code != 429 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert r.status_code == 200, r.text


def test_a_client_that_leaves_the_queue_gives_its_place_back(tight):
    """docs/http.md: a client that gives up on a queued request frees its place in the queue
    within a step. The only slot stays busy throughout (a 4000-token stream), so the place can
    only come back from the queued request itself: a streamed one closed, then a non-streamed
    one whose client times out. Counted by the channel's fill, each left a ghost that made
    every newcomer a 429 until the running stream ended, minutes later."""

    def queued_gets_a_place(client) -> None:
        deadline = time.monotonic() + 10
        while True:
            with client.stream("POST", "/v1/completions", json=long_stream_body("tight")) as c:
                if c.status_code == 200:
                    return  # queued behind the running stream; leaving closes it again
                assert c.status_code == 429
            assert time.monotonic() < deadline, "the place was not given back"
            time.sleep(0.2)

    with httpx.Client(base_url=tight.url, timeout=TIMEOUT) as a_client, \
            httpx.Client(base_url=tight.url, timeout=TIMEOUT) as b_client:
        with a_client.stream("POST", "/v1/completions", json=long_stream_body("tight")) as a:
            a_events = iter_events(a.iter_lines())
            next(a_events)  # running: it holds the only slot
            with b_client.stream("POST", "/v1/completions", json=long_stream_body("tight")) as b:
                assert b.status_code == 200  # queued
            queued_gets_a_place(b_client)
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(tight.url + "/v1/completions", json={"model": "tight", "prompt": "hi", "max_tokens": 1},
                           timeout=httpx.Timeout(1.0, connect=10.0))
            queued_gets_a_place(b_client)


def test_disconnect_frees_the_slot(tight):
    """With one slot, a new request can only run once the abandoned stream's slot is freed.
    The abandoned stream asks for 4000 tokens, minutes of work on two cores, so a short
    request that completes within 60 s proves it was cut off."""
    with httpx.Client(base_url=tight.url, timeout=TIMEOUT) as client:
        with client.stream("POST", "/v1/completions", json=long_stream_body("tight")) as r:
            assert r.status_code == 200
            stream = iter_events(r.iter_lines())
            assert [chunk_text(next(stream)) for _ in range(2)]
        # Leaving the blocks closes the response and the client's connection mid-stream.
    with httpx.Client(base_url=tight.url, timeout=httpx.Timeout(60.0)) as client:
        r = client.post("/v1/completions", json={"model": "tight", "prompt": PROMPT, "max_tokens": 4})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 4


def test_sigterm_with_a_running_stream_exits_0(tight):
    with httpx.Client(base_url=tight.url, timeout=TIMEOUT) as client:
        with client.stream("POST", "/v1/completions", json=long_stream_body("tight", max_tokens=8)) as r:
            assert r.status_code == 200
            stream = iter_events(r.iter_lines())
            events = [next(stream)]
            tight.terminate()
            try:
                events += list(stream)
            except httpx.RemoteProtocolError:  # a clean end may also be the server closing
                pass
    status = tight.wait(60)
    assert status == 0, f"exit status {status}:\n{tight.stderr}"
    assert "SIGTERM received" in tight.stderr
    # Here the stream finished: 8 tokens are well inside the graceful timeout.
    assert events[-1] == "[DONE]", events[-3:]
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    assert "".join(chunk_text(e) for e in events[:-1])


def test_sigterm_cuts_a_long_stream_cleanly_before_the_deadline(smollm2_dir: Path):
    """A stream that cannot finish inside the grace period ends with an error event and
    [DONE], not a cut connection, and the process still exits 0."""
    srv = ServerProcess.start(smollm2_dir, "--dtype", "float32", "--graceful-timeout", "3", "--served-name", "grace")
    try:
        with httpx.Client(base_url=srv.url, timeout=TIMEOUT) as client:
            with client.stream("POST", "/v1/completions", json=long_stream_body("grace", max_tokens=4000)) as r:
                assert r.status_code == 200
                stream = iter_events(r.iter_lines())
                events = [next(stream)]
                srv.terminate()
                events += list(stream)
        status = srv.wait(60)
    finally:
        srv.stop()
    assert status == 0, srv.stderr
    assert events[-1] == "[DONE]"
    err = events[-2]["error"]
    assert err["message"] == "the server is shutting down" and err["type"] == "service_unavailable_error"


def test_a_greedy_reply_does_not_depend_on_the_request_before_it(smollm2_dir: Path):
    """One slot (--max-batch 1): a chat that shares only the chat template's head with the one
    before it left held rows for part of its prompt. Reused as they were, the rest of the prompt
    ran as a short chunk, whose matmuls are not the fresh run's, and the reply took another
    turn; reused in whole chunks it is the reply the request gets after anything else."""
    story = {"messages": [{"role": "user", "content": "Write a short story about a lighthouse keeper."}],
             "max_tokens": 48, "ignore_eos": True, "return_token_ids": True}
    with ServerProcess.start(smollm2_dir, "--context", "2048") as srv:
        name = httpx.get(srv.url + "/v1/models").json()["data"][0]["id"]

        def post(path: str, body: dict) -> dict:
            r = httpx.post(srv.url + path, json={"model": name, **body}, timeout=120)
            assert r.status_code == 200, r.text
            return r.json()

        replies = []
        for before in (("/v1/completions", {"prompt": "Count: 1 2 3", "max_tokens": 2}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5}),
                       ("/v1/chat/completions", story),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Name a color."}],
                                                 "max_tokens": 3})):
            post(*before)
            replies.append(post("/v1/chat/completions", story)["choices"][0]["token_ids"])
    assert all(r == replies[0] for r in replies), [r[:12] for r in replies]


def test_a_prompt_shorter_than_a_held_one_gets_its_fresh_reply(smollm2_dir: Path):
    """The slot holds a 1300-token prompt P; P[:1100] shares all its rows but those rows past
    1024 were computed in P's 276-row chunk, where a fresh run of P[:1100] computes a 76-row
    one. Reused as they were (1099 rows), the reply took another turn at its 3rd token (the
    cross-feature audit); reused down to the whole chunk (1024), it is the fresh reply."""
    rng = random.Random(5)
    words = ("apple river stone quiet market seven blue engine harvest lantern copper garden whisper orbit canvas "
             "thunder meadow pencil silver marble ocean violet forest candle mirror ladder rocket island").split()
    with ServerProcess.start(smollm2_dir, "--context", "2048") as srv:
        name = httpx.get(srv.url + "/v1/models").json()["data"][0]["id"]
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(smollm2_dir)
        p = tok(" ".join(rng.choice(words) for _ in range(1400)) + ".", add_special_tokens=False)["input_ids"][:1300]

        def reply(prompt: list[int]) -> tuple[list[int], int]:
            r = httpx.post(srv.url + "/v1/completions", timeout=300, json={
                "model": name, "prompt": prompt, "max_tokens": 24, "ignore_eos": True, "return_token_ids": True})
            assert r.status_code == 200, r.text
            rid = r.json()["id"]
            rec = next(x for x in httpx.get(srv.url + "/debug/requests").json()["data"] if x["id"] == rid)
            return r.json()["choices"][0]["token_ids"], rec["prefix_rows"]

        first, reused = reply(p[:1100])
        assert reused == 0
        reply(p)
        again, reused = reply(p[:1100])
    assert reused == 1024
    assert again == first


def test_http2_is_not_spoken_so_its_hostile_clients_get_nowhere(server, http):
    """hypercorn switches to HTTP/2 on its preface or an `Upgrade: h2c`, and its HTTP/2 side let
    a client that never opened its flow-control window hold a connection (and a stop) forever,
    and one refused stream end its neighbours (the connection audit). caldrix serves HTTP/1.1
    alone, as llama-server and vLLM do: the preface is an HTTP/1.1 request for `*` (a 404),
    whose binary rest ends the connection; an h2c upgrade is answered in HTTP/1.1."""
    import socket

    def exchange(data: bytes) -> bytes:
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
            s.sendall(data)
            s.shutdown(socket.SHUT_WR)
            out = b""
            while chunk := s.recv(65536):
                out += chunk
            return out

    got = exchange(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00")
    assert got.startswith(b"HTTP/1.1 404 ") and b'"no such route"' in got
    got = exchange(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\n"
                   b"HTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA\r\n\r\n")
    assert got.startswith(b"HTTP/1.1 200 ") and got.endswith(b"ok")
    assert http.get("/healthz").text == "ok"


def test_the_accept_loops_log_at_the_fd_limit_is_one_line_a_minute():
    """At the open-file limit trio's accept loop logs a traceback every 0.1 s (1.2 MB a minute
    while a client holds the server there)."""
    import logging

    from caldrix.connections import _OncePerMinute

    f = _OncePerMinute()
    try:
        raise OSError(24, "Too many open files")
    except OSError:
        import sys

        exc = sys.exc_info()
    records = [logging.LogRecord("trio.serve_listeners", logging.ERROR, __file__, 1, "accept returned %s", ("EMFILE",), exc)
               for _ in range(600)]
    passed = [r for r in records if f.filter(r)]
    assert len(passed) == 1 and passed[0].exc_info is None
    assert passed[0].getMessage() == "accept returned EMFILE (repeats are not logged for a minute)"
