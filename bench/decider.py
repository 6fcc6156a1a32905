"""The decider reading at decider-0.8b's shape: the state read once, through a real server.

    nice .venv/bin/python bench/decider.py [--state 2000] [--questions 10] [--reference-prompts 10]

The random 0.8b-shaped Qwen3.5 checkpoint of bench/qwen3_5.py (built there once, reused), given
the rebuilt Qwen3.5 tokenizer (tests/qwen35_tokenizer.py) and a decider_config.json in a
directory of links, is served by `caldrix serve --max-batch 1 --dtype DTYPE` (--dtype, float32 by
default: the precision the answers are checked in). Timed, over HTTP:

- a 1-question request over a --state-token state (every prompt of it read whole: one prompt);
- a --questions-question request over the same state (the state read once, each later prompt
  from the kept state);
- transformers (the same dtype, its torch fallbacks) reading each prompt of the many-question request
  whole, as a server without state reuse would: one forward per prompt, logits of the last row
  only. --reference-prompts N times the first N prompts and scales the sum to all of them (the
  prompts differ only in their question, so each costs about the same); the output says so.

Targets (issue 27): many/one at most 1.4x; transformers/many at least 5x.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# This file's folder leaves the path: its name would hide decider-ai's `decider` package.
sys.path = [p for p in sys.path if Path(p or ".").resolve() != ROOT / "bench"]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))


def _bench_qwen3_5():
    """bench/qwen3_5.py (the shape and the builder), loaded by its path."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_qwen3_5", ROOT / "bench" / "qwen3_5.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod

WORDS = ("order", "refund", "parcel", "invoice", "delay", "customer", "charged", "twice", "account", "login",
         "shipping", "address", "payment", "card", "support", "ticket", "reply", "week", "problem", "again")


def progress(msg: str) -> None:
    print(f"[decider bench] {msg}", file=sys.stderr, flush=True)


def model_dir(base: Path) -> Path:
    """The 0.8b-shaped checkpoint with a tokenizer and a decider_config.json, as links."""
    from qwen35_tokenizer import qwen35_tokenizer_dir

    if not (base / "config.json").exists():
        progress(f"building the random 0.8b-shaped checkpoint in {base}")
        _bench_qwen3_5().make(base)
    out = base.parent / (base.name + "-decider")
    out.mkdir(exist_ok=True)
    for f in list(base.glob("*.json")) + list(base.glob("*.safetensors")):
        if f.name.startswith("result-"):
            continue
        link = out / f.name
        if not link.exists():
            link.symlink_to(f)
    tok = qwen35_tokenizer_dir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        link = out / name
        if not link.exists():
            link.symlink_to(tok / name)
    (out / "decider_config.json").write_text(json.dumps({"temperature": 1.0, "neutralize_none": False}))
    return out


def make_state(tok, tokens: int) -> str:
    """Words whose "Context:\\n" + text is about `tokens` tokens."""
    rng = random.Random(0)
    words = [rng.choice(WORDS) for _ in range(tokens)]
    while len(tok("Context:\n" + " ".join(words), add_special_tokens=False)["input_ids"]) > tokens:
        words.pop()
    return " ".join(words)


def questions(n: int) -> dict:
    teams = {"billing": "payments and refunds", "shipping": "deliveries", "technical": "logins and bugs",
             "other": None}
    return {f"q{i}": {"type": "choice", "instructions": f"Question {i}: which team should handle this?",
                      "criteria": teams} for i in range(n)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_and_time(path: Path, state: str, n: int, repeat: int, dtype: str) -> dict:
    import httpx

    port = free_port()
    log = open(path / "server.log", "w")  # a file: a pipe nobody reads could fill and stall the server
    proc = subprocess.Popen([sys.executable, "-m", "caldrix", "serve", str(path), "--port", str(port),
                             "--dtype", dtype, "--max-batch", "1", "--context", "8192"],
                            cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stderr=log, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                name = httpx.get(url + "/v1/models", timeout=5).json()["data"][0]["id"]
                break
            except (httpx.HTTPError, KeyError, ValueError):
                if proc.poll() is not None:
                    raise SystemExit((path / "server.log").read_text())
                time.sleep(1)
        post = lambda body: httpx.post(url + "/v1/systemone", json=body, timeout=3600)  # noqa: E731
        progress("warm-up")
        post({"model": name, "state": "short", "questions": questions(2)}).raise_for_status()
        out = {}
        for label, k in (("one", 1), ("many", n)):
            times = []
            for _ in range(repeat):
                progress(f"{k}-question request over the state")
                t = time.perf_counter()
                r = post({"model": name, "state": state, "questions": questions(k)})
                times.append(time.perf_counter() - t)
                r.raise_for_status()
            out[label] = dict(seconds=min(times), all=times, input_tokens=r.json()["usage"]["input_tokens"])
        return out
    finally:
        proc.terminate()
        proc.wait(60)
        log.close()


def transformers_time(path: Path, state: str, n: int, first: int, dtype: str) -> dict:
    import torch
    from decider import prompt_fast, systemone
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    rqs = {k: systemone.render_question(v) for k, v in questions(n).items()}
    flat, _ = systemone.plan_rows(rqs, False)
    items, ctx = prompt_fast.build_rows(tok, systemone.render_state(state),
                                        [[(r["question"], list(r["options"]))] for r in flat], max_ctx_tokens=1 << 30)
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=getattr(torch, dtype)).eval()
    times = []
    with torch.inference_mode():
        model(input_ids=torch.tensor([items[0]["ids"][:16]]), logits_to_keep=1)  # warm-up
        for it in items[:first]:
            progress(f"transformers: prompt of {len(it['ids'])} tokens")
            t = time.perf_counter()
            model(input_ids=torch.tensor([it["ids"]]), logits_to_keep=1)
            times.append(time.perf_counter() - t)
    return dict(seconds=sum(times) * len(items) / len(times), measured=len(times), prompts=len(items),
                tokens=sum(len(it["ids"]) for it in items), state_tokens=ctx)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--state", type=int, default=2000, help="state tokens, with its Context: line")
    ap.add_argument("--questions", type=int, default=10)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--reference-prompts", type=int, default=0, help="transformers prompts timed (0: all)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--dir", default=str(Path.home() / ".cache" / "caldrix" / "bench-qwen3_5-0.8b-random"))
    args = ap.parse_args()
    from transformers import AutoTokenizer

    path = model_dir(Path(args.dir))
    state = make_state(AutoTokenizer.from_pretrained(str(path)), args.state)
    ours = serve_and_time(path, state, args.questions, args.repeat, args.dtype)
    ref = transformers_time(path, state, args.questions, args.reference_prompts or args.questions, args.dtype)
    one, many = ours["one"], ours["many"]
    import torch

    print(f"decider reading, Qwen3.5 0.8b shape, random weights, {args.dtype}, {torch.get_num_threads()} threads; "
          f"state {ref['state_tokens']} tokens, {args.questions} questions")
    print(f"caldrix, 1 question:   {one['seconds']:8.2f} s  (input_tokens {one['input_tokens']})")
    print(f"caldrix, {args.questions} questions: {many['seconds']:8.2f} s  (input_tokens {many['input_tokens']}; "
          f"ratio to 1 question {many['seconds'] / one['seconds']:.2f}x, target <= 1.4x)")
    scaled = "" if ref["measured"] == ref["prompts"] else f", {ref['measured']} of {ref['prompts']} timed and scaled"
    print(f"transformers, each prompt whole: {ref['seconds']:8.2f} s  ({ref['tokens']} tokens{scaled}; "
          f"{ref['seconds'] / many['seconds']:.2f}x caldrix's, target >= 5x)")


if __name__ == "__main__":
    main()
