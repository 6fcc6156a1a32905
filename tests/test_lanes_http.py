"""The default engine (the GGUF's 4-bit blocks) runs a long prompt's chunks in their own thread
while running streams keep decoding (caldrix/sched/loop.py, the two lanes). A reply
must not depend on that: through a real server, a stream that has a long prompt arrive in the
middle of it, and that long prompt itself, get exactly the replies each gets alone."""

from __future__ import annotations

import json
import random
import threading
import time
from pathlib import Path

import httpx
import pytest

from server_harness import ServerProcess

TIMEOUT = httpx.Timeout(120.0)


@pytest.fixture(scope="module")
def server(smollm2_dir: Path):
    # No --dtype: the served default, which is the engine that overlaps the lanes.
    srv = ServerProcess.start(smollm2_dir, "--max-batch", "2", "--context", "1024")
    yield srv
    assert srv.stop() == 0, srv.stderr


def test_a_long_prompt_arriving_mid_stream_changes_no_reply(server, smollm2_dir):
    def body(prompt: list[int], max_tokens: int, **extra) -> dict:
        return {"model": smollm2_dir.name, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, **extra}

    rng = random.Random(6)
    short = [rng.randrange(1000, 30000) for _ in range(20)]
    long = [rng.randrange(1000, 30000) for _ in range(600)]  # five 128-token chunks, or 512 + 87
    with httpx.Client(base_url=server.url, timeout=TIMEOUT) as http:
        short_alone = http.post("/v1/completions", json=body(short, 48)).json()["choices"][0]["text"]
        long_alone = http.post("/v1/completions", json=body(long, 8)).json()["choices"][0]["text"]

        long_reply: dict = {}

        def send_long():
            with httpx.Client(base_url=server.url, timeout=TIMEOUT) as other:
                long_reply.update(other.post("/v1/completions", json=body(long, 8)).json())

        sender = threading.Thread(target=send_long)
        pieces: list[str] = []
        with http.stream("POST", "/v1/completions", json=body(short, 48, stream=True)) as resp:
            assert resp.status_code == 200
            for line in resp.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                pieces.append(json.loads(line[6:])["choices"][0]["text"])
                if len(pieces) == 4:
                    sender.start()  # the long prompt arrives while this stream is decoding
        sender.join()

    assert "".join(pieces) == short_alone
    assert long_reply["choices"][0]["text"] == long_alone
    from caldrix.engine import cpu_has_native_bf16

    dtype = "bfloat16" if cpu_has_native_bf16() else "float32"  # float32: through caldrix::q4_mm_f32
    assert f"caldrix: dtype {dtype}, 120 projections kept as 4-bit GGUF blocks" in server.stderr
    # The lanes overlap where the engine's probe found a step's bits independent of the thread
    # count (always so for bfloat16); otherwise chunks take turns with decode steps, and the
    # start-up names the step that differed. The replies above must hold either way.
    # The default chunk is 512 where the lanes overlap (Engine.default_prefill_chunk; 128 where
    # only the probe's 512-row chunk differed), else 128: a 600-token prompt is two or five chunks.
    beside = any(f"prefill chunks of {chunk} beside decode steps, one core each" in server.stderr
                 for chunk in (512, 128))
    assert beside or "prefill chunks of 128 between decode steps (" in server.stderr, server.stderr
    assert beside or dtype == "float32"


def test_a_repeated_prompt_gets_its_reply_again_from_the_held_rows(server, smollm2_dir):
    # The second request finds the first one's rows still in a slot and computes only the
    # prompt's last token; that token runs alone in the decode form either way (sched/policy.py,
    # `_chunk`), so the reply is the same bits as the fresh one's.
    prompt = [random.Random(7).randrange(1000, 30000) for _ in range(300)]  # two chunks, the rest, the last token
    body = {"model": smollm2_dir.name, "prompt": prompt, "max_tokens": 32, "ignore_eos": True}
    with httpx.Client(base_url=server.url, timeout=TIMEOUT) as http:
        replies = [http.post("/v1/completions", json=body).json() for _ in range(2)]
        records = {}
        for _ in range(50):  # a record lands just after its reply
            records = {r["id"]: r for r in http.get("/debug/requests").json()["data"]}
            if all(rep["id"] in records for rep in replies):
                break
            time.sleep(0.1)
    first, second = (records[rep["id"]] for rep in replies)
    assert first["prefix_rows"] == 0 and second["prefix_rows"] == len(prompt) - 1
    assert replies[1]["choices"][0]["text"] == replies[0]["choices"][0]["text"]
    assert replies[0]["usage"]["completion_tokens"] == 32
