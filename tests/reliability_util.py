"""Shared by the reliability tests: a load driver with disconnects, raw-socket clients, /metrics
and /proc readers, and the figures each test adds to docs/reliability.md's table.

The load driver runs on asyncio with httpx.AsyncClient (one connection pool, `clients` requests
in flight at once). Each request is one of:
- "whole": runs to the end, streamed or not; its tokens must equal the same request run alone;
- "queue": a non-streamed request dropped after a random 0-300 ms, mostly while it waits in the
  queue (32 clients against a few slots);
- "first": a streamed request dropped as soon as its response headers arrive, before its first
  token event is read;
- "mid": a streamed request dropped after a random number of its token events.
A dropped request that happened to finish before its drop is checked like a whole one.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import socket
import time
from collections import Counter
from pathlib import Path

import attrs
import httpx

KINDS_CANCELLED = ("queue", "first", "mid")


@attrs.define
class Tally:
    sent: int = 0
    cancelled: int = 0
    completed: int = 0
    correct: int = 0
    statuses: Counter = attrs.Factory(Counter)
    wrong: list = attrs.Factory(list)


def body(model: str, prompt: str, max_tokens: int, *, stream: bool, **extra) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
            "return_token_ids": True, "stream": stream, **extra}


def reference(http: httpx.Client, model: str, prompt: str, max_tokens: int) -> list[int]:
    """The request run alone, not streamed: its token ids."""
    r = http.post("/v1/completions", json=body(model, prompt, max_tokens, stream=False))
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


async def _read_stream(resp: httpx.Response, stop_after: int | None) -> tuple[list[int], bool]:
    """(token ids read, whether [DONE] came) reading SSE events; stop after `stop_after` events."""
    ids: list[int] = []
    events = 0
    async for line in resp.aiter_lines():
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            return ids, True
        obj = json.loads(line[6:])
        if "error" in obj:
            raise AssertionError(f"error event in a stream: {obj}")
        for choice in obj["choices"]:
            ids.extend(choice.get("token_ids", ()))
        events += 1
        if stop_after is not None and events >= stop_after:
            return ids, False
    return ids, False


async def _one(client: httpx.AsyncClient, spec: dict, refs: dict, tally: Tally, rng: random.Random) -> None:
    kind, key = spec["kind"], (spec["prompt"], spec["max_tokens"])
    payload = body(spec["model"], spec["prompt"], spec["max_tokens"], stream=spec["stream"])
    tally.sent += 1
    got: list[int] | None = None
    if kind == "queue":
        try:
            async with asyncio.timeout(rng.uniform(0.0, 0.3)):
                r = await client.post("/v1/completions", json=payload)
            tally.statuses[r.status_code] += 1
            if r.status_code == 200:
                got = r.json()["choices"][0]["token_ids"]
        except TimeoutError:
            tally.cancelled += 1
            return
    elif spec["stream"]:
        stop_after = None if kind == "whole" else (0 if kind == "first" else rng.randrange(1, spec["max_tokens"]))
        async with client.stream("POST", "/v1/completions", json=payload) as resp:
            tally.statuses[resp.status_code] += 1
            if resp.status_code != 200:
                await resp.aread()
                return
            if stop_after == 0:
                tally.cancelled += 1
                return  # leaving the block closes the connection before any event is read
            ids, done = await _read_stream(resp, stop_after)
            if not done:
                tally.cancelled += 1
                return
            got = ids
    else:
        r = await client.post("/v1/completions", json=payload)
        tally.statuses[r.status_code] += 1
        if r.status_code == 200:
            got = r.json()["choices"][0]["token_ids"]
    if got is None:
        return
    tally.completed += 1
    if got == refs[key]:
        tally.correct += 1
    else:
        tally.wrong.append((spec, got, refs[key]))


def plan(n: int, model: str, prompts: list[str], caps: list[int], seed: int, cancel_share: float = 1 / 3) -> list[dict]:
    rng = random.Random(seed)
    specs = []
    for i in range(n):
        cancelled = rng.random() < cancel_share
        kind = rng.choice(KINDS_CANCELLED) if cancelled else "whole"
        stream = kind in ("first", "mid") or (kind == "whole" and rng.random() < 0.5)
        specs.append({"kind": kind, "stream": stream, "model": model, "prompt": rng.choice(prompts),
                      "max_tokens": rng.choice(caps)})
    return specs


def run_load(url: str, specs: list[dict], refs: dict, clients: int, seed: int) -> Tally:
    """Send every spec, `clients` at a time, each request on a fresh connection (a dropped one
    closes its connection, as a client that vanishes does)."""
    tally = Tally()
    rng = random.Random(seed + 1)

    async def main() -> None:
        sem = asyncio.Semaphore(clients)
        limits = httpx.Limits(max_connections=clients, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(300.0), limits=limits) as client:
            async def guarded(spec):
                async with sem:
                    await _one(client, spec, refs, tally, rng)
            async with asyncio.TaskGroup() as tg:
                for spec in specs:
                    tg.create_task(guarded(spec))

    asyncio.run(main())
    return tally


# --- reading the server --------------------------------------------------------------------------

def metric(text: str, name: str) -> float:
    """The value of an unlabelled-but-for-model sample `caldrix:<name>` in Prometheus text."""
    m = re.search(rf"^caldrix:{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    assert m, f"no caldrix:{name} in /metrics"
    return float(m.group(1))


def wait_idle(http: httpx.Client, timeout: float = 30.0) -> str:
    """/metrics once nothing runs or waits and every slot is free (or the last scrape at timeout)."""
    deadline = time.monotonic() + timeout
    while True:
        text = http.get("/metrics").text
        idle = (metric(text, "num_requests_running") == 0 and metric(text, "num_requests_waiting") == 0
                and metric(text, "kv_cache_usage_perc") == 0)
        if idle or time.monotonic() > deadline:
            return text
        time.sleep(0.2)


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def dribble(port: int, data: bytes, seconds: float, sent: list, out: list) -> None:
    """Send `data` a byte at a time over `seconds`; put the reply's first bytes in out[0]."""
    with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
        for i in range(len(data)):
            s.sendall(data[i:i + 1])
            sent[0] = i + 1
            time.sleep(seconds / len(data))
        s.settimeout(60)
        out.append(s.recv(65536))


def dribble_body(port, head, payload, seconds, sent, out) -> None:
    """Send `head` at once and `payload` a byte at a time over `seconds`; the reply goes in out[0]."""
    with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
        s.sendall(head)
        for i in range(len(payload)):
            s.sendall(payload[i:i + 1])
            sent[0] = i + 1
            time.sleep(seconds / len(payload))
        data = b""
        while b"\r\n\r\n" not in data or not data.rstrip().endswith(b"}"):
            b = s.recv(65536)
            if not b:
                break
            data += b
        out.append(data)


def raw_request(port: int, data: bytes, *, timeout: float = 30.0) -> bytes:
    """Send raw bytes on a fresh connection; return everything the server sends until it closes
    or `timeout` passes."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(data)
        chunks = []
        try:
            while True:
                b = s.recv(65536)
                if not b:
                    break
                chunks.append(b)
                if b"\r\n\r\n" in b"".join(chunks) and _complete(b"".join(chunks)):
                    break
        except (socket.timeout, ConnectionResetError):
            pass
    return b"".join(chunks)


def _complete(resp: bytes) -> bool:
    head, _, rest = resp.partition(b"\r\n\r\n")
    m = re.search(rb"content-length: *(\d+)", head, re.I)
    return bool(m) and len(rest) >= int(m.group(1))


def status_of(resp: bytes) -> int:
    m = re.match(rb"HTTP/1\.[01] (\d{3})", resp)
    assert m, f"no HTTP status line in {resp[:200]!r}"
    return int(m.group(1))


# --- figures for docs/reliability.md -------------------------------------------------------------

def record(key: str, value) -> None:
    """Add a figure to $CALDRIX_RELIABILITY_OUT (a JSON object) and print it, so the docs table
    can be filled from the last run."""
    print(f"reliability: {key} = {value}")
    out = os.environ.get("CALDRIX_RELIABILITY_OUT")
    if not out:
        return
    path = Path(out)
    data = json.loads(path.read_text()) if path.exists() else {}
    data[key] = value
    path.write_text(json.dumps(data, indent=1, sort_keys=True))


# --- the model ---------------------------------------------------------------------------------

def tiny_smol(base: Path, smollm2_dir: Path) -> Path:
    """A tiny random llama (fixed seed, 2 layers of width 64, weights drawn wide enough that greedy replies vary token to token) with SmolLM2's tokenizer and chat
    template, so the server speaks real text but a step costs about a millisecond. Built once per
    test session under `base`."""
    import shutil

    path = base / "tiny-smol"
    if (path / "model.safetensors").exists():
        return path
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    src = json.loads((smollm2_dir / "config.json").read_text())
    torch.manual_seed(30)
    cfg = LlamaConfig(vocab_size=src["vocab_size"], hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
                      bos_token_id=src.get("bos_token_id"), eos_token_id=src.get("eos_token_id"),
                      tie_word_embeddings=True, rope_theta=10000.0, initializer_range=0.3)
    tmp = base / "tiny-smol.partial"
    LlamaForCausalLM(cfg).eval().save_pretrained(tmp)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        if (smollm2_dir / name).exists():
            shutil.copy(smollm2_dir / name, tmp / name)
    tmp.rename(path)
    return path
