"""Serving benchmark: caldrix serve against its peers, same model, same machine, one run.

    .venv/bin/python bench/serve.py [--quick] [--json OUT.json] [--skip caldrix,mb1,spec,llama,hf]
                                    [--llama-wait-policy active|default|passive] [--rebuild-llama]

Peers, one at a time (never two decoding at once):
  caldrix           `caldrix serve GGUF --max-batch 8` (and, unless --quick, two more servers for
                    the single stream alone: --max-batch 1, and --max-batch 1 --speculate ngram)
  llama-cpp-python  `python -m llama_cpp.server --model GGUF --n_threads 2 ...`, installed on first
                    use into its own venv, .venv-bench (a source build: several minutes on 2
                    cores); never a dependency of caldrix. If it cannot be built, its column is n/a.
  transformers      `AutoModelForCausalLM.generate` in its own process on caldrix's conversion of
                    the same GGUF (bf16 where the CPU has it, as caldrix picks), no HTTP.

Both servers load the same .gguf file (the embedded SmolLM2-135M-Instruct Q4_1), get the same
prompt texts over /v1/completions, streamed, and each request asks for exactly max_tokens tokens
(caldrix: ignore_eos; llama-cpp-python: min_tokens). Workloads:
  single stream     128 greedy tokens after a short prompt (3 runs, different prompts)
  8 streams         8 such requests sent at once; aggregate tok/s over the wall time
  512-token prompt  time to first token (3 runs, prompts with no common prefix)
  mixed             4 streams running; when the first has half its tokens, a 512-token prompt
                    arrives; inter-token latency of the 4 running streams, pooled over 3 rounds
                    (1 with --quick), each round's p99/p50 printed under the table
  traces/*.jsonl    each trace's requests at their recorded arrival offsets, recorded lengths
                    and sampling settings; prompts are words drawn per prompt block, so requests
                    that shared a prefix still do
Printed: one table with a column per peer and the ratios caldrix/llama.cpp and
caldrix/transformers, with the direction that is better on each row; peak RSS (VmHWM) of each
server process and of the transformers process; the load average, since this machine is shared.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
# Every peer runs in the environment the user gave this script; nothing sets
# OMP_WAIT_POLICY for them. Measured here with PASSIVE, llama.cpp's OpenMP pool decodes about
# 3.4 times slower (35 against 120 tok/s) and transformers generate about 2.4 times slower (19 against 45 tok/s). --llama-wait-policy active
# was tried too: no steady difference from leaving it unset, both swing between ~35 and ~120.
ENV = dict(os.environ)

BENCH_VENV = Path(os.environ.get("CALDRIX_BENCH_VENV") or ROOT / ".venv-bench")  # llama-cpp-python's own venv
LLAMA_SPEC = "llama-cpp-python[server]"
BUILD_LOG = BENCH_VENV / "build.log"
BUILD_FAILED = BENCH_VENV / "build-failed"  # the reason a build failed; --rebuild-llama tries again
# llama.cpp's native build enables its AMX kernels where the CPU has AMX; with llama-cpp-python
# 0.3.36 they crash on the first prompt of more than one token (seen here on a Sapphire Rapids
# VM), so on such CPUs the benchmark builds for AVX-512 without them.
NO_AMX_CMAKE_ARGS = " ".join(f"-DGGML_{opt}" for opt in (
    "NATIVE=OFF", "AVX=ON", "AVX2=ON", "FMA=ON", "F16C=ON", "AVX512=ON", "AVX512_VBMI=ON", "AVX512_VNNI=ON",
    "AVX512_BF16=ON", "AVX_VNNI=ON", "AMX_TILE=OFF", "AMX_INT8=OFF", "AMX_BF16=OFF"))
THREADS = 2
CONTEXT = 2048  # rows per sequence, the same for both servers: the longest request is 512 + 16
LISTENING = re.compile(r"caldrix: listening on (http://\S+)/v1")

from prompts import PROMPTS  # noqa: E402  (bench/prompts.py, shared by the benchmarks)

T0 = time.monotonic()


def progress(msg: str) -> None:
    print(f"[bench {time.monotonic() - T0:6.0f}s] {msg}", file=sys.stderr, flush=True)


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def pct(xs: list[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not xs:
        return None
    s = sorted(xs)
    k = (len(s) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def median(xs: list[float]) -> float | None:
    return pct(xs, 0.5)


def ms(x: float | None) -> float | None:
    return None if x is None else x * 1000.0


# -- llama-cpp-python's venv ------------------------------------------------------------------


def bench_python() -> Path:
    return BENCH_VENV / "bin" / "python"


def llama_installed() -> str | None:
    """The llama-cpp-python version importable in .venv-bench, or None."""
    py = bench_python()
    if not py.exists():
        return None
    r = subprocess.run([str(py), "-c", "import llama_cpp, llama_cpp.server, uvicorn; print(llama_cpp.__version__)"],
                       capture_output=True, text=True)
    return r.stdout.strip() if r.returncode == 0 else None


def ensure_llama_venv(gguf: Path, rebuild: bool = False) -> tuple[str | None, str]:
    """Create .venv-bench with llama-cpp-python[server] on first use: (version, why not).

    A failed build is remembered in BUILD_FAILED, so later runs do not spend minutes on it again
    unless `rebuild`, which also rebuilds an installed llama-cpp-python. An installed build must
    complete a short prompt first (`llama_smoke`).
    """
    version = llama_installed()
    if version and not rebuild:
        why = llama_smoke(gguf)
        return (None, why) if why else (version, "")
    if BUILD_FAILED.exists() and not rebuild:
        return None, BUILD_FAILED.read_text().strip() + " (an earlier run; --rebuild-llama tries again)"
    version, why = _install_llama(force=bool(version))
    if version:
        why = llama_smoke(gguf)
        version = None if why else version
    if not version and BENCH_VENV.is_dir():
        BUILD_FAILED.write_text(why + "\n")
    elif version:
        BUILD_FAILED.unlink(missing_ok=True)
    return version, why


def _install_llama(force: bool = False) -> tuple[str | None, str]:
    t0 = time.monotonic()
    if not bench_python().exists():
        progress(f"creating {BENCH_VENV.name} for llama-cpp-python (its own venv; caldrix does not depend on it)")
        r = subprocess.run([sys.executable, "-m", "venv", str(BENCH_VENV)], capture_output=True, text=True)
        if r.returncode != 0:
            return None, f"python -m venv failed: {r.stderr.strip()[-300:]}"
    progress(f"pip install '{LLAMA_SPEC}' into {BENCH_VENV.name}: llama-cpp-python has only a source "
             f"archive on PyPI, so pip compiles llama.cpp (several minutes on 2 cores); full log in {BUILD_LOG}")
    env = {**ENV, "CMAKE_BUILD_PARALLEL_LEVEL": str(THREADS), "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    if "CMAKE_ARGS" not in env and cpu_has_amx():
        env["CMAKE_ARGS"] = NO_AMX_CMAKE_ARGS
        progress("  this CPU has AMX: building llama.cpp for AVX-512 without its AMX kernels, which crash "
                 "(SIGSEGV) on any prompt of more than one token in llama-cpp-python 0.3.36; set CMAKE_ARGS to override")
    cmd = [str(bench_python()), "-m", "pip", "install", "-v", LLAMA_SPEC]
    if force:  # --rebuild-llama over an installed build: compile it again, keep its dependencies
        cmd += ["--force-reinstall", "--no-deps", "--no-cache-dir"]
    last_pct, last_note = -10, 0.0
    try:
        with open(BUILD_LOG, "w") as log:
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                    errors="replace")
            assert proc.stdout is not None
            for line in proc.stdout:
                log.write(line)
                now = time.monotonic() - t0
                m = re.match(r"\s*\[(\d+)/(\d+)\]", line)  # ninja's [done/total]
                if m:
                    done = 100 * int(m.group(1)) // max(1, int(m.group(2)))
                    if done >= last_pct + 10:
                        last_pct = done
                        progress(f"  compiling llama.cpp: {done}% ({now:.0f} s)")
                        last_note = now
                elif re.match(r"(Collecting \S+$|Collecting [^(]*$|\s*Building wheel for|Successfully installed)", line):
                    progress(f"  {line.strip()[:100]} ({now:.0f} s)")
                    last_note = now
                elif now - last_note > 60:
                    progress(f"  still installing ({now:.0f} s)")
                    last_note = now
            rc = proc.wait()
    except OSError as exc:
        return None, f"pip install could not run: {exc}"
    if rc != 0:
        tail = [ln.strip() for ln in BUILD_LOG.read_text(errors="replace").splitlines() if ln.strip()][-3:]
        return None, f"pip install '{LLAMA_SPEC}' failed (exit {rc}; see {BUILD_LOG}): {' | '.join(tail)[-300:]}"
    version = llama_installed()
    if not version:
        return None, f"llama-cpp-python installed but does not import (see {BUILD_LOG})"
    progress(f"llama-cpp-python {version} installed in {time.monotonic() - t0:.0f} s")
    return version, ""


def cpu_has_amx() -> bool:
    try:
        return " amx_int8" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


def llama_smoke(gguf: Path) -> str:
    """Complete a three-token prompt in-process; "" if it worked, else why not. A build can
    import and still crash on its first batched prompt (it did: AMX kernels, exit -11)."""
    code = ("import sys; from llama_cpp import Llama; "
            "m = Llama(model_path=sys.argv[1], n_threads=2, n_ctx=256, verbose=False); "
            "m.create_completion('Hello there.', max_tokens=2)")
    r = subprocess.run([str(bench_python()), "-c", code, str(gguf)], capture_output=True, text=True)
    if r.returncode == 0:
        return ""
    tail = " | ".join(ln for ln in r.stderr.strip().splitlines()[-2:])[-200:]
    return (f"llama-cpp-python crashed completing a 3-token prompt (exit {r.returncode}{': ' + tail if tail else ''}); "
            f"rebuild it with other CMAKE_ARGS and --rebuild-llama")


# -- prompts ----------------------------------------------------------------------------------


class Words:
    """Prompts of an exact token count: words that are one token each with their leading space."""

    def __init__(self, tokenizer_json: Path):
        from tokenizers import Tokenizer

        self.tok = Tokenizer.from_file(str(tokenizer_json))
        vocab = self.tok.get_vocab()
        self.words = sorted(t[1:] for t in vocab if re.fullmatch(r"Ġ[a-z]{3,9}", t))

    def count(self, text: str) -> int:
        return len(self.tok.encode(text, add_special_tokens=False).ids)

    def text(self, seeds: list[tuple[str, int]]) -> str:
        """Words for each (seed, count) in turn, so equal seed runs give equal text prefixes."""
        import random

        out: list[str] = []
        for seed, n in seeds:
            rng = random.Random(seed)
            out.extend(rng.choice(self.words) for _ in range(n))
        return "".join(" " + w for w in out)

    def exact(self, seed: str, n: int) -> str:
        text = self.text([(seed, n)])
        got = self.count(text)
        if got != n:
            raise RuntimeError(f"a {n}-word prompt is {got} tokens")
        return text


def trace_prompt(words: Words, req: dict, block_tokens: int) -> str:
    """A text prompt of the recorded length; block i's words depend on its digest alone."""
    n = int(req["prompt_tokens"])
    seeds: list[tuple[str, int]] = []
    have = 0
    for digest in req.get("blocks") or ():
        take = min(block_tokens, n - have)
        if take <= 0:
            break
        seeds.append((f"{digest}:{take}", take))
        have += take
    if have < n:
        seeds.append((f"{req.get('id')}:{req['arrival']}:rest", n - have))
    return words.text(seeds)


# -- server processes -------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def vm_hwm_mb(pid: int) -> float | None:
    """Peak resident set (VmHWM) of pid and its child processes, MiB."""
    total, seen = 0.0, False
    pids = [pid]
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            pids += [int(c) for c in (task / "children").read_text().split()]
    except OSError:
        pass
    for p in pids:
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    total += int(line.split()[1]) / 1024.0
                    seen = True
        except OSError:
            pass
    return round(total, 1) if seen else None


class Server:
    """A server subprocess, its stderr in a log file; `kind` is "caldrix" or "llama"."""

    def __init__(self, kind: str, args: list[str], port: int, log: Path, env: dict | None = None):
        self.kind, self.args, self.port, self.log_path = kind, args, port, log
        self.url = f"http://127.0.0.1:{port}"
        self._log = open(log, "w")
        self.proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT,
                                     env={**ENV, "PYTHONUNBUFFERED": "1", **(env or {})}, cwd=ROOT)
        self.model = ""

    def log_tail(self, n: int = 5) -> str:
        lines = [ln for ln in self.log_path.read_text(errors="replace").splitlines() if ln.strip()]
        return " | ".join(lines[-n:])[-600:]

    def wait_ready(self, timeout: float) -> None:
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.kind} server exited with status {self.proc.returncode}: {self.log_tail()}")
            if self.kind != "caldrix" or LISTENING.search(self.log_path.read_text(errors="replace")):
                try:
                    r = httpx.get(self.url + "/v1/models", timeout=5)
                    if r.status_code == 200:
                        self.model = r.json()["data"][0]["id"]
                        return
                except (httpx.HTTPError, ValueError, KeyError, IndexError):
                    pass
            time.sleep(0.25)
        raise RuntimeError(f"{self.kind} server not ready within {timeout:.0f} s: {self.log_tail()}")

    def stop(self) -> float | None:
        """Peak RSS (MiB), then SIGTERM (SIGKILL after 30 s)."""
        peak = vm_hwm_mb(self.proc.pid) if self.proc.poll() is None else None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)
        self._log.close()
        return peak


CALDRIX_FLAGS: list[str] = []  # --caldrix-flags: extra `caldrix serve` flags to try


def start_caldrix(gguf: Path, max_batch: int, logdir: Path, extra: tuple[str, ...] = (), name: str = "") -> Server:
    port = free_port()
    args = [sys.executable, "-m", "caldrix", "serve", str(gguf), "--port", str(port), "--max-batch", str(max_batch),
            "--context", str(CONTEXT), "--log-level", "warning", *extra, *CALDRIX_FLAGS]
    srv = Server("caldrix", args, port, logdir / f"caldrix-mb{max_batch}{name}.log")
    try:
        srv.wait_ready(600)
    except Exception:
        srv.stop()
        raise
    return srv


def start_llama(gguf: Path, logdir: Path, wait_policy: str = "default") -> Server:
    port = free_port()
    # interrupt_requests off: by default a new request cuts the one streaming short; with it off
    # they queue, which is the only way concurrent clients all get their tokens from this server.
    args = [str(bench_python()), "-m", "llama_cpp.server", "--model", str(gguf), "--n_threads", str(THREADS),
            "--n_threads_batch", str(THREADS), "--n_ctx", str(CONTEXT), "--host", "127.0.0.1", "--port", str(port),
            "--interrupt_requests", "false"]
    env = None if wait_policy == "default" else {"OMP_WAIT_POLICY": wait_policy.upper()}
    srv = Server("llama", args, port, logdir / "llama-cpp-python.log", env)
    try:
        srv.wait_ready(300)
    except Exception:
        srv.stop()
        raise
    return srv


# -- the HTTP client --------------------------------------------------------------------------


class Rec:
    """One streamed request: when it was sent, when each token-bearing chunk came."""

    def __init__(self) -> None:
        self.sent = 0.0
        self.chunks: list[float] = []  # arrival times of chunks carrying text or token ids
        self.tokens = 0
        self.ids: list[int] = []  # token ids, where the server sends them
        self.usage: dict | None = None
        self.error: str | None = None
        self.end = 0.0

    @property
    def ttft(self) -> float | None:
        return self.chunks[0] - self.sent if self.chunks else None

    @property
    def e2e(self) -> float:
        return self.end - self.sent

    @property
    def gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.chunks, self.chunks[1:])]


def body_for(srv: Server, prompt: str, max_tokens: int, sampling: dict | None = None) -> dict:
    s = {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}
    s.update({k: v for k, v in (sampling or {}).items() if v is not None})
    body = {"model": srv.model, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "temperature": s["temperature"], "top_p": s["top_p"], "top_k": s["top_k"], "min_p": s["min_p"]}
    if s.get("seed") is not None:
        body["seed"] = s["seed"]
    if srv.kind == "caldrix":
        body.update(ignore_eos=True, repetition_penalty=s["repetition_penalty"],
                    stream_options={"include_usage": True}, return_token_ids=True)
    else:  # llama-cpp-python: its own names; its defaults are top_k 40 and repeat_penalty 1.1
        body.update(min_tokens=max_tokens, repeat_penalty=s["repetition_penalty"])
    return body


async def stream(client, body: dict, rec: Rec | None = None, on_token=None) -> Rec:
    import httpx
    import orjson
    import trio

    rec = rec or Rec()
    rec.sent = trio.current_time()
    try:
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                await resp.aread()
                rec.error = f"HTTP {resp.status_code}: {resp.text[:200]}"
                return rec
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:].strip()
                if data == "[DONE]":
                    break
                now = trio.current_time()
                chunk = orjson.loads(data)
                if "error" in chunk:
                    rec.error = str(chunk["error"])[:200]
                    break
                if chunk.get("usage"):
                    rec.usage = chunk["usage"]
                for choice in chunk.get("choices") or ():
                    ids = choice.get("token_ids")
                    if choice.get("text") or ids:
                        rec.chunks.append(now)
                        rec.tokens += len(ids) if ids is not None else 1
                        rec.ids.extend(ids or ())
                        if on_token is not None:
                            on_token(rec)
    except httpx.HTTPError as exc:
        rec.error = f"{type(exc).__name__}: {exc}"
    rec.end = trio.current_time()
    if rec.usage and rec.usage.get("completion_tokens") is not None:
        rec.tokens = rec.usage["completion_tokens"]
    return rec


def client_for(srv: Server):
    import httpx

    return httpx.AsyncClient(base_url=srv.url, timeout=httpx.Timeout(900.0, connect=10.0),
                             limits=httpx.Limits(max_connections=32, max_keepalive_connections=32))


def check(recs: list[Rec], want: int | None, what: str) -> None:
    for r in recs:
        if r.error:
            raise RuntimeError(f"{what}: {r.error}")
        if want is not None and r.tokens != want:
            raise RuntimeError(f"{what}: got {r.tokens} tokens, asked for {want}")


# -- workloads over HTTP ----------------------------------------------------------------------


class Plan:
    def __init__(self, quick: bool, words: Words, traces: list[Path]):
        self.quick = quick
        self.tokens = 32 if quick else 128
        self.reps = 1 if quick else 3
        self.single_reps = 1 if quick else 5  # the single stream swings most from run to run
        self.words = words
        self.long = [words.exact(f"long-{i}", 512) for i in range(self.reps)]
        self.warm_long = words.exact("warm-up", 512)
        # The mixed workload runs reps rounds, each with a 512-token prompt of its own: a round's
        # p99 is about its second-worst step (each step's gap lands on all four streams at once),
        # so one round alone swung 1.99-3.25 on one engine (docs/performance.md).
        self.mixed_long = [words.exact(f"mixed-long-{i}" if i else "mixed-long", 512) for i in range(self.reps)]
        self.traces = traces
        self.trace_limit = 6 if quick else None


def run_http(srv: Server, plan: Plan, out: dict, *, single_only: bool = False) -> dict:
    """Every workload against srv; the numbers go into `out` as they come (kept on a failure)."""
    import trio

    trio.run(_run_http, srv, plan, out, single_only)
    return out


async def _run_http(srv: Server, plan: Plan, out: dict, single_only: bool) -> None:
    import trio

    n = plan.tokens
    async with client_for(srv) as client:
        progress(f"  {srv.kind}: warm-up")
        check([await stream(client, body_for(srv, "Hello there.", 8))], 8, "warm-up")
        check([await stream(client, body_for(srv, plan.warm_long, 4))], 4, "warm-up")

        progress(f"  {srv.kind}: single stream, {plan.single_reps} x {n} tokens")
        recs = []
        for i in range(plan.single_reps):
            recs.append(await stream(client, body_for(srv, PROMPTS[i], n)))
        check(recs, n, "single stream")
        out["single_runs_tok_s"] = [r.tokens / r.e2e for r in recs]
        out["single_tok_s"] = median(out["single_runs_tok_s"])
        out["single_ids"] = [r.ids for r in recs]
        out["single_best_tok_s"] = max(out["single_runs_tok_s"])
        out["single_ttft_ms"] = ms(median([r.ttft for r in recs]))
        gaps = [g for r in recs for g in r.gaps]
        out["single_itl_p50_ms"], out["single_itl_p99_ms"] = ms(pct(gaps, 0.5)), ms(pct(gaps, 0.99))
        spec = [r.usage["speculative"] for r in recs if r.usage and "speculative" in r.usage]
        if spec:
            out["single_spec_proposed"] = sum(s["proposed"] for s in spec)
            out["single_spec_accepted"] = sum(s["accepted"] for s in spec)
        if single_only:
            return

        progress(f"  {srv.kind}: 8 concurrent streams x {n} tokens")
        recs = [Rec() for _ in range(8)]
        t0 = trio.current_time()
        async with trio.open_nursery() as nursery:
            for i in range(8):
                nursery.start_soon(stream, client, body_for(srv, PROMPTS[i], n), recs[i])
        wall = trio.current_time() - t0
        check(recs, n, "8 streams")
        out["conc8_tok_s"] = sum(r.tokens for r in recs) / wall
        ttfts = [r.ttft for r in recs]
        out["conc8_ttft_p50_ms"], out["conc8_ttft_p99_ms"] = ms(pct(ttfts, 0.5)), ms(pct(ttfts, 0.99))
        gaps = [g for r in recs for g in r.gaps]
        out["conc8_itl_p50_ms"], out["conc8_itl_p99_ms"] = ms(pct(gaps, 0.5)), ms(pct(gaps, 0.99))

        progress(f"  {srv.kind}: 512-token prompt, time to first token, {plan.reps} runs")
        recs = []
        for text in plan.long:
            recs.append(await stream(client, body_for(srv, text, 1)))
        check(recs, 1, "512-token prompt")
        out["ttft512_ms"] = ms(median([r.ttft for r in recs]))
        usage = recs[-1].usage
        if usage:
            out["ttft512_prompt_tokens"] = usage.get("prompt_tokens")

        progress(f"  {srv.kind}: 4 streams x {n} tokens, a 512-token prompt arriving half-way, "
                 f"{len(plan.mixed_long)} round(s)")
        gaps, ratios, long_ttfts = [], [], []
        for long_text in plan.mixed_long:
            runners, long_rec = await mixed_round(client, srv, long_text, n)
            round_gaps = [g for r in runners for g in r.gaps]
            gaps += round_gaps
            ratios.append(pct(round_gaps, 0.99) / pct(round_gaps, 0.5))
            long_ttfts.append(long_rec.ttft)
        p50, p99 = pct(gaps, 0.5), pct(gaps, 0.99)  # pooled over the rounds
        out.update(mix_itl_p50_ms=ms(p50), mix_itl_p99_ms=ms(p99), mix_itl_max_ms=ms(max(gaps)),
                   mix_itl_ratio=p99 / p50 if p50 else None, mix_long_ttft_ms=ms(median(long_ttfts)),
                   mix_itl_ratio_rounds=ratios)

        for path in plan.traces:
            name = path.stem
            progress(f"  {srv.kind}: trace {path.name}")
            t = await replay_trace(client, srv, plan, path)
            out.update({f"trace_{name}_{k}": v for k, v in t.items()})


async def mixed_round(client, srv: Server, long_text: str, n: int) -> tuple[list[Rec], Rec]:
    """4 streams of n tokens; when the first has n // 2, long_text (8 tokens out) arrives."""
    import trio

    runners = [Rec() for _ in range(4)]
    half = trio.Event()
    long_rec = Rec()

    def on_token(rec: Rec) -> None:
        if rec is runners[0] and rec.tokens >= n // 2:
            half.set()

    async def late_long() -> None:
        await half.wait()
        await stream(client, body_for(srv, long_text, 8), long_rec)

    async with trio.open_nursery() as nursery:
        for i in range(4):
            nursery.start_soon(stream, client, body_for(srv, PROMPTS[4 + i], n), runners[i], on_token)
        nursery.start_soon(late_long)
    check(runners, n, "mixed: running streams")
    check([long_rec], 8, "mixed: the 512-token prompt")
    return runners, long_rec


async def replay_trace(client, srv: Server, plan: Plan, path: Path) -> dict:
    import trio

    from caldrix.replay import load_trace

    trace = load_trace(path)
    reqs = list(trace.requests[: plan.trace_limit] if plan.trace_limit else trace.requests)
    bodies = [body_for(srv, trace_prompt(plan.words, r, trace.block_tokens), max(1, int(r["completion_tokens"])),
                       r.get("sampling")) for r in reqs]
    recs = [Rec() for _ in reqs]
    t0 = trio.current_time()
    async with trio.open_nursery() as nursery:
        for req, body, rec in zip(reqs, bodies, recs):
            await trio.sleep_until(t0 + float(req["arrival"]))
            nursery.start_soon(stream, client, body, rec)
    wall = trio.current_time() - t0
    for r, b in zip(recs, bodies):
        check([r], b["max_tokens"], f"trace {path.name}")
    ttft = [r.ttft for r in recs]
    e2e = [r.e2e for r in recs]
    return {"requests": len(recs), "tok_s": sum(r.tokens for r in recs) / wall, "wall_s": wall,
            "ttft_p50_ms": ms(pct(ttft, 0.5)), "ttft_p99_ms": ms(pct(ttft, 0.99)),
            "e2e_p50_ms": ms(pct(e2e, 0.5)), "e2e_p99_ms": ms(pct(e2e, 0.99))}


# -- transformers generate, in its own process ------------------------------------------------


def hf_worker(spec: dict) -> dict:
    """Runs in a child process (--hf-worker): the numbers, and this process's peak RSS."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, StoppingCriteria, StoppingCriteriaList

    from transformers.utils import logging as hf_logging

    from caldrix.engine import resolve_dtype

    hf_logging.disable_progress_bar()
    dtype = resolve_dtype("auto", "cpu")
    path = spec["model_dir"]
    n, reps = spec["tokens"], spec["reps"]
    tok = AutoTokenizer.from_pretrained(path)
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()

    class Stamp(StoppingCriteria):
        """Called once per generated token (per step, for a batch): its time."""

        def __init__(self) -> None:
            self.times: list[float] = []

        def __call__(self, input_ids, scores, **kw):
            self.times.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    def gen(texts: list[str], k: int) -> tuple[float, list[float], int]:
        enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        stamp = Stamp()
        t = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(**enc, max_new_tokens=k, min_new_tokens=k, do_sample=False,
                                 pad_token_id=tok.pad_token_id, stopping_criteria=StoppingCriteriaList([stamp]))
        assert out.shape[1] - enc["input_ids"].shape[1] == k
        return t, stamp.times, int(enc["input_ids"].shape[1])

    res: dict = {"dtype": str(dtype).removeprefix("torch."), "threads": torch.get_num_threads()}
    gen(["Hello there."], 8)
    gen([spec["warm_long"]], 1)
    print("[hf] single stream", file=sys.stderr, flush=True)
    rates, ttfts, gaps = [], [], []
    for i in range(reps):
        t, times, _ = gen([PROMPTS[i]], n)
        rates.append(n / (times[-1] - t))
        res.setdefault("single_runs_tok_s", []).append(rates[-1])
        ttfts.append(times[0] - t)
        gaps += [b - a for a, b in zip(times, times[1:])]
    res.update(single_tok_s=median(rates), single_best_tok_s=max(rates), single_ttft_ms=ms(median(ttfts)),
               single_itl_p50_ms=ms(pct(gaps, 0.5)), single_itl_p99_ms=ms(pct(gaps, 0.99)))
    print("[hf] batch of 8 (left padding)", file=sys.stderr, flush=True)
    t, times, _ = gen(PROMPTS, n)
    gaps = [b - a for a, b in zip(times, times[1:])]
    res.update(conc8_tok_s=8 * n / (times[-1] - t), conc8_ttft_p50_ms=ms(times[0] - t),
               conc8_ttft_p99_ms=ms(times[0] - t), conc8_itl_p50_ms=ms(pct(gaps, 0.5)),
               conc8_itl_p99_ms=ms(pct(gaps, 0.99)))
    print("[hf] 512-token prompt (generate with max_new_tokens=1)", file=sys.stderr, flush=True)
    ttfts = []
    for text in spec["long"]:
        t, times, plen = gen([text], 1)
        ttfts.append(times[0] - t)
    res.update(ttft512_ms=ms(median(ttfts)), ttft512_prompt_tokens=plen)
    res["peak_rss_mb"] = vm_hwm_mb(os.getpid())
    return res


def run_hf(model_dir: Path, plan: Plan, logdir: Path) -> dict:
    spec = {"model_dir": str(model_dir), "tokens": plan.tokens, "reps": plan.single_reps, "long": plan.long,
            "warm_long": plan.warm_long}
    spec_path = logdir / "hf-spec.json"
    spec_path.write_text(json.dumps(spec))
    r = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--hf-worker", str(spec_path)],
                       stdout=subprocess.PIPE, stderr=None, text=True, cwd=ROOT, env=ENV)
    if r.returncode != 0:
        raise RuntimeError(f"transformers worker exited with status {r.returncode}")
    return json.loads(r.stdout.strip().splitlines()[-1])


# -- the table --------------------------------------------------------------------------------

# (key, label, unit, better): better is "higher" or "lower"; a ratio is always caldrix / peer.
ROWS = [
    ("single_tok_s", "single stream tok/s (median run)", "tok/s", "higher"),
    ("single_best_tok_s", "single stream tok/s (best run)", "tok/s", "higher"),
    ("single_mb1_tok_s", "single stream tok/s (median), caldrix --max-batch 1", "tok/s", "higher"),
    ("single_spec_tok_s", "single stream tok/s (median), caldrix --max-batch 1 --speculate ngram", "tok/s", "higher"),
    ("single_ttft_ms", "single stream TTFT", "ms", "lower"),
    ("single_itl_p50_ms", "single stream ITL p50", "ms", "lower"),
    ("single_itl_p99_ms", "single stream ITL p99", "ms", "lower"),
    ("conc8_tok_s", "8 streams aggregate tok/s", "tok/s", "higher"),
    ("conc8_ttft_p50_ms", "8 streams TTFT p50", "ms", "lower"),
    ("conc8_ttft_p99_ms", "8 streams TTFT p99", "ms", "lower"),
    ("conc8_itl_p50_ms", "8 streams ITL p50", "ms", "lower"),
    ("conc8_itl_p99_ms", "8 streams ITL p99", "ms", "lower"),
    ("ttft512_ms", "512-token prompt TTFT", "ms", "lower"),
    ("mix_itl_p50_ms", "mixed: running streams ITL p50", "ms", "lower"),
    ("mix_itl_p99_ms", "mixed: running streams ITL p99", "ms", "lower"),
    ("mix_itl_ratio", "mixed: ITL p99/p50", "x", "lower"),
    ("mix_itl_max_ms", "mixed: ITL max", "ms", "lower"),
    ("mix_long_ttft_ms", "mixed: 512-token prompt TTFT", "ms", "lower"),
]
TRACE_ROWS = [("tok_s", "tok/s", "tok/s", "higher"), ("ttft_p50_ms", "TTFT p50", "ms", "lower"),
              ("ttft_p99_ms", "TTFT p99", "ms", "lower"), ("e2e_p50_ms", "e2e p50", "ms", "lower"),
              ("e2e_p99_ms", "e2e p99", "ms", "lower")]
PEAK_ROW = ("peak_rss_mb", "peak RSS (VmHWM)", "MiB", "lower")
PEERS = [("caldrix", "caldrix"), ("llama", "llama.cpp"), ("hf", "transformers")]


def all_rows(traces: list[Path]) -> list[tuple[str, str, str, str]]:
    rows = list(ROWS)
    for p in traces:
        rows += [(f"trace_{p.stem}_{k}", f"trace {p.stem}: {label}", unit, better) for k, label, unit, better in TRACE_ROWS]
    return rows + [PEAK_ROW]


def fmt(v, unit: str) -> str:
    if v is None:
        return "-"
    if unit == "x":
        return f"{v:.2f}"
    if unit == "ms":
        return f"{v:.1f}" if v < 100 else f"{v:.0f}"
    return f"{v:.1f}"


def row_label(label: str, unit: str) -> str:
    return label if re.search(rf"(^|\s){re.escape(unit)}(\s|$)", label) else f"{label} ({unit})"


def table(results: dict, na: dict, traces: list[Path]) -> str:
    rows = all_rows(traces)
    w0 = max(len(row_label(label, unit)) for _, label, unit, _ in rows) + 2
    head = f"{'':{w0}}" + "".join(f"{name:>14}" for _, name in PEERS) + f"{'cx/llama':>10}{'cx/tf':>8}  better"
    lines = [head, "-" * len(head)]
    for key, label, unit, better in rows:
        vals = [results.get(p, {}).get(key) for p, _ in PEERS]
        cells = []
        for (p, _), v in zip(PEERS, vals):
            cells.append(f"{'n/a' if p in na else fmt(v, unit):>14}")
        c = vals[0]
        ratios = []
        for v in vals[1:]:
            ratios.append("-" if (c is None or v in (None, 0)) else f"{c / v:.2f}")
        if not any(v is not None for v in vals):
            continue
        lines.append(f"{row_label(label, unit):{w0}}" + "".join(cells) + f"{ratios[0]:>10}{ratios[1]:>8}  {better}")
    for p, name in PEERS:
        if p in na:
            lines.append(f"n/a {name}: {na[p]}")
    return "\n".join(lines)


# -- main -------------------------------------------------------------------------------------


def main() -> int:
    ap = argparse.ArgumentParser(description="caldrix serve against llama-cpp-python's server and transformers generate")
    ap.add_argument("--quick", action="store_true", help="32 tokens a stream, one run each, short traces, no --max-batch 1 server")
    ap.add_argument("--json", metavar="PATH", default=None, help="also write every number to PATH as JSON")
    ap.add_argument("--skip", default="", help="comma list of: caldrix, mb1, spec, llama, hf")
    ap.add_argument("--caldrix-flags", default="", help='extra caldrix serve flags, e.g. "--prefill-chunk 32"')
    ap.add_argument("--llama-wait-policy", choices=["default", "active", "passive"], default="default",
                    help="OMP_WAIT_POLICY for llama-cpp-python's server: default (as this shell has it), "
                         "active or passive; see docs/performance.md")
    ap.add_argument("--rebuild-llama", action="store_true", help="retry a llama-cpp-python build that failed before")
    ap.add_argument("--hf-worker", metavar="SPEC", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    CALDRIX_FLAGS.extend(args.caldrix_flags.split())
    if args.hf_worker:
        print(json.dumps(hf_worker(json.loads(Path(args.hf_worker).read_text()))))
        return 0
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}

    import logging

    logging.getLogger("httpx").setLevel(logging.WARNING)
    from caldrix.models.gguf import convert
    from caldrix.models.source import embedded_gguf

    gguf = embedded_gguf()
    started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    meta: dict = {"date": started, "loadavg_start": loadavg(), "quick": args.quick, "gguf": str(gguf),
                  "context": CONTEXT, "threads": THREADS, "cpu": cpu_name(), "cores": os.cpu_count(),
                  "python": platform.python_version(), "loadavg": {}, "steal_pct": {},
                  "llama_wait_policy": args.llama_wait_policy, "omp_wait_policy_env": ENV.get("OMP_WAIT_POLICY")}
    progress(f"model {gguf.name}; load average {meta['loadavg_start']}; {'quick' if args.quick else 'full'} run")
    model_dir = convert(gguf)
    traces = sorted((ROOT / "traces").glob("*.jsonl"))
    plan = Plan(args.quick, Words(model_dir / "tokenizer.json"), traces)
    meta["tokens"] = plan.tokens
    results: dict[str, dict] = {}
    na: dict[str, str] = {}
    notes: list[str] = []
    logdir = Path(tempfile.mkdtemp(prefix="caldrix-bench-"))
    meta["logs"] = str(logdir)

    # llama-cpp-python's install first: a build must not run while anything is being timed.
    llama_version = None
    if "llama" in skip:
        na["llama"] = "skipped (--skip llama)"
    else:
        llama_version, why = ensure_llama_venv(gguf, args.rebuild_llama)
        if not llama_version:
            na["llama"] = why
    meta["llama_cpp_python"] = llama_version

    if "caldrix" in skip:
        na["caldrix"] = "skipped (--skip caldrix)"
    else:
        phase(meta, "caldrix")
        try:
            import caldrix

            meta["caldrix"] = caldrix.__version__
            progress("caldrix serve --max-batch 8: starting")
            srv = start_caldrix(gguf, 8, logdir)
            try:
                run_http(srv, plan, results.setdefault("caldrix", {}))
            finally:
                results.setdefault("caldrix", {})["peak_rss_mb"] = srv.stop()
            if not args.quick and "mb1" not in skip:
                progress("caldrix serve --max-batch 1: starting")
                srv = start_caldrix(gguf, 1, logdir)
                try:
                    r1 = run_http(srv, plan, {}, single_only=True)
                    results["caldrix"]["single_mb1_tok_s"] = r1["single_tok_s"]
                    results["caldrix"]["mb1"] = r1
                finally:
                    results["caldrix"]["mb1_peak_rss_mb"] = srv.stop()
            if not args.quick and "spec" not in skip:
                progress("caldrix serve --max-batch 1 --speculate ngram: starting")
                srv = start_caldrix(gguf, 1, logdir, ("--speculate", "ngram"), "-ngram")
                try:
                    r2 = run_http(srv, plan, {}, single_only=True)
                    results["caldrix"]["single_spec_tok_s"] = r2["single_tok_s"]
                    results["caldrix"]["spec"] = r2
                    if "single_spec_proposed" in r2:
                        same = "mb1" in results["caldrix"] and r2["single_ids"] == results["caldrix"]["mb1"]["single_ids"]
                        notes.append(f"caldrix --speculate ngram, single stream: {r2['single_spec_accepted']} of "
                                     f"{r2['single_spec_proposed']} guesses accepted over {plan.single_reps} x "
                                     f"{plan.tokens} tokens; the same tokens as --max-batch 1 without it: "
                                     f"{'yes' if same else 'NO' if 'mb1' in results['caldrix'] else 'not compared'}")
                finally:
                    results["caldrix"]["spec_peak_rss_mb"] = srv.stop()
        except Exception as exc:  # noqa: BLE001 -- a peer that fails is a column of n/a, not a crash
            failed("caldrix", exc, results, na, notes)

    if "llama" not in na:
        phase(meta, "llama")
        try:
            progress(f"llama-cpp-python {llama_version} server: starting")
            srv = start_llama(gguf, logdir, args.llama_wait_policy)
            try:
                run_http(srv, plan, results.setdefault("llama", {}))
            finally:
                results.setdefault("llama", {})["peak_rss_mb"] = srv.stop()
        except Exception as exc:  # noqa: BLE001
            failed("llama", exc, results, na, notes)

    if "hf" in skip:
        na["hf"] = "skipped (--skip hf)"
    else:
        phase(meta, "hf")
        try:
            progress("transformers generate (own process)")
            results["hf"] = run_hf(model_dir, plan, logdir)
            meta["hf_dtype"] = results["hf"].get("dtype")
        except Exception as exc:  # noqa: BLE001
            failed("hf", exc, results, na, notes)

    phase(meta, None)
    meta["loadavg_end"] = loadavg()
    meta["wall_s"] = round(time.monotonic() - T0, 1)
    text = table(results, na, traces)
    print(f"\ncaldrix serving benchmark, {gguf.name}, {plan.tokens} greedy tokens a stream, {THREADS} threads, "
          f"context {CONTEXT}; {started}")
    print(f"machine: {meta['cpu']}, {meta['cores']} cores; load average (1, 5, 15 min) {meta['loadavg_start']} "
          f"at start, {meta['loadavg_end']} at end")
    names = dict(PEERS)
    print("per peer: 1-min load average as it started, CPU steal while it ran: " + ", ".join(
        f"{names[p]} {la[0]:.2f} / {meta['steal_pct'].get(p, '-')}%" for p, la in meta["loadavg"].items()))
    print(f"versions: caldrix {meta.get('caldrix')}, llama-cpp-python {llama_version or 'n/a'}, "
          f"transformers dtype {meta.get('hf_dtype', 'n/a')}; OMP_WAIT_POLICY for llama.cpp: "
          f"{args.llama_wait_policy if args.llama_wait_policy != 'default' else ENV.get('OMP_WAIT_POLICY', 'unset')}; "
          f"wall {meta['wall_s']:.0f} s\n")
    print(text)
    runs = {name: [round(x, 1) for x in results.get(p, {}).get("single_runs_tok_s") or ()] for p, name in PEERS}
    for note in notes:
        print(note)
    print("single stream runs, tok/s: "
          + "; ".join(f"{name} {v}" for name, v in runs.items() if v))
    rounds = {name: [round(x, 2) for x in results.get(p, {}).get("mix_itl_ratio_rounds") or ()] for p, name in PEERS}
    print("mixed rounds, ITL p99/p50 of each (the row above pools them): "
          + "; ".join(f"{name} {v}" for name, v in rounds.items() if v))
    print("\nratios are caldrix / peer; 'better' says which way is good for caldrix on that row. "
          "llama-cpp-python's server runs one request at a time; transformers has no server (no traces, no mixed row).")
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": meta, "results": results, "na": na, "notes": notes}, indent=1))
        progress(f"wrote {args.json}")
    return 0


def cpu_ticks() -> list[int]:
    """/proc/stat's first line: user nice system idle iowait irq softirq steal ..."""
    try:
        return [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    except (OSError, ValueError, IndexError):
        return []


def failed(peer: str, exc: BaseException, results: dict, na: dict, notes: list[str]) -> None:
    """A peer that fails is a column of n/a (or, after some workloads, a note), not a crash."""
    while getattr(exc, "exceptions", None):  # an exception group: trio wraps a nursery's errors
        exc = exc.exceptions[0]
    why = f"{type(exc).__name__}: {exc}"[:400]
    progress(f"{dict(PEERS)[peer]} failed: {why}")
    if results.get(peer, {}).get("single_tok_s") is None:
        na[peer] = why
    else:
        notes.append(f"{dict(PEERS)[peer]} stopped part-way, later rows missing: {why}")


def phase(meta: dict, name: str | None) -> None:
    """Close the phase running (its CPU steal %), open `name` (its load average at the start)."""
    prev, ticks = meta.pop("_phase", None), cpu_ticks()
    if prev and len(prev[1]) > 7 and len(ticks) > 7:
        total = sum(ticks[:8]) - sum(prev[1][:8])
        meta["steal_pct"][prev[0]] = round(100.0 * (ticks[7] - prev[1][7]) / total, 1) if total > 0 else None
    if name is not None:
        meta["loadavg"][name] = loadavg()
        meta["_phase"] = (name, ticks)


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown cpu"


if __name__ == "__main__":
    sys.exit(main())
