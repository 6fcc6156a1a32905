"""Aggregate tokens/s through the nginx balancer of deploy/ against one replica alone.

    .venv/bin/python bench/replicas.py [--replicas 3] [--streams 24] [--max-tokens 64]
                                       [--json OUT.json] [-- caldrix serve flags]

Two set-ups, one after the other, the same `caldrix serve` flags for every process (default:
the embedded model, `--max-batch 8 --context 1024`):
  one       one replica, the streams sent to it directly
  balanced  N replicas on loopback ports behind nginx (deploy/replicas.py's config), the streams
            sent to nginx without a session header, so least_conn spreads them
In each, `--streams` requests are sent at once, each streamed, each asking for exactly
`--max-tokens` tokens (ignore_eos) after a different short prompt; the figure is the sum of
their completion tokens (from the final usage chunk) over the wall time from the first send to
the last byte. Also printed: time to first token, median and p90, and where the streams went.

Every process gets deploy/replicas.py's environment (OMP_NUM_THREADS = cores // N, so every
core for the lone replica, and OMP_WAIT_POLICY=PASSIVE, unless already set). With OpenMP's
default spinning waits, on this shared 2-core VM (load average ~10), the lone replica managed
about 4 tok/s. Results: docs/deploy.md.
Needs nginx (Debian's package). Only loopback addresses are used.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("caldrix_deploy_replicas", ROOT / "deploy" / "replicas.py")
deploy = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(deploy)

HOST = "127.0.0.1"
DEFAULT_FLAGS = ["--max-batch", "8", "--context", "1024"]
WORDS = ("river", "castle", "engine", "garden", "winter", "signal", "harbor", "lantern", "meadow", "copper",
         "violin", "glacier", "orchard", "compass", "thunder", "marble", "falcon", "canyon", "saddle", "beacon",
         "harvest", "pepper", "anchor", "velvet")


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def start_replica(flags: list[str], n: int, logdir: Path, name: str) -> tuple[subprocess.Popen, str]:
    """One of `n` replicas, with deploy/replicas.py's environment for n (n = 1: every core)."""
    port = free_port()
    env = {**deploy.replica_env(n), "PYTHONUNBUFFERED": "1"}
    log = open(logdir / f"{name}.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "caldrix", "serve", *flags, "--host", HOST, "--port", str(port)],
                            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    return proc, f"http://{HOST}:{port}"


def served_name(url: str) -> str:
    return httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]


async def one_stream(client: httpx.AsyncClient, url: str, body: dict) -> dict:
    t0 = time.perf_counter()
    first = None
    tokens = 0
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        upstream = r.headers.get("x-caldrix-upstream", "")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if first is None and chunk.get("choices") and chunk["choices"][0].get("text"):
                first = time.perf_counter() - t0
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return {"tokens": tokens, "ttft": first, "upstream": upstream}


async def workload(url: str, model: str, streams: int, max_tokens: int) -> dict:
    limits = httpx.Limits(max_connections=streams + 4, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        bodies = [{"model": model, "prompt": f"Write about the {WORDS[i % len(WORDS)]} number {i}.",
                   "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0, "stream": True,
                   "stream_options": {"include_usage": True}} for i in range(streams)]
        t0 = time.perf_counter()
        recs = await asyncio.gather(*(one_stream(client, url, b) for b in bodies))
        wall = time.perf_counter() - t0
    ttfts = sorted(r["ttft"] for r in recs if r["ttft"] is not None)
    spread: dict[str, int] = {}
    for r in recs:
        spread[r["upstream"] or "direct"] = spread.get(r["upstream"] or "direct", 0) + 1
    total = sum(r["tokens"] for r in recs)
    return {"tokens": total, "wall_s": round(wall, 3), "tok_s": round(total / wall, 1),
            "ttft_p50_ms": round(1000 * statistics.median(ttfts), 1),
            "ttft_p90_ms": round(1000 * ttfts[int(0.9 * (len(ttfts) - 1))], 1), "streams_by_upstream": spread}


def run_one(flags, streams, max_tokens, logdir) -> dict:
    proc, url = start_replica(flags, 1, logdir, "one")
    try:
        deploy._wait_healthy(url, proc, timeout=600)
        asyncio.run(workload(url, served_name(url), streams, 4))  # warm-up at the same width
        return asyncio.run(workload(url, served_name(url), streams, max_tokens))
    finally:
        deploy.stop_replicas([proc])


def run_balanced(n, flags, streams, max_tokens, logdir) -> dict:
    started = [start_replica(flags, n, logdir, f"replica{i}") for i in range(n)]
    procs = [p for p, _ in started]
    balancer = None
    try:
        for p, url in started:
            deploy._wait_healthy(url, p, timeout=600)
        replicas = [(HOST, int(url.rsplit(":", 1)[1])) for _, url in started]
        balancer = deploy.Balancer.start(replicas, (HOST, free_port()), logdir / "nginx")
        model = served_name(balancer.url)
        asyncio.run(workload(balancer.url, model, streams, 4))  # warm-up at the same width
        return asyncio.run(workload(balancer.url, model, streams, max_tokens))
    finally:
        if balancer is not None:
            balancer.stop()
        deploy.stop_replicas(procs)


def main() -> int:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so the finally blocks stop the servers
    argv = sys.argv[1:]
    flags = list(DEFAULT_FLAGS)
    if "--" in argv:
        at = argv.index("--")
        argv, flags = argv[:at], argv[at + 1:]
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--streams", type=int, default=24)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args(argv)
    if deploy.nginx_binary() is None:
        raise SystemExit("bench/replicas.py: nginx is not installed (Debian: apt-get install nginx)")
    logdir = Path(tempfile.mkdtemp(prefix="caldrix-bench-replicas-"))
    load_before = os.getloadavg()
    one = run_one(flags, args.streams, args.max_tokens, logdir)
    balanced = run_balanced(args.replicas, flags, args.streams, args.max_tokens, logdir)
    out = {"machine": {"cpu_count": os.cpu_count(), "processor": platform.processor() or platform.machine(),
                       "loadavg_before": [round(x, 2) for x in load_before],
                       "loadavg_after": [round(x, 2) for x in os.getloadavg()]},
           "flags": flags, "streams": args.streams, "max_tokens": args.max_tokens,
           "one": one, f"balanced_{args.replicas}": balanced}
    print(f"{'set-up':<28}{'tok/s':>8}{'wall s':>8}{'TTFT p50 ms':>13}{'TTFT p90 ms':>13}")
    for name, r in (("one replica, direct", one), (f"{args.replicas} replicas behind nginx", balanced)):
        print(f"{name:<28}{r['tok_s']:>8}{r['wall_s']:>8}{r['ttft_p50_ms']:>13}{r['ttft_p90_ms']:>13}")
    print(f"streams by replica (balanced): {balanced['streams_by_upstream']}")
    print(f"flags: {' '.join(flags)}; {args.streams} streams x {args.max_tokens} tokens; "
          f"cpus {os.cpu_count()}; load average before {out['machine']['loadavg_before']}, "
          f"after {out['machine']['loadavg_after']}; logs in {logdir}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
