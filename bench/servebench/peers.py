"""The peers the serving benchmark runs: caldrix and llama-cpp-python's servers as processes,
llama-cpp-python's own venv, and transformers generate in a child process."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from prompts import PROMPTS  # bench/prompts.py, shared by the benchmarks
from servebench.common import (BENCH_VENV, BUILD_FAILED, BUILD_LOG, CONTEXT, ENV, LISTENING, LLAMA_SPEC,
                               NO_AMX_CMAKE_ARGS, ROOT, THREADS, free_port, median, ms, pct, progress, vm_hwm_mb)


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
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "serve.py"), "--hf-worker", str(spec_path)],
                       stdout=subprocess.PIPE, stderr=None, text=True, cwd=ROOT, env=ENV)
    if r.returncode != 0:
        raise RuntimeError(f"transformers worker exited with status {r.returncode}")
    return json.loads(r.stdout.strip().splitlines()[-1])


