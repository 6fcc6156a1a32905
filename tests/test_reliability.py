"""Reliability through a real server on loopback (issue 30; figures in docs/reliability.md).

One server of a tiny random llama with SmolLM2's tokenizer (--max-batch 4, --queue-depth 64, --context 256) takes, in order:
schemathesis in both modes, load with disconnects, slow and hostile clients, a marker hunt
through logs and telemetry, and last SIGTERM under load. Each test leaves it serving correctly,
which the next one checks. Sizes scale with CALDRIX_LOAD_REQUESTS (default 150; the full run is
1000) and CALDRIX_SCHEMATHESIS_EXAMPLES (default 10 per operation).
"""

from __future__ import annotations

import json
import os
import random
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from reliability_util import (
    dribble, dribble_body, metric, plan, raw_request, record, reference, rss_bytes, run_load, status_of, tiny_smol,
    wait_idle,
)
from server_harness import ServerProcess

TIMEOUT = httpx.Timeout(120.0)
REQUESTS = int(os.environ.get("CALDRIX_LOAD_REQUESTS", "150"))
EXAMPLES = int(os.environ.get("CALDRIX_SCHEMATHESIS_EXAMPLES", "10"))
CI_SEED = 20261207  # the schemathesis seed under CALDRIX_CI
TOOL_BUG = "AST constructor recursion depth mismatch"
CLIENTS = 32
PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):", "The three primary colours are",
           "In 1969, the first", "Water boils at", "My favourite book is", "import numpy as np\n"]
CAPS = [4, 8, 12]
MARKER = "ZQXJ-marker-5521"


@pytest.fixture(scope="module")
def model_dir(smollm2_dir: Path, tmp_path_factory) -> Path:
    return tiny_smol(tmp_path_factory.getbasetemp(), smollm2_dir)


@pytest.fixture(scope="module")
def server(model_dir: Path):
    srv = ServerProcess.start(model_dir, "--dtype", "float32", "--max-batch", "4", "--queue-depth", "64", "--context", "256",
                              "--graceful-timeout", "20")
    yield srv
    if srv.alive:
        assert srv.stop() == 0, srv.stderr


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=TIMEOUT) as client:
        yield client


@pytest.fixture(scope="module")
def refs(http, model_dir) -> dict:
    """Every (prompt, cap) the load uses, run alone before anything else touches the server."""
    return {(p, n): reference(http, model_dir.name, p, n) for p in PROMPTS for n in CAPS}


def _still_serving(http, model: str, refs: dict) -> None:
    for p in PROMPTS[:2]:
        assert reference(http, model, p, CAPS[-1]) == refs[(p, CAPS[-1])]
    assert http.get("/healthz").text == "ok"


# --- the document and schemathesis -----------------------------------------------------------------

def test_openapi_is_served_for_this_model(http, model_dir):
    doc = http.get("/openapi.json").json()
    assert doc["openapi"] == "3.1.0"
    body = doc["paths"]["/v1/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body["properties"]["model"]["enum"] == [model_dir.name]
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    assert body["properties"]["prompt"]["anyOf"][1]["items"]["maximum"] == vocab - 1
    # Real replies against the document's response schemas, streamed events included.
    model = model_dir.name
    chat = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    cases = [("/v1/completions", {"model": model, "prompt": "hi", "max_tokens": 4, "return_token_ids": True}),
             ("/v1/chat/completions", chat), ("/v1/completions", {"model": model, "prompt": 7})]
    for path, b in cases:
        for stream in (False, True):
            r = http.post(path, json={**b, "stream": stream, **({"stream_options": {"include_usage": True}} if stream else {})})
            resp = doc["paths"][path]["post"]["responses"][str(r.status_code)]
            media = r.headers["content-type"].split(";")[0]
            schema = resp["content"][media]["schema"]
            if media == "text/event-stream":
                event = schema["properties"]["data"]["anyOf"]
                datas = [ln[6:] for ln in r.text.splitlines() if ln.startswith("data: ")]
                assert datas[-1] == "[DONE]" and len(datas) > 2
                for d in datas[:-1]:
                    _valid(event[1]["contentSchema"], json.loads(d), doc)
            else:
                _valid(schema, r.json(), doc)
    _valid(doc["paths"]["/v1/models"]["get"]["responses"]["200"]["content"]["application/json"]["schema"],
           http.get("/v1/models").json(), doc)


def _valid(schema: dict, value, doc: dict) -> None:
    import jsonschema_rs

    full = {**schema, "components": doc["components"]}
    errors = [str(e) for e in jsonschema_rs.Draft202012Validator(full).iter_errors(value)]
    assert not errors, (errors, value)


def test_schemathesis_positive_and_negative(server, http, refs, model_dir, tmp_path):
    # a fixed seed in CI, as for the Hypothesis tests (tests/conftest.py); a fresh one elsewhere
    fixed = CI_SEED if os.environ.get("CALDRIX_CI") else random.randrange(1 << 31)
    seed = int(os.environ.get("CALDRIX_SCHEMATHESIS_SEED", fixed))
    print(f"schemathesis seed {seed} (rerun with CALDRIX_SCHEMATHESIS_SEED={seed})")
    st = Path(sys.executable).with_name("schemathesis")
    checks = ("not_a_server_error,status_code_conformance,content_type_conformance,"
              "response_schema_conformance,response_headers_conformance,negative_data_rejection")
    cmd = [str(st), "run", server.url + "/openapi.json", "--mode", "all", "--phases", "fuzzing",
           "--max-examples", str(EXAMPLES), "--seed", str(seed), "--checks", checks, "--workers", "2",
           "--request-timeout", "60", "--no-shrink", "--no-color", "--generation-database", "none",
           "--suppress-health-check", "all", "--report", "junit", "--report-junit-path", str(tmp_path / "junit.xml")]
    for attempt in range(2):
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)  # its files go there
        out = run.stdout + run.stderr
        # A CPython 3.11 bug inside hypothesis's repr of its own strategies (ast.parse deep in the
        # stack) sometimes ends a run with a "Runtime Error" that is no finding about the server:
        # run the same seed once more.
        if not (run.returncode and TOOL_BUG in out and "Failures:" not in out):
            break
    print(out[-4000:])
    assert run.returncode == 0, f"schemathesis failed (seed {seed}):\n{_failures(out)}"
    cases = _junit_cases(tmp_path / "junit.xml")
    print("schemathesis operations:", cases)
    # Every operation but /openapi.json itself (schemathesis leaves out the document it loaded).
    want = {f"{m.upper()} {p}" for p, ops in http.get("/openapi.json").json()["paths"].items() for m in ops}
    assert want - set(cases) == {"GET /openapi.json"}, cases
    assert set(cases.values()) == {"passed"}, cases
    record("schemathesis", {"seed": seed, "examples_per_operation": EXAMPLES, "summary": _summary(out),
                            "operations": sorted(cases)})
    statuses = _statuses(http.get("/metrics").text)
    record("schemathesis_statuses", statuses)  # the server's count of what it answered, by status
    assert not [s for s in statuses if s.startswith("5")], statuses
    assert server.stderr.count("request failed") == 0, server.stderr[-4000:]
    _still_serving(http, model_dir.name, refs)


def _statuses(metrics: str) -> dict[str, int]:
    counts: dict[str, int] = {}
    for labels, value in re.findall(r'^caldrix:http_requests_total\{([^}]*)\} (\S+)', metrics, re.M):
        status = re.search(r'status="(\d+)"', labels).group(1)
        counts[status] = counts.get(status, 0) + int(float(value))
    return dict(sorted(counts.items()))


def _junit_cases(path: Path) -> dict[str, str]:
    """Each operation schemathesis reported, with its outcome (passed, failure, error, skipped)."""
    import xml.etree.ElementTree as ET

    out = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome = next((c.tag for c in case if c.tag in ("failure", "error", "skipped")), "passed")
        out[case.get("name")] = outcome
    return out


def _failures(out: str) -> str:
    """The operations' headers and each failure's first lines, not hypothesis's whole traceback."""
    keep = [ln for ln in out.splitlines() if re.match(r"\s*(_{3,}|[A-Z]+ /|- |[0-9]+\. |Error|\w+Error|Seed|Test cases)", ln)]
    return "\n".join(keep[-80:]) + "\n...\n" + out[-3000:]


def _summary(out: str) -> str:
    lines = [ln.strip() for ln in out.splitlines() if re.search(r"\d+ (passed|failed|test cases|generated)", ln)]
    return " | ".join(lines[-4:])


# --- load with disconnects -------------------------------------------------------------------------

def test_load_with_disconnects(server, http, refs, model_dir):
    model = model_dir.name
    seed = int(os.environ.get("CALDRIX_LOAD_SEED", "30"))
    warm = run_load(server.url, plan(CLIENTS * 2, model, PROMPTS, CAPS, seed + 7), refs, CLIENTS, seed + 7)
    assert warm.wrong == [] and 500 not in warm.statuses
    wait_idle(http)
    before = rss_bytes(server.proc.pid)
    specs = plan(REQUESTS, model, PROMPTS, CAPS, seed)
    t0 = time.monotonic()
    tally = run_load(server.url, specs, refs, CLIENTS, seed)
    took = time.monotonic() - t0
    text = wait_idle(http)
    after = rss_bytes(server.proc.pid)
    growth = (after - before) / before
    record("load", {"requests": tally.sent, "cancelled": tally.cancelled, "completed": tally.completed,
                    "correct": tally.correct, "statuses": dict(tally.statuses), "seconds": round(took, 1),
                    "rss_before_mib": round(before / 2**20, 1), "rss_after_mib": round(after / 2**20, 1),
                    "rss_growth_pct": round(100 * growth, 2), "clients": CLIENTS})
    assert tally.sent == REQUESTS
    assert tally.wrong == [], tally.wrong[:3]
    assert tally.completed + tally.cancelled == tally.sent, tally
    assert tally.cancelled >= REQUESTS // 5, tally
    assert set(tally.statuses) == {200}, tally.statuses
    assert metric(text, "num_requests_running") == 0
    assert metric(text, "num_requests_waiting") == 0
    assert metric(text, "kv_cache_usage_perc") == 0
    assert metric(text, "num_kv_slots") == 4
    assert growth < 0.05, f"resident memory grew {100 * growth:.1f} % ({before} -> {after} bytes)"
    _still_serving(http, model, refs)


# --- slow and hostile clients --------------------------------------------------------------------

def test_byte_at_a_time_clients_hold_up_no_one(server, http, refs, model_dir):
    model = model_dir.name
    payload = json.dumps({"model": model, "prompt": PROMPTS[0], "max_tokens": CAPS[-1], "ignore_eos": True,
                          "return_token_ids": True}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n").encode()
    slow_head_sent, slow_body_sent = [0], [0]
    outs_head: list = []
    outs_body: list = []
    t_head = threading.Thread(target=dribble, args=(server.port, head + payload, 6.0, slow_head_sent, outs_head))
    # The body one: headers at once, then the body a byte at a time.
    t_body = threading.Thread(target=lambda: dribble_body(server.port, head, payload, 6.0, slow_body_sent, outs_body))
    t_head.start()
    t_body.start()
    time.sleep(0.5)
    t0 = time.monotonic()
    for p in PROMPTS[:3]:
        assert reference(http, model, p, CAPS[-1]) == refs[(p, CAPS[-1])]
    fast = time.monotonic() - t0
    still_dribbling = slow_head_sent[0] < len(head + payload) and slow_body_sent[0] < len(payload)
    t_head.join(60)
    t_body.join(60)
    assert still_dribbling, "the slow clients finished before the fast requests did: the test proves nothing"
    for out in (outs_head, outs_body):
        assert out and status_of(out[0]) == 200, out
    record("slow_clients", {"fast_requests_seconds": round(fast, 2), "dribble_seconds": 6.0})


def test_a_stream_nobody_reads_holds_up_no_one(server, http, refs, model_dir):
    model = model_dir.name
    payload = json.dumps({"model": model, "prompt": PROMPTS[1], "max_tokens": 200, "ignore_eos": True,
                          "stream": True, "return_token_ids": True}).encode()
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(("127.0.0.1", server.port))
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              + f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n".encode() + payload)
    try:
        time.sleep(1.0)
        for p in PROMPTS[:3]:  # the unread stream decodes on; these run beside it
            assert reference(http, model, p, CAPS[-1]) == refs[(p, CAPS[-1])]
        # Now read it, slowly, to the end: every event is still there.
        data = b""
        s.settimeout(60)
        while b"data: [DONE]" not in data:
            chunk = s.recv(512)
            if not chunk:
                break
            data += chunk
            time.sleep(0.002)
        ids = [t for m in re.finditer(rb'"token_ids":\[([0-9,]*)\]', data) for t in m.group(1).split(b",") if t]
        assert len(ids) == 200, len(ids)
    finally:
        s.close()
    wait_idle(http)


HOSTILE = {
    "deeply nested JSON": b'{"model": "m", "prompt": ' + b"[" * 200_000 + b"]" * 200_000 + b"}",
    "a huge integer": b'{"model": "m", "prompt": "x", "seed": ' + b"9" * 100_000 + b"}",
    "a huge exponent": b'{"model": "m", "prompt": "x", "temperature": 1e999999}',
    "invalid UTF-8": b'{"model": "m", "prompt": "\xff\xfe\xc3"}',
    "NaN": b'{"model": "m", "prompt": "x", "temperature": NaN}',
    "Infinity": b'{"model": "m", "prompt": "x", "top_p": -Infinity}',
    "a lone surrogate": b'{"model": "m", "prompt": "\\ud800"}',
}


@pytest.mark.parametrize("what", list(HOSTILE))
def test_hostile_bodies_are_clear_400s(http, model_dir, what):
    raw = HOSTILE[what].replace(b'"m"', json.dumps(model_dir.name).encode())
    t0 = time.monotonic()
    r = http.post("/v1/completions", content=raw, headers={"Content-Type": "application/json"})
    assert time.monotonic() - t0 < 10
    assert r.status_code == 400, (r.status_code, r.text[:300])
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"]
    record(f"hostile:{what}", r.status_code)


def test_a_ten_thousand_element_stop_list_is_a_400(http, model_dir):
    r = http.post("/v1/completions", json={"model": model_dir.name, "prompt": "x", "stop": ["a"] * 10_000})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop", r.text
    assert "at most 4" in r.json()["error"]["message"]
    record("hostile:a 10,000-element stop list", r.status_code)


def test_header_floods_are_4xx(server, http, refs, model_dir):
    many = "".join(f"X-Flood-{i}: {'v' * 20}\r\n" for i in range(5000))  # ~150 KiB of headers
    big = "X-Big: " + "v" * 200_000 + "\r\n"
    for name, flood in (("many headers", many), ("one huge header", big)):
        t0 = time.monotonic()
        resp = raw_request(server.port, f"GET /v1/models HTTP/1.1\r\nHost: x\r\n{flood}\r\n".encode())
        assert time.monotonic() - t0 < 10
        status = status_of(resp)
        assert 400 <= status < 500, resp[:300]
        record(f"hostile:header flood ({name})", status)
    _still_serving(http, model_dir.name, refs)


# --- exposure ------------------------------------------------------------------------------------

def test_no_prompt_or_reply_text_reaches_logs_or_telemetry(server, http, model_dir):
    model = model_dir.name
    prompt = f"{MARKER} Repeat after me: {MARKER} {MARKER}"
    bodies = [
        ("/v1/completions", {"model": model, "prompt": prompt, "max_tokens": 16, "stop": [MARKER[:8]],
                             "ignore_eos": True}),
        ("/v1/completions", {"model": model, "prompt": prompt, "max_tokens": 16, "stream": True, "user": MARKER,
                             "ignore_eos": True}),
        ("/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": 16}),
        ("/v1/completions", {"model": model, "prompt": prompt, "max_tokens": 16, "top_p": MARKER}),  # a 400
        ("/v1/completions", {"model": MARKER, "prompt": prompt}),  # a 400 naming the model
    ]
    replies = []
    for path, b in bodies:
        r = http.post(path, json=b)
        assert r.status_code in (200, 400), r.text
        replies.append(r.text)
    wait_idle(http)
    # The marker appears in some reply (the model repeats it), so a leak of reply text would show too.
    surfaces = {"log": server.stderr, "/debug/requests": http.get("/debug/requests").text,
                "/debug/trace": http.get("/debug/trace").text, "/metrics": http.get("/metrics").text}
    # And the replies' own text: every 200's generated text of 8 characters or more.
    said = [t for t in (_reply_text(r) for r in replies) if len(t.strip()) >= 8]
    assert said, "no reply text to look for"
    for name, text in surfaces.items():
        for piece in (MARKER, MARKER[:8], "Repeat after me", *said):
            assert piece not in text, f"{piece!r} found in {name}"
    assert "caldrix: warning" not in server.stderr  # the default bind is loopback: no exposure warning
    record("marker_hunt", {"requests": len(bodies), "surfaces": sorted(surfaces), "found": 0})


def _reply_text(raw: str) -> str:
    if raw.startswith("data: "):  # a stream: join its text pieces
        return "".join(json.loads(ln[6:])["choices"][0].get("text", "") for ln in raw.splitlines()
                       if ln.startswith("data: {") and '"choices":[{' in ln)
    obj = json.loads(raw)
    if "choices" not in obj:
        return ""
    choice = obj["choices"][0]
    return choice.get("text") or choice.get("message", {}).get("content", "")


# --- SIGTERM under load (last: it stops the server) ---------------------------------------------

def test_sigterm_under_load_finishes_cleanly(server, model_dir):
    model = model_dir.name
    results: list = []

    def client(i: int) -> None:
        b = {"model": model, "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": 40, "ignore_eos": True,
             "stream": i % 2 == 0}
        try:
            with httpx.Client(base_url=server.url, timeout=TIMEOUT) as c:
                if b["stream"]:
                    with c.stream("POST", "/v1/completions", json=b) as resp:
                        lines = [ln for ln in resp.iter_lines() if ln.startswith("data: ")]
                    ok = lines[-1] == "data: [DONE]" and not any('"error"' in ln for ln in lines[:-1])
                    results.append(("stream", resp.status_code, ok, lines[-2] if len(lines) > 1 else ""))
                else:
                    r = c.post("/v1/completions", json=b)
                    results.append(("whole", r.status_code, r.status_code == 200, r.text[:200]))
        except httpx.HTTPError as e:
            results.append(("error", None, False, repr(e)))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    time.sleep(1.5)
    server.terminate()
    time.sleep(0.5)
    try:  # nothing new is admitted once the signal is in
        late = httpx.post(server.url + "/v1/completions", json={"model": model, "prompt": "x", "max_tokens": 2},
                          timeout=10)
        late_status = late.status_code
    except httpx.HTTPError as e:
        late_status = type(e).__name__
    for t in threads:
        t.join(120)
    status = server.wait(60)
    record("sigterm", {"running": len(threads), "finished_cleanly": sum(r[2] for r in results),
                       "late_request": late_status, "exit_status": status})
    assert status == 0, server.stderr[-3000:]
    assert late_status != 200
    assert len(results) == 8 and all(r[2] for r in results), results
