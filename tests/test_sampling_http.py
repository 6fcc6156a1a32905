"""Sampling over HTTP: server defaults from flags, per-request overrides, composition, seeds and
the 400s of http-api.md "Sampling". One real server started with sampling defaults."""

from __future__ import annotations

import httpx
import pytest
import torch

from server_harness import ServerProcess

PROMPT = "one two three one two three one two three"


@pytest.fixture(scope="module")
def server(smollm2_dir):
    # defaults: sampled at temperature 1 with a penalty; no --seed, so each request draws one
    with ServerProcess.start(smollm2_dir, "--dtype", "float32", "--max-batch", "4",
                             "--temperature", "1.0", "--repetition-penalty", "1.3", "--context", "256") as srv:
        yield srv


def complete(srv, **fields) -> dict:
    body = {"model": smollm2_dir_name(srv), "prompt": PROMPT, "max_tokens": 16, "return_token_ids": True, **fields}
    r = httpx.post(srv.url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def smollm2_dir_name(srv) -> str:
    return httpx.get(srv.url + "/v1/models", timeout=10).json()["data"][0]["id"]


def tokens(resp: dict) -> list[int]:
    return resp["choices"][0]["token_ids"]


def test_temperature_zero_keeps_the_servers_penalty(server, smollm2_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(smollm2_dir))
    ref = AutoModelForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32).eval()
    ids = tok(PROMPT, return_tensors="pt").input_ids
    with torch.inference_mode():
        penalized = ref.generate(ids, max_new_tokens=16, do_sample=False, repetition_penalty=1.3)[0, ids.shape[1]:].tolist()
        plain = ref.generate(ids, max_new_tokens=16, do_sample=False)[0, ids.shape[1]:].tolist()
    assert penalized != plain
    eos = tok.eos_token_id
    penalized = penalized[: penalized.index(eos)] if eos in penalized else penalized
    assert tokens(complete(server, temperature=0)) == penalized
    # and a request can switch the penalty off for itself
    plain = plain[: plain.index(eos)] if eos in plain else plain
    assert tokens(complete(server, temperature=0, repetition_penalty=1)) == plain


def test_seed_reproduces_and_default_seed_is_fresh(server):
    a = complete(server, seed=1234)
    b = complete(server, seed=1234)
    assert tokens(a) == tokens(b)
    c = complete(server, seed=99)
    assert tokens(c) != tokens(a)
    # no seed anywhere: each request draws fresh entropy (near-certainly a different reply)
    replies = {tuple(tokens(complete(server))) for _ in range(3)}
    assert len(replies) > 1


def test_null_inherits_and_minus_one_draws(server):
    # null temperature inherits the server's 1.0 (sampled), so seeds matter
    x = complete(server, temperature=None, seed=5)
    y = complete(server, temperature=None, seed=6)
    assert tokens(x) != tokens(y)
    # -1 draws fresh entropy each time: two such requests (near-certainly) differ
    assert tokens(complete(server, seed=-1)) != tokens(complete(server, seed=-1))


@pytest.mark.parametrize("field, value, message", [
    ("temperature", -0.5, None),
    ("temperature", "hot", None),
    ("top_k", -2, None),
    ("top_k", 1.5, None),
    ("top_p", 2, "must be 0 < p <= 1, got 2"),
    ("top_p", 0, None),
    ("min_p", 1.5, None),
    ("repetition_penalty", 0, None),
    ("seed", -2, None),
    ("seed", "abc", None),
    ("temperature", True, None),
])
def test_bad_sampling_values_are_400s_naming_the_field(server, field, value, message):
    body = {"model": smollm2_dir_name(server), "prompt": "hi", "max_tokens": 1, field: value}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == field and err["type"] == "invalid_request_error" and err["code"] is None
    if message:
        assert err["message"] == message
    # the same on chat
    body = {"model": smollm2_dir_name(server), "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, field: value}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == field
