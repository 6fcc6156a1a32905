"""Decode throughput: caldrix's engine against transformers generate, same model, one run.

    .venv/bin/python bench/decode.py [--model MODEL] [--tokens 128] [--dtype auto] [--threads N]
        [--weights auto|dense|q4] [--skip-hf]

Prints single-stream greedy tok/s and aggregate tok/s at 8 concurrent sequences for both, and
their ratios. The caldrix numbers go through the real scheduler and engine (steps inline, no
HTTP), so they measure the engine and the step loop; the HTTP benchmark is bench/serve.py.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
# No OMP_WAIT_POLICY here, unlike the server (caldrix/cli.py): PASSIVE makes transformers
# 2-3x slower on a quiet machine, and caldrix's engine measured the same either way.

import torch  # noqa: E402
import trio  # noqa: E402

from caldrix.engine import Engine, resolve_dtype  # noqa: E402
from caldrix.protocol import SamplingParams, Submission  # noqa: E402
from caldrix.sched.loop import Scheduler  # noqa: E402
from caldrix.sched.policy import Policy  # noqa: E402
from caldrix.sched.slots import SlotTable  # noqa: E402
from caldrix.weights.source import resolve  # noqa: E402

from prompts import PROMPTS  # noqa: E402  (bench/prompts.py, shared by the benchmarks)


def progress(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def caldrix_run(engine: Engine, prompts: list[list[int]], n: int) -> float:
    """Seconds to decode n tokens for every prompt at once (prefill included)."""

    async def inline(fn, batch):
        await trio.lowlevel.checkpoint()
        return fn(batch)

    async def main():
        sched = Scheduler(engine, Policy(SlotTable(engine.max_batch), chunk=256, prefill_budget=256), run_step=inline)
        tx, rx = trio.open_memory_channel(len(prompts))
        streams = []
        for i, ids in enumerate(prompts):
            etx, erx = trio.open_memory_channel(n + 1)
            tx.send_nowait(Submission(f"b{i}", tuple(ids), n, SamplingParams(), frozenset(), etx))
            streams.append(erx)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(sched.run, rx)
            for erx in streams:
                assert len([e async for e in erx]) == n
            await tx.aclose()

    t = time.perf_counter()
    trio.run(main)
    return time.perf_counter() - t


def hf_run(model, tok, prompts: list[str], n: int) -> float:
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    enc = tok(prompts, return_tensors="pt", padding=True)
    t = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(**enc, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=tok.pad_token_id)
    dt = time.perf_counter() - t
    assert out.shape[1] - enc["input_ids"].shape[1] == n
    return dt


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--weights", choices=["auto", "dense", "q4"], default="auto", help="as caldrix serve --weights")
    ap.add_argument("--skip-hf", action="store_true")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    default_threads = torch.get_num_threads()
    src = resolve(args.model)
    dtype = resolve_dtype(args.dtype, "cpu")
    n = args.tokens
    from caldrix.weights.gguf import source_gguf

    int4 = source_gguf(src.path) if args.weights in ("auto", "q4") and dtype is torch.bfloat16 else None
    quantize = args.weights == "q4" and int4 is None  # a Hugging Face directory rounded at load
    weights = "int4 GGUF blocks" if int4 else "4-bit groups made at load (--weights q4)" if quantize else "dense"
    progress(f"model {src.served_name}, dtype {dtype}, {weights}, {torch.get_num_threads()} threads, {n} tokens")

    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(src.path))
    ids = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True) for p in PROMPTS]
    ids = [list(x["input_ids"]) if hasattr(x, "keys") else list(x) for x in ids]
    texts = [tok.decode(x) for x in ids]
    rows: list[tuple[str, float, float]] = []

    e1 = Engine.load(src.path, dtype=dtype, max_batch=1, context=1024, int4_from=int4, quantize=quantize)
    caldrix_run(e1, ids[:1], 8)  # warm-up
    progress("caldrix single stream")
    c1 = n / caldrix_run(e1, ids[:1], n)
    del e1
    e8 = Engine.load(src.path, dtype=dtype, max_batch=8, context=1024, int4_from=int4, quantize=quantize)
    caldrix_run(e8, ids, 8)
    progress("caldrix 8 streams")
    c8 = 8 * n / caldrix_run(e8, ids, n)
    del e8

    # transformers at torch's default thread count (what a user gets) and at one thread (its
    # best here); the caldrix engine picks its own count per step, so reset it first.
    hf: dict[int, tuple[float, float]] = {}
    if not args.skip_hf:
        model = AutoModelForCausalLM.from_pretrained(str(src.path), dtype=dtype).eval()
        for threads in sorted({default_threads, 1}, reverse=True):
            torch.set_num_threads(threads)
            hf_run(model, tok, texts[:1], 8)
            progress(f"transformers generate, {threads} threads, single stream")
            h1 = n / hf_run(model, tok, texts[:1], n)
            progress(f"transformers generate, {threads} threads, batch of 8")
            hf[threads] = (h1, 8 * n / hf_run(model, tok, texts, n))

    print(f"\n{src.served_name} decode, {n} greedy tokens, dtype {str(dtype).removeprefix('torch.')}, {weights}, "
          f"OMP_WAIT_POLICY {os.environ.get('OMP_WAIT_POLICY', 'unset')}, load average {os.getloadavg()[0]:.1f}")
    cols = "".join(f"{f'hf {t}T':>10}{'ratio':>7}" for t in hf)
    print(f"{'':28}{'caldrix':>10}{cols}")
    for label, ours, i in (("single stream tok/s", c1, 0), ("8 streams aggregate tok/s", c8, 1)):
        cells = "".join(f"{v[i]:10.1f}{ours / v[i]:7.2f}" for v in hf.values())
        print(f"{label:28}{ours:10.1f}{cells}")
    print(f"{'caldrix 8 streams / single':28}{c8 / c1:10.2f}")


if __name__ == "__main__":
    main()
