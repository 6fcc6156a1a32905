"""Speculative decoding against plain decoding, single stream, on the embedded SmolLM2.

Each configuration is loaded as `caldrix serve` loads it (runtime.load_runtime: the same flags,
the same start-up probes) and its scheduler is driven in-process, one greedy request after
another, so the figures are the engine's and the scheduler's without HTTP. Reported per row:
tokens per second of reply (prompt time included: the same prompts either way), the ratio to
the plain row of the same target, guesses proposed and kept, and whether every reply was token
for token the plain reply.

The workload asks for replies that quote their prompt (rewrite code with one change, fix the
typos in a paragraph), where speculation is meant to pay.

    PYTHONPATH=$PWD python bench/speculate.py [--max-tokens 160] [--rows ngram,draft]
"""

from __future__ import annotations

import argparse
import sys
import time

import trio

CODE = '''def mean(values):
    total = 0
    for v in values:
        total += v
    return total / len(values)


def variance(values):
    m = mean(values)
    total = 0
    for v in values:
        total += (v - m) ** 2
    return total / len(values)
'''
TYPOS = ("The quick brown fox jumpd over the lazy dog. It was a sunny day and the fox was verry happy. "
         "After the jump, the fox ran into the forrest to find its freinds, who were waiting by the river.")
PROMPTS = [
    f"Rewrite this code with one change: rename the variable total to acc.\n\n{CODE}",
    f"Fix the typos in this paragraph and write it out again:\n\n{TYPOS}",
    f"Rewrite this code with one change: add a docstring to mean.\n\n{CODE}",
    f"Copy this paragraph, fixing its spelling:\n\n{TYPOS}",
]


def measure(rt, prompts, max_tokens):
    """Greedy replies of `prompts`, one after another: (replies, tokens, seconds, proposed, kept)."""
    from caldrix.protocol import SamplingParams, Submission

    async def main():
        sched = rt.scheduler
        tx, rx = trio.open_memory_channel(1)
        out, seconds, proposed, kept = [], 0.0, 0, 0
        async with trio.open_nursery() as nursery:
            nursery.start_soon(sched.run, rx)
            for text in prompts:
                ids = tuple(rt.tokenizer.render_chat([{"role": "user", "content": text}]))
                etx, erx = trio.open_memory_channel(max_tokens + 1)
                t0 = time.perf_counter()
                await tx.send(Submission("b", ids, max_tokens, SamplingParams(), frozenset(rt.tokenizer.eos_token_ids), etx))
                events = [e async for e in erx]
                seconds += time.perf_counter() - t0
                out.append([e.token_id for e in events if e.token_id is not None])
                if events[-1].speculative:
                    proposed += events[-1].speculative[0]
                    kept += events[-1].speculative[1]
            await tx.aclose()
        return out, sum(map(len, out)), seconds, proposed, kept

    return trio.run(main)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--rows", default="ngram,draft")
    ap.add_argument("--dense-dtype", default="bfloat16",
                    help="the draft pair's target dtype (float32 where this CPU's probe lets it verify)")
    args = ap.parse_args()

    from caldrix.config import ServeConfig
    from caldrix.runtime import load_runtime
    from caldrix.weights.source import resolve

    embedded = str(resolve(None, progress=False).path)
    base = dict(max_batch=1, context=2048)
    rows = []
    plan = []
    if "ngram" in args.rows:
        plan.append(("ngram", dict(), dict(speculate="ngram")))
    if "draft" in args.rows:
        dense = dict(weights="dense", dtype=args.dense_dtype)
        plan.append(("draft", dense, dict(dense, speculate="draft", draft=embedded)))
    warm = PROMPTS[:1]
    for name, plain_flags, spec_flags in plan:
        plain_rt = load_runtime(ServeConfig(**base, **plain_flags))
        measure(plain_rt, warm, 16)
        want, n0, s0, _, _ = measure(plain_rt, PROMPTS, args.max_tokens)
        del plain_rt
        spec_rt = load_runtime(ServeConfig(**base, **spec_flags))
        for note in spec_rt.notes:
            print(f"note: {note}", file=sys.stderr)
        measure(spec_rt, warm, 16)
        got, n1, s1, proposed, kept = measure(spec_rt, PROMPTS, args.max_tokens)
        rows.append((name, spec_rt.dtype_name, n0 / s0, n1 / s1, proposed, kept, got == want))
        del spec_rt
    print("| mode | target | plain tok/s | speculative tok/s | ratio | guesses kept | identical |")
    print("|---|---|---|---|---|---|---|")
    for name, dtype, plain, fast, proposed, kept, same in rows:
        target = "4-bit (default)" if name == "ngram" else f"dense {dtype}, draft: its 4-bit form"
        rate = f"{kept}/{proposed} ({kept / proposed:.0%})" if proposed else "0/0"
        print(f"| {name} | {target} | {plain:.1f} | {fast:.1f} | {fast / plain:.2f}x | {rate} | {same} |")


if __name__ == "__main__":
    main()
