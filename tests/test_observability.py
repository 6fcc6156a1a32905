"""Observability: /metrics, /debug/requests, the replay ring's traces and `caldrix replay`.

The first tests are pure (telemetry records, block digests, metrics rendering, synthetic
prompts). The rest speak HTTP to one real `caldrix serve` process for the module (embedded
SmolLM2-135M, `--max-batch 2`), with short replies: decoding shares two cores with the tests.
"""

from __future__ import annotations

import collections
import json
import random
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from caldrix import replay
from caldrix.metrics import Metrics
from caldrix.protocol import FinishReason, SamplingParams, Submission
from caldrix.sched.sequence import Sequence
from caldrix.telemetry import BLOCK_TOKENS, Telemetry, block_digests, sharing_signature
from server_harness import ServerProcess

ROOT = Path(__file__).resolve().parent.parent
TRACES = sorted((ROOT / "traces").glob("*.jsonl"))
TIMEOUT = httpx.Timeout(120.0, connect=10.0)
RECORD_KEYS = {"id", "route", "status", "finish_reason", "arrived", "timings", "prompt_tokens", "completion_tokens",
               "max_tokens", "sampling", "prefix_rows", "batch_sizes", "stream",
               "speculative", "sampler", "ignore_eos"}
TRACE_KEYS = {"arrival", "id", "route", "status", "finish_reason", "prompt_tokens", "completion_tokens", "max_tokens",
              "sampling", "stream", "blocks", "prefix_rows", "timings"}


def samples(text: str) -> dict[tuple[str, tuple], float]:
    """Every sample of a /metrics body, keyed by (name, labels other than model_name)."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
            out[(s.name, labels)] = s.value
    return out


def val(m: dict, name: str, **labels) -> float:
    return m.get((name, tuple(sorted(labels.items()))), 0.0)


# ---------------------------------------------------------------------------------------------
# Pure: no server


def finished_seq(rid: str, prompt, *, output=(5, 6, 7), finish=FinishReason.LENGTH, prefix_rows=0,
                 sampling=SamplingParams(), t0=None) -> Sequence:
    tx, _rx = trio.open_memory_channel(len(output) + 1)
    sub = Submission(rid, tuple(prompt), len(output), sampling, frozenset(), tx)
    seq = Sequence(sub, prefix_rows=prefix_rows, finish=finish)
    t0 = sub.arrived if t0 is None else t0
    seq.t_admitted = t0 + 0.01
    seq.t_first_token = t0 + 0.05
    seq.t_tokens = [t0 + 0.05 + 0.02 * i for i in range(len(output))]
    seq.output = list(output)
    seq.batch_sizes = [1, 2, 2, 1][: len(output) + 1]
    return seq


def test_block_digests_identify_prefixes_not_tokens():
    salt = b"s" * 16
    a = tuple(range(100, 140))  # 40 tokens: blocks of 16, 16 and 8
    b = a[:20] + (7,) + a[21:]  # differs inside the second block
    da, db = block_digests(a, salt), block_digests(b, salt)
    assert len(da) == 3 and all(len(d) == 16 for d in da)
    assert da[0] == db[0] and da[1] != db[1] and da[2] != db[2]  # chained: the tail differs too
    assert block_digests(a[:16], salt) == da[:1]
    assert block_digests(a[:33], salt)[:2] == da[:2] and block_digests(a[:33], salt)[2] != da[2]
    assert block_digests(a, b"t" * 16) != da  # another server's salt: other digests
    assert BLOCK_TOKENS == 16


def test_records_join_the_scheduler_and_route_halves_in_either_order():
    tel = Telemetry.create("m", ring_size=3)
    seq = finished_seq("r1", range(10, 50), sampling=SamplingParams(temperature=0.5, seed=42))
    tel.on_finish(seq)
    assert not tel.records()  # waits for the route's half
    tel.route_done("r1", route="/v1/completions", status=200, finish=FinishReason.LENGTH, stream=False)
    # A stop string: the route answers first, the scheduler then sees an abandoned request.
    tel.route_done("r2", route="/v1/chat/completions", status=200, finish=FinishReason.STOP, stream=True)
    tel.on_finish(finished_seq("r2", range(10, 30), finish=FinishReason.ABORT, prefix_rows=16))
    r1, r2 = tel.records()
    assert (r1.id, r1.status, r1.finish_reason, r1.stream) == ("r1", 200, "length", False)
    assert (r2.id, r2.route, r2.finish_reason, r2.prefix_rows) == ("r2", "/v1/chat/completions", "stop", 16)
    assert r1.sampling.seed == 42 and r1.prompt_tokens == 40 and r1.completion_tokens == 3
    assert r1.queued == pytest.approx(0.01, abs=1e-6) and r1.first_token == pytest.approx(0.05, abs=1e-6)
    assert r1.batch_sizes == ((1, 2), (2, 2))
    assert set(r1.to_json()) == RECORD_KEYS and set(r1.trace_json(r1.arrived)) == TRACE_KEYS
    for i in range(5):  # bounded: the ring keeps the last --replay-ring
        tel.on_finish(finished_seq(f"x{i}", range(3)))
        tel.route_done(f"x{i}", route="/v1/completions", status=200, finish=None, stream=False)
    assert [r.id for r in tel.records()] == ["x2", "x3", "x4"] and [r.id for r in tel.records(last=1)] == ["x4"]
    assert tel.records()[0].finish_reason == "length"  # route finish None: the scheduler's


def test_the_scheduler_hook_sees_every_request_with_its_token_times():
    """Through the real Scheduler with a fake engine: a finished request, and one whose client
    left while it was queued, both reach on_finish; the first with a time for each token."""
    from caldrix.batch import RunOutput, StepOutput
    from caldrix.sched.loop import Scheduler
    from caldrix.sched.policy import Policy
    from caldrix.sched.slots import SlotTable

    class Engine:
        def step(self, batch):
            return StepOutput(tuple(RunOutput(tuple(9 for _ in r.pick_at)) for r in batch.runs))

    async def inline(fn, batch):
        await trio.lowlevel.checkpoint()
        return fn(batch)

    seen: list[Sequence] = []

    async def main():
        sched = Scheduler(Engine(), Policy(SlotTable(1)), run_step=inline, on_finish=seen.append)
        tx, rx = trio.open_memory_channel(4)
        a_tx, a_rx = trio.open_memory_channel(5)
        b_tx, b_rx = trio.open_memory_channel(5)
        a = Submission("a", (1, 2, 3), 4, SamplingParams(), frozenset(), a_tx)
        b = Submission("b", (4, 5), 4, SamplingParams(), frozenset(), b_tx)
        b_rx.close()  # b's client leaves before b gets the (only) slot
        async with trio.open_nursery() as nursery:
            await nursery.start(sched.run, rx)
            await tx.send(a)
            await tx.send(b)
            assert len([e async for e in a_rx]) == 4
            with trio.fail_after(5):
                while len(seen) < 2:
                    await trio.sleep(0)
            await tx.aclose()

    trio.run(main)
    a, b = seen
    assert (a.sub.request_id, a.finish, len(a.t_tokens)) == ("a", FinishReason.LENGTH, 4)
    assert a.sub.arrived <= a.t_admitted <= a.t_first_token == a.t_tokens[0] <= a.t_tokens[-1]
    assert (b.sub.request_id, b.finish, b.t_admitted) == ("b", FinishReason.ABORT, 0.0)


def test_image_requests_are_counted_but_never_captured():
    tel = Telemetry.create("m", ring_size=4)
    tx, _rx = trio.open_memory_channel(2)
    sub = Submission("img", (1, 2, 3), 1, SamplingParams(), frozenset(), tx, reuse_prefix=False)
    seq = Sequence(sub, finish=FinishReason.LENGTH, output=[4])
    tel.on_finish(seq)
    tel.route_done("img", route="/v1/chat/completions", status=200, finish=FinishReason.LENGTH, stream=False)
    assert tel.records() == []
    m = samples(tel.metrics.render().decode())
    assert val(m, "caldrix:request_success_total", finished_reason="length") == 1


def test_refusals_and_pending_halves_stay_bounded():
    tel = Telemetry.create("m", ring_size=2)
    tel.refused("q1", route="/v1/completions", status=429, prompt_ids=tuple(range(20)), max_tokens=5, ignore_eos=False,
                sampling=SamplingParams(), stream=False)
    (rec,) = tel.records()
    assert (rec.status, rec.finish_reason, rec.prompt_tokens, rec.completion_tokens, rec.end) == (429, None, 20, 0, None)
    assert len(rec.blocks) == 2
    tel.pending_max = 3
    for i in range(10):  # route halves whose scheduler half never comes
        tel.route_done(f"lost{i}", route="/v1/completions", status=499, finish=None, stream=False)
    assert len(tel._pending) == 3


def test_metrics_render_vllm_names_from_one_registry():
    a, b = Telemetry.create("m", 4), Telemetry.create("m", 4)  # two servers in one process
    assert a.metrics.registry is not b.metrics.registry
    a.metrics.read_live_from(lambda: type("S", (), dict(running=1, waiting=2, free_slots=3, held_rows=7, steps=9,
                                                                kept_states=1))())
    seq = finished_seq("r", range(40), output=(1, 2, 3, 4), prefix_rows=24)
    a.on_finish(seq)
    a.route_done("r", route="/v1/completions", status=200, finish=FinishReason.LENGTH, stream=False)
    a.metrics.response("/v1/completions", "POST", 200)
    a.metrics.response("/v1/completions", "POST", 429)
    m = samples(a.metrics.render().decode())
    assert val(m, "caldrix:time_to_first_token_seconds_count") == 1
    assert val(m, "caldrix:inter_token_latency_seconds_count") == 3
    assert val(m, "caldrix:inter_token_latency_seconds_sum") == pytest.approx(0.06, abs=1e-6)
    assert val(m, "caldrix:e2e_request_latency_seconds_count") == 1
    assert val(m, "caldrix:request_queue_time_seconds_count") == 1
    assert val(m, "caldrix:prompt_tokens_total") == 40 and val(m, "caldrix:generation_tokens_total") == 4
    assert val(m, "caldrix:prefix_cache_queries_total") == 40 and val(m, "caldrix:prefix_cache_hits_total") == 24
    assert val(m, "caldrix:request_success_total", finished_reason="length") == 1
    assert val(m, "caldrix:http_requests_total", handler="/v1/completions", method="POST", status="429") == 1
    assert val(m, "caldrix:requests_rejected_total", reason="queue_full") == 1
    assert val(m, "caldrix:num_requests_running") == 1 and val(m, "caldrix:num_requests_waiting") == 2
    assert val(m, "caldrix:kv_cache_usage_perc") == pytest.approx(0.25)
    assert val(m, "caldrix:num_kv_slots") == 4 and val(m, "caldrix:kv_cache_held_rows") == 7
    assert val(m, "caldrix:num_kept_states") == 1
    assert val(m, "caldrix:engine_steps_total") == 9
    assert samples(b.metrics.render().decode()).get(("caldrix:prompt_tokens_total", ())) == 0


def test_synthetic_prompts_keep_lengths_and_sharing():
    """The round trip without a server: digests -> synthetic prompts -> digests under a new salt."""
    rng = random.Random(3)
    shared = [rng.randrange(50000) for _ in range(40)]
    prompts = [shared + [1, 2, 3], shared[:35] + [9] * 30, [rng.randrange(50000) for _ in range(7)], shared + [1, 2, 3]]
    tel = Telemetry.create("m", ring_size=8)
    for i, p in enumerate(prompts):
        tel.on_finish(finished_seq(f"r{i}", p))
        tel.route_done(f"r{i}", route="/v1/completions", status=200, finish=None, stream=False)
    lines = list(tel.trace())[1:]
    again = []
    for line in lines:
        ids = replay.synthetic_prompt(line, BLOCK_TOKENS, 49152)
        assert len(ids) == line["prompt_tokens"] and all(1000 <= t < 32000 for t in ids)
        again.append({"blocks": block_digests(tuple(ids), b"another salt")})
    assert sharing_signature(lines) == sharing_signature(again)
    assert sharing_signature(lines)[0] == sharing_signature(lines)[3]
    assert sharing_signature(lines)[0][:2] == sharing_signature(lines)[1][:2] != sharing_signature(lines)[2][:2]


def test_percentiles():
    assert replay.percentile([], 0.5) is None
    assert replay.percentile([3.0, 1.0, 2.0], 0.5) == 2.0
    assert replay.percentile([1.0, 2.0], 0.9) == pytest.approx(1.9)
    assert replay.base_url("http://h:1/v1/") == "http://h:1"


@pytest.mark.parametrize("path", TRACES, ids=[p.name for p in TRACES])
def test_recorded_traces_are_workloads_without_text(path: Path):
    trace = replay.load_trace(path)
    assert trace.header["trace"] == "caldrix" and trace.header["block_tokens"] == BLOCK_TOKENS
    assert len(trace.requests) >= 8
    for line in trace.requests:
        assert set(line) == TRACE_KEYS
        assert len(line["blocks"]) == -(-line["prompt_tokens"] // BLOCK_TOKENS)
    arrivals = [r["arrival"] for r in trace.requests]
    assert arrivals == sorted(arrivals) and arrivals[0] == 0.0
    firsts = collections.Counter(r["blocks"][0] for r in trace.requests)
    assert firsts.most_common(1)[0][1] >= 5  # a prefix several requests share


def test_traces_cover_a_burst_and_a_long_shared_prefix():
    by_name = {p.name: replay.load_trace(p) for p in TRACES}
    burst = by_name["burst_short_chats.jsonl"]
    assert max(r["arrival"] for r in burst.requests) < 2.0 and max(r["prompt_tokens"] for r in burst.requests) < 100
    long = by_name["long_shared_prefix.jsonl"]
    sig = sharing_signature(long.requests)
    long_ones = [s for s in sig if len(s) >= 20]
    assert len(long_ones) >= 5 and len({s[:20] for s in long_ones}) == 1


# ---------------------------------------------------------------------------------------------
# Against a real server


@pytest.fixture(scope="module")
def server(smollm2_dir: Path):
    srv = ServerProcess.start(smollm2_dir, "--max-batch", "2", "--context", "2048", "--replay-ring", "64")
    yield srv
    status = srv.stop()
    assert status == 0, f"the server exited with status {status}:\n{srv.stderr}"


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=TIMEOUT) as client:
        yield client


@pytest.fixture(scope="module")
def model(smollm2_dir: Path) -> str:
    return smollm2_dir.name


def newest(http, path: str, n: int, after: set[str] = frozenset(), timeout: float = 10.0) -> list[dict]:
    """The last n records of /debug/requests or trace lines of /debug/trace, waiting until none of
    them is one of `after`: a stream's record is completed just after its last byte is sent."""
    deadline = time.monotonic() + timeout
    while True:
        resp = http.get(path, params={"last": n})
        assert resp.status_code == 200
        got = resp.json()["data"] if path == "/debug/requests" else [json.loads(x) for x in resp.text.splitlines()[1:]]
        if (len(got) == n and not {r["id"] for r in got} & set(after)) or time.monotonic() > deadline:
            return got
        time.sleep(0.1)


def test_metrics_counters_move_with_requests(http, model):
    resp = http.get("/metrics")
    assert resp.status_code == 200 and resp.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"  # as observability.md names it
    before = samples(resp.text)
    prompt = [random.Random(1).randrange(1000, 30000) for _ in range(40)]
    for _ in range(2):  # the second reuses the rows the first left in its slot
        r = http.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 4, "ignore_eos": True})
        assert r.status_code == 200, r.text
    assert http.post("/v1/completions", json={"model": model, "prompt": "x", "max_tokens": 0}).status_code == 400
    after = samples(http.get("/metrics").text)

    def delta(name, **labels):
        return val(after, name, **labels) - val(before, name, **labels)

    assert delta("caldrix:prompt_tokens_total") == 80
    assert delta("caldrix:generation_tokens_total") == 8
    assert delta("caldrix:prefix_cache_queries_total") == 80
    assert delta("caldrix:prefix_cache_hits_total") >= 39
    assert delta("caldrix:request_success_total", finished_reason="length") == 2
    assert delta("caldrix:time_to_first_token_seconds_count") == 2
    assert delta("caldrix:inter_token_latency_seconds_count") == 6
    assert delta("caldrix:e2e_request_latency_seconds_count") == 2
    assert delta("caldrix:request_queue_time_seconds_count") == 2
    assert delta("caldrix:http_requests_total", handler="/v1/completions", method="POST", status="200") == 2
    assert delta("caldrix:http_requests_total", handler="/v1/completions", method="POST", status="400") == 1
    assert delta("caldrix:requests_rejected_total", reason="invalid") == 1
    assert delta("caldrix:engine_steps_total") >= 8
    assert val(after, "caldrix:num_requests_running") == 0 and val(after, "caldrix:num_requests_waiting") == 0
    assert val(after, "caldrix:kv_cache_usage_perc") == 0 and val(after, "caldrix:num_kv_slots") == 2
    assert val(after, "caldrix:kv_cache_held_rows") >= 43
    # The server process's own series, as vLLM's /metrics has them (a model's weights alone are
    # past 50 MiB; the listening socket and the clients' connections are open fds).
    assert val(after, "process_resident_memory_bytes") > 50 * 2**20
    assert 3 <= val(after, "process_open_fds") < val(after, "process_max_fds")
    assert delta("process_cpu_seconds_total") > 0


def test_metrics_labels_stay_bounded_and_refusals_count_only_generating_routes(http, model):
    before = samples(http.get("/metrics").text)
    for n in range(5):  # any token is a method to HTTP; none of them may become a label
        assert http.request(f"ZQXMETHOD{n}", "/v1/completions").status_code in (400, 405)
    assert http.get("/debug/requests", params={"last": "x"}).status_code == 400
    for odd in (" 1", "1_0", "\uff13", "+1"):  # int() reads these; the route does not
        assert http.get("/debug/requests", params={"last": odd}).status_code == 400, odd
    everything = http.get("/debug/requests").json()["data"]
    for many in ("999999999", "1" + "0" * 12, "9" * 5000):  # more than the ring holds: all of it
        got = http.get("/debug/requests", params={"last": many})
        assert got.status_code == 200 and len(got.json()["data"]) >= len(everything), (many[:20], got.text[:200])
    text = http.get("/metrics").text
    after = samples(text)
    assert "ZQXMETHOD" not in text
    # 405 on a known route; a 400 if the server reads the odd method as malformed
    assert sum(v for (name, labels), v in after.items() if name == "caldrix:http_requests_total"
               and dict(labels).get("method") == "other") - sum(
        v for (name, labels), v in before.items() if name == "caldrix:http_requests_total"
        and dict(labels).get("method") == "other") == 5
    assert val(after, "caldrix:requests_rejected_total", reason="invalid") == val(
        before, "caldrix:requests_rejected_total", reason="invalid")  # a /debug 400 is not a refused request


def test_debug_requests_carry_settings_never_text(http, model, server):
    marker = f"zqx-{uuid.uuid4().hex}"
    chat = http.post("/v1/chat/completions", json={
        "model": model, "messages": [{"role": "user", "content": f"Please repeat {marker}"}], "max_tokens": 3,
        "temperature": 0.8, "top_p": 0.9, "seed": 12345, "stop": [marker]})
    assert chat.status_code == 200, chat.text
    with http.stream("POST", "/v1/completions", json={
            "model": model, "prompt": f"{marker} {marker}", "max_tokens": 3, "stream": True,
            "ignore_eos": True}) as s:
        assert s.status_code == 200
        s.read()
    newest(http, "/debug/requests", 1, after={chat.json()["id"]})  # until the stream's record is in
    body = http.get("/debug/requests", params={"last": 2})
    assert body.json()["ring"] == 64
    rc, rs = body.json()["data"]
    assert set(rc) == RECORD_KEYS and set(rs) == RECORD_KEYS
    assert rc["id"] == chat.json()["id"] and rc["route"] == "/v1/chat/completions" and rs["route"] == "/v1/completions"
    assert (rc["status"], rc["stream"], rs["stream"]) == (200, False, True)
    assert rc["finish_reason"] in ("length", "stop") and rc["max_tokens"] == 3
    # A sampled reply that ran past its end of sequence is reproducible from the record alone.
    assert (rc["ignore_eos"], rs["ignore_eos"]) == (False, True)
    assert (rs["finish_reason"], rs["completion_tokens"]) == ("length", 3)
    assert rc["prompt_tokens"] == chat.json()["usage"]["prompt_tokens"]
    assert rc["completion_tokens"] >= chat.json()["usage"]["completion_tokens"]
    assert rc["sampling"] == {"temperature": 0.8, "top_k": 0, "top_p": 0.9, "min_p": 0.0,
                              "repetition_penalty": 1.0, "seed": 12345}
    assert isinstance(rs["sampling"]["seed"], int)  # a drawn seed is recorded too
    t = rc["timings"]
    assert 0 <= t["queued"] <= t["first_token"] <= t["end"]
    assert sum(n for _, n in rc["batch_sizes"]) >= 3
    for where in (body.text, http.get("/debug/trace").text, http.get("/metrics").text, server.stderr):
        assert marker not in where and marker[4:20] not in where
    assert f"request {rc['id']} /v1/chat/completions status=200" in server.stderr
    assert http.get("/debug/requests", params={"last": "0"}).status_code == 400


def test_a_top_k_past_64_bits_keeps_every_token_and_the_records_readable(http, model):
    # A valid integer literal of any size (http-api.md: "an integer >= 0"): past every vocabulary
    # it keeps every token, as 0 does, the same reply for the same seed, and it is recorded as 0.
    # Recorded as sent, it broke /debug/requests and /debug/trace for the whole ring (a 500 from
    # JSON's 64-bit limit), which schemathesis found.
    ask = {"model": model, "prompt": "Once upon a time", "max_tokens": 4, "temperature": 1.0, "seed": 7}
    huge = http.post("/v1/completions", content=json.dumps({**ask, "top_k": 10**30}).encode(),
                     headers={"Content-Type": "application/json"})
    plain = http.post("/v1/completions", json={**ask, "top_k": 0})
    assert huge.status_code == 200 and plain.status_code == 200, huge.text
    assert huge.json()["choices"][0]["text"] == plain.json()["choices"][0]["text"]
    body = http.get("/debug/requests", params={"last": 2})
    assert body.status_code == 200, body.text
    assert [r["sampling"]["top_k"] for r in body.json()["data"]] == [0, 0]
    assert http.get("/debug/trace").status_code == 200


def test_trace_round_trip(http, model):
    """Record, export, replay, record again: the same lengths, settings and sharing."""
    rng = random.Random(11)
    shared = [rng.randrange(1000, 30000) for _ in range(40)]
    prompts = [shared + [501, 502, 503, 504, 505], shared[:36] + [rng.randrange(1000, 30000) for _ in range(9)],
               [rng.randrange(1000, 30000) for _ in range(20)], shared + [501, 502, 503, 504, 505]]
    extra = [{}, {"temperature": 0.9, "seed": 7}, {"top_k": 5, "temperature": 0.6, "seed": 8}, {}]
    for i, (p, more) in enumerate(zip(prompts, extra)):
        r = http.post("/v1/completions", json={"model": model, "prompt": p, "max_tokens": 2 + i % 2,
                                                "ignore_eos": True, **more})
        assert r.status_code == 200, r.text
    first = http.get("/debug/trace", params={"last": 4})
    assert first.headers["content-type"].startswith("application/x-ndjson")
    header, *lines = [json.loads(x) for x in first.text.splitlines()]
    assert header["requests"] == 4 and [x["prompt_tokens"] for x in lines] == [45, 45, 20, 45]

    results, _ = trio.run(lambda: replay.replay(replay.Trace(header, tuple(lines)), str(http.base_url),
                                                concurrency=1, speed=50.0))
    assert [(r.status, r.error) for r in results] == [(200, None)] * 4
    assert [r.tokens for r in results] == [x["completion_tokens"] for x in lines]
    assert all(r.ttft is not None and r.e2e >= r.ttft for r in results)
    again = newest(http, "/debug/trace", 4, after={x["id"] for x in lines})
    for key in ("prompt_tokens", "completion_tokens", "sampling"):
        assert [x[key] for x in again] == [x[key] for x in lines], key
    assert sharing_signature(again) == sharing_signature(lines)
    assert all(a["blocks"] != b["blocks"] for a, b in zip(again, lines))  # synthetic tokens, not the originals
    assert [x["route"] for x in again] == ["/v1/completions"] * 4


@pytest.mark.parametrize("path,limit", [(p, 3 if "burst" in p.name else 2) for p in TRACES], ids=[p.name for p in TRACES])
def test_replay_command_on_recorded_traces(server, path: Path, limit: int):
    out = subprocess.run([sys.executable, "-m", "caldrix", "replay", str(path), "--url", server.url + "/v1",
                          "--limit", str(limit), "--speed", "20", "--json"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout)
    want = sum(max(1, r["completion_tokens"]) for r in replay.load_trace(path).requests[:limit])
    assert summary["requests"] == summary["ok"] == limit and summary["output_tokens"] == want
    for key in ("ttft_s", "e2e_s", "decode_tokens_per_s"):
        assert set(summary[key]) == {"p50", "p90", "p99"}
    assert summary["ttft_s"]["p50"] <= summary["e2e_s"]["p50"]


def test_replay_command_reports_a_bad_trace(tmp_path: Path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json\n")
    out = subprocess.run([sys.executable, "-m", "caldrix", "replay", str(bad)], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 2 and "not JSON" in out.stderr


def test_a_stream_never_iterated_frees_its_request_and_ends_its_record():
    """quart cancels a handler whose client left at the response's first send, before the
    streamed body was ever iterated; an unstarted generator's finally never runs, so the
    scheduler generated on to max_tokens and the record never ended (the soak audit: the e2e
    histogram one request past request_success_total). Collected unstarted, the route's
    generator closes the request's channel and reports the client gone."""
    import gc

    from caldrix.routes.debug import watched

    class Seen:
        calls = []

        def route_done(self, rid, **kw):
            self.calls.append((rid, kw))

    async def pieces(rx):
        async for _ in rx:
            yield type("P", (), {"finish": FinishReason.LENGTH})()

    tel = Seen()

    async def collected_unstarted():
        tx, rx = trio.open_memory_channel(4)
        gen = watched(tel, "cmpl-9", "/v1/completions", pieces(rx), rx, stream=True)
        del gen
        gc.collect()
        with trio.fail_after(5):  # the report runs on the trio thread, soon (run_sync_soon)
            while not tel.calls:
                await trio.sleep(0.01)
        assert tel.calls == [("cmpl-9", {"route": "/v1/completions", "status": 200, "finish": None, "stream": True})]
        with pytest.raises(trio.BrokenResourceError):  # the scheduler's next send finds it gone
            tx.send_nowait(None)

    trio.run(collected_unstarted)

    # iterated to its end, it reports once, as before
    tel.calls.clear()
    tx, rx = trio.open_memory_channel(4)

    async def drain():
        g = watched(tel, "cmpl-10", "/v1/completions", pieces(rx), rx, stream=False)
        tx.send_nowait(None)
        tx.close()
        async for _ in g:
            pass
        await g.aclose()
        del g
        gc.collect()

    trio.run(drain)
    assert [rid for rid, _ in tel.calls] == ["cmpl-10"]


def test_a_request_whose_client_left_while_queued_ends_when_it_left(monkeypatch):
    """The scheduler finds an abandoned submission only when it takes it off the channel, seconds
    later behind long streams (the soak audit: e2e 4.3-11.3 s for clients gone within 0.6 s).
    Its record and the e2e histogram end it when the client left."""
    import caldrix.telemetry as telemetry_module

    tel = Telemetry.create("m", 4)
    tx, _rx = trio.open_memory_channel(2)
    sub = Submission("q7", (1, 2, 3), 4, SamplingParams(), frozenset(), tx,
                     arrived=time.monotonic() - 6.0)  # queued 6 s ago
    seq = Sequence(sub, finish=FinishReason.ABORT)  # never admitted: t_admitted stays 0
    real = time.time
    monkeypatch.setattr(telemetry_module.time, "time", lambda: real() - 5.5)  # the client left 0.5 s in
    tel.route_done("q7", route="/v1/completions", status=499, finish=None, stream=False)
    monkeypatch.setattr(telemetry_module.time, "time", real)
    tel.on_finish(seq)  # the scheduler takes it off the channel now
    (rec,) = tel.records()
    assert rec.queued is None and rec.end == pytest.approx(0.5, abs=0.5)  # (the defect gave 6)
    m = samples(tel.metrics.render().decode())
    assert val(m, "caldrix:e2e_request_latency_seconds_count") == 1
    assert val(m, "caldrix:e2e_request_latency_seconds_sum") == pytest.approx(0.5, abs=0.5)
