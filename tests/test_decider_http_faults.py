"""The decider reading's faults over HTTP, against real servers (tests/server_harness.py) of the
tiny random llama decider of tests/test_decider_http.py:

- a full request queue answers 429 for the whole decider request, worded as for completions;
- a label logit that is not finite answers 500 naming the question, and the server goes on;
- a client that leaves a many-question request midway: its probes stop, its kept state
  (Submission.lease) is dropped (the `caldrix:num_kept_states` gauge), and the next requests
  get exactly what the fresh server gave.

"Exactly what a fresh server gave" is measured on the same server before anything else ran
(`fresh`), and is itself checked against decider-ai's formulas on transformers' logits.
"""

from __future__ import annotations

import json
import shutil
import socket
import threading
import time

import httpx
import pytest

from server_harness import ServerProcess, hold_slot
from test_decider_http import (  # noqa: F401 - fixtures, used by name
    LLAMA_CONFIG,
    QUESTIONS,
    STATE,
    check_answers,
    llama_decider,
    no_rounding,
    post,
    reference,
)

pytest.importorskip("decider.systemone")

FLAGS = ("--dtype", "float32", "--max-batch", "1", "--context", "1024", "--prefill-chunk", "32")


def metric(srv, name: str, label: str = "") -> float:
    """The value of `caldrix:<name>`, of the sample whose labels hold `label` where given."""
    for line in httpx.get(srv.url + "/metrics").text.splitlines():
        if line.startswith(f"caldrix:{name}{{") and label in line.split("}")[0]:
            return float(line.split()[-1])
    raise AssertionError(f"no caldrix:{name} {label} in /metrics")


def wait_for(cond, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def records(srv) -> list[dict]:
    return httpx.get(srv.url + "/debug/requests").json()["data"]


def probes_of(srv, base: str) -> list[dict]:
    """The records of one /v1/systemone request's probes (ids base.0, base.1, ...), in order."""
    got = [r for r in records(srv) if r["id"].rsplit(".", 1)[0] == base]
    return sorted(got, key=lambda r: int(r["id"].rsplit(".", 1)[1]))


def last_base(srv) -> str:
    return [r for r in records(srv) if r["route"] == "/v1/systemone"][-1]["id"].rsplit(".", 1)[0]


def answers_match(got: dict, want: dict) -> None:
    """The same response within 1e-5 (model, usage exactly)."""
    assert got["usage"] == want["usage"] and got["model"] == want["model"]
    check_answers(got["answers"], {k: {kk: vv for kk, vv in v.items() if kk != "legend"}
                                   for k, v in want["answers"].items()})


@pytest.fixture(scope="module")
def server(llama_decider, no_rounding):
    """The llama decider served with one slot and one queue place; `fresh`: its first answers
    (the many-question request and one question alone), checked against the package."""
    path, model = llama_decider
    with ServerProcess.start(path, *FLAGS, "--queue-depth", "1") as srv:
        name = httpx.get(srv.url + "/v1/models").json()["data"][0]["id"]
        many = {"model": name, "state": STATE, "questions": QUESTIONS}
        one = {"model": name, "state": STATE, "questions": {"team": QUESTIONS["team"]}}
        fresh = []
        for body in (many, one):
            r = post(srv, body)
            assert r.status_code == 200, r.text
            want, once, _ = reference(model, path, body, LLAMA_CONFIG)
            assert check_answers(r.json()["answers"], want) > 0.02 and r.json()["usage"]["input_tokens"] == once
            fresh.append((body, r.json()))
        yield srv, fresh


def still_fresh(srv, fresh) -> None:
    """The server answers as it did when it was fresh, and keeps no state."""
    for body, want in fresh:
        r = post(srv, body)
        assert r.status_code == 200, r.text
        answers_match(r.json(), want)
    wait_for(lambda: metric(srv, "num_kept_states") == 0, "the kept states to be dropped", 5)
    assert srv.alive and httpx.get(srv.url + "/healthz").text == "ok"


# --- a full queue ------------------------------------------------------------------------------


def test_a_full_queue_is_a_429_for_the_whole_request(server):
    """The slot held by a streamed completion, the one queue place by a short one: the decider
    request is refused before any of its six prompts runs, in the words of a completion's 429."""
    srv, fresh = server
    name = fresh[0][1]["model"]
    rejected = metric(srv, "requests_rejected_total", 'reason="queue_full"')
    done = threading.Event()

    def short():
        body = {"model": name, "prompt": "Count: 1 2 3", "max_tokens": 2, "ignore_eos": True}
        httpx.post(srv.url + "/v1/completions", json=body, timeout=300)

    threads = [threading.Thread(target=hold_slot, args=(srv.url, name, done)), threading.Thread(target=short)]
    threads[0].start()
    try:
        wait_for(lambda: metric(srv, "num_requests_running") == 1, "the completion to hold the slot")
        threads[1].start()
        wait_for(lambda: metric(srv, "num_requests_waiting") == 1, "the short completion to queue")
        r = post(srv, fresh[0][0])
        completion = httpx.post(srv.url + "/v1/completions", json={"model": name, "prompt": "x", "max_tokens": 1})
        # still full (the completion holds the slot, so the short one still waits): both refusals
        # met a full queue
        assert metric(srv, "num_requests_running") == 1 and metric(srv, "num_requests_waiting") == 1
    finally:
        done.set()
        for t in threads:
            t.join()
    assert r.status_code == 429, r.text
    err = {"error": {"message": "the request queue is full", "type": "rate_limit_error", "param": None, "code": None}}
    assert r.json() == err
    assert completion.status_code == 429 and completion.json() == err  # worded as for other routes
    assert "answers" not in r.json()
    (rec,) = probes_of(srv, last_base(srv))  # refused at its first prompt: none ran, none after
    assert rec["status"] == 429 and rec["finish_reason"] is None and rec["prompt_tokens"] > 0
    assert metric(srv, "requests_rejected_total", 'reason="queue_full"') == rejected + 2
    wait_for(lambda: metric(srv, "num_requests_running") == 0, "the slot to be free")
    still_fresh(srv, fresh)


# --- a reading that is not finite --------------------------------------------------------------


@pytest.fixture(scope="module")
def nan_label_decider(llama_decider, tmp_path_factory):
    """The llama decider with an lm_head of its own, a copy of the tied embedding whose row for the
    label "C" is NaN: a reading of three options or more is not finite, one of "A" and "B" (a noul,
    a level asked alone) is the tied model's."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer

    from decider.prompt import letter_ids

    src, model = llama_decider
    path = tmp_path_factory.mktemp("decider-nan")
    shutil.copytree(src, path, dirs_exist_ok=True)
    tensors = load_file(path / "model.safetensors")
    head = tensors["model.embed_tokens.weight"].clone()
    head[letter_ids(AutoTokenizer.from_pretrained(str(path)))[2]] = float("nan")
    save_file({**tensors, "lm_head.weight": head}, path / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "tie_word_embeddings": False}))
    return path, model


def test_a_reading_that_is_not_finite_is_a_500(nan_label_decider, no_rounding):
    path, model = nan_label_decider
    with ServerProcess.start(path, *FLAGS) as srv:
        name = httpx.get(srv.url + "/v1/models").json()["data"][0]["id"]
        # "team" (options A, B, C) between two nouls: the first is read, the request ends at it
        order = ("angry", "team", "refund")
        r = post(srv, {"model": name, "state": STATE, "questions": {q: QUESTIONS[q] for q in order}})
        assert r.status_code == 500, r.text
        assert r.json() == {"error": {
            "message": 'the engine gave no usable reading for question "team": a probability is not a finite number',
            "type": "server_error", "param": None, "code": None}}
        recs = probes_of(srv, last_base(srv))
        assert [(x["status"], x["finish_reason"]) for x in recs] == [(500, "stop")] * 2  # both read; "refund" never ran
        assert metric(srv, "http_requests_total", 'status="500"') == 1
        wait_for(lambda: metric(srv, "num_kept_states") == 0, "the kept state to be dropped", 5)
        # The server goes on: the engine has not failed, and questions read on A and B are answered.
        assert srv.alive and httpx.get(srv.url + "/healthz").text == "ok"
        body = {"model": name, "state": STATE, "questions": {q: QUESTIONS[q] for q in ("urgency", "angry", "refund")}}
        r = post(srv, body)
        assert r.status_code == 200, r.text
        want, once, _ = reference(model, path, body, LLAMA_CONFIG)
        assert check_answers(r.json()["answers"], want) > 0.02
        assert r.json()["usage"] == {"input_tokens": once, "output_tokens": 0}
        assert "Traceback" not in srv.stderr


# --- a client that leaves midway --------------------------------------------------------------


def _many_levels(name: str) -> dict:
    """640 prompts (64 score questions, each level asked alone) over a state of its own, unlike
    the fresh request's: a leaked kept state could not pass for that one's."""
    return {"model": name, "state": {"note": "the printer on floor 3 is jammed again", "floor": 3},
            "questions": {f"s{i}": {"type": "score", "instructions": f"How bad is problem {i}?",
                                    "criteria": [f"{k}: level {k}" for k in range(10)]} for i in range(64)}}


def _send(srv, body: dict) -> socket.socket:
    """POST /v1/systemone on a socket of its own, left unread: closing it is the client leaving."""
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", srv.port))
    sock.sendall(b"POST /v1/systemone HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 + f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def _gone(srv, bases: set[str]) -> tuple[str, list[dict]]:
    """The records of the one /v1/systemone request not in `bases`, once they stop coming."""
    (base,) = {r["id"].rsplit(".", 1)[0] for r in records(srv) if r["route"] == "/v1/systemone"} - bases
    recs = probes_of(srv, base)
    time.sleep(1.0)  # nothing more of it runs: the route submits no prompt once its client is gone
    assert probes_of(srv, base) == recs
    assert [r["id"] for r in recs] == [f"{base}.{i}" for i in range(len(recs))]
    assert 3 <= len(recs) < 640 and {r["status"] for r in recs} == {499}
    # the client saw none of the answers: each prompt's record says abort, as a completion's would
    assert recs[0]["prefix_rows"] == 0 and all(r["finish_reason"] == "abort" for r in recs)
    length = recs[1]["prefix_rows"]  # the later prompts start from the kept state
    assert length > 0 and all(r["prefix_rows"] == length for r in recs[1:-1])
    return base, recs


def test_a_client_gone_midway_drops_the_kept_state(server):
    srv, fresh = server
    name = fresh[0][1]["model"]
    body = _many_levels(name)
    bases = {r["id"].rsplit(".", 1)[0] for r in records(srv) if r["route"] == "/v1/systemone"}

    # 1. gone while a later prompt runs (one slot, nothing else to run)
    done0 = metric(srv, "e2e_request_latency_seconds_count")
    sock = _send(srv, body)
    try:
        wait_for(lambda: metric(srv, "e2e_request_latency_seconds_count") >= done0 + 3, "three prompts read")
        assert metric(srv, "num_kept_states") == 1  # the gauge sees the lease while it lives
    finally:
        sock.close()
    wait_for(lambda: metric(srv, "num_kept_states") == 0, "the kept state to be dropped", 5)
    wait_for(lambda: metric(srv, "num_requests_running") == 0, "the slot to be free", 5)
    base, recs = _gone(srv, bases)
    bases.add(base)

    # 2. gone while a later prompt waits in the queue behind a completion that holds the slot
    done = threading.Event()

    holding = threading.Event()
    holder = threading.Thread(target=hold_slot, args=(srv.url, name, done), kwargs={"started": holding})
    done0 = metric(srv, "e2e_request_latency_seconds_count")
    sock = _send(srv, body)
    try:
        wait_for(lambda: metric(srv, "e2e_request_latency_seconds_count") >= done0 + 3, "three prompts read")
        holder.start()
        # the completion takes the slot when the running prompt ends; the next prompt queues
        # (the completion holds the slot once a token came: the one waiting is then a prompt,
        # not the completion queued behind a prompt that is running)
        wait_for(lambda: holding.is_set() and metric(srv, "num_requests_waiting") == 1
                 and metric(srv, "num_requests_running") == 1, "a prompt queued behind the completion")
        assert metric(srv, "num_kept_states") == 1
        sock.close()
        # dropped while the completion still runs, not when the queue drains
        wait_for(lambda: metric(srv, "num_kept_states") == 0, "the kept state to be dropped", 5)
        assert metric(srv, "num_requests_running") == 1, "the completion ended before the check"
    finally:
        sock.close()
        done.set()
        holder.join()
    wait_for(lambda: metric(srv, "num_requests_running") == 0, "the slot to be free", 5)
    base, recs = _gone(srv, bases)
    assert recs[-1]["finish_reason"] == "abort" and recs[-1]["timings"]["queued"] is None  # never admitted
    assert "Traceback" not in srv.stderr
    still_fresh(srv, fresh)
