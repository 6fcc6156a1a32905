"""/v1/systemone: three questions over a ~1,000-token state against the same request with one.

    .venv/bin/python bench/systemone.py [--runs 3] [--model DIR] [-- extra serve flags]

Starts `caldrix serve` (the embedded default model unless --model; --max-batch 1, the route's
requirement) on a free port and times, over HTTP, a request holding the three questions of
http-api.md's example (a choice, a noul and a score) against the same request holding only the
choice. Every request gets a state of its own (a run number leads it), so no request reuses
another's state rows; within the three-question request the second and third questions reuse
the rows of the first (held rows), which is what the ratio measures. Printed: each request's
median wall time over --runs, the input tokens, the prefix rows reused, and the ratio
(target: at most 1.5).
"""

from __future__ import annotations

import argparse
import re
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

QUESTIONS = {
    "team": {"type": "choice", "instructions": "Which team should handle this message?",
             "criteria": {"billing": "payments, refunds and invoices", "shipping": "deliveries, tracking and lost parcels",
                          "technical": "bugs, crashes and login problems"}},
    "angry": {"type": "noul", "instructions": "Is the customer angry?"},
    "urgency": {"type": "score", "instructions": "How urgent is the message?",
                "criteria": ["not urgent", "somewhat urgent", "very urgent"]},
}


def state(run: int) -> str:
    """About 1,000 tokens of SmolLM2's tokenizer: an order history, led by the run number."""
    lines = [f"Run {run}. Customer message: I was charged twice for my order last week and I want one of the "
             "payments back. Order history follows."]
    for i in range(40):
        lines.append(f"Order {1000 + i}: {i % 7 + 1} items, shipped to Lyon, paid {12 + i * 3} euros by card.")
    return "\n".join(lines)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--model", default=None)
    ap.add_argument("serve_flags", nargs="*")
    args = ap.parse_args()
    port = free_port()
    cmd = [sys.executable, "-m", "caldrix", "serve", *([args.model] if args.model else []), "--port", str(port),
           "--max-batch", "1", *args.serve_flags]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parent.parent)
    try:
        for line in proc.stderr:
            sys.stderr.write(line)
            if re.search(r"caldrix: listening on", line):
                break
        else:
            print("the server exited before it was ready", file=sys.stderr)
            return 1
        url = f"http://127.0.0.1:{port}"
        name = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        run = iter(range(10**6))

        def once(questions: dict) -> tuple[float, dict, list[int]]:
            body = {"model": name, "state": state(next(run)), "questions": questions}
            t0 = time.perf_counter()
            r = httpx.post(url + "/v1/systemone", json=body, timeout=600)
            wall = time.perf_counter() - t0
            r.raise_for_status()
            recs = httpx.get(url + "/debug/requests", params={"last": len(questions)}).json()["data"]
            return wall, r.json(), [rec["prefix_rows"] for rec in recs]

        one = {"team": QUESTIONS["team"]}
        once(QUESTIONS)  # warm-up: first-use costs (label ids, kernels) stay out of the timings
        once(one)
        three_t, one_t = [], []
        for _ in range(args.runs):  # interleaved, so a load change on the machine hits both
            w, r3, prefix3 = once(QUESTIONS)
            three_t.append(w)
            w, r1, prefix1 = once(one)
            one_t.append(w)
        t3, t1 = statistics.median(three_t), statistics.median(one_t)
        print(f"3 questions: {t3 * 1000:.0f} ms median of {args.runs} ({', '.join(f'{t * 1000:.0f}' for t in three_t)}),"
              f" input_tokens {r3['usage']['input_tokens']}, prefix rows reused per question {prefix3}")
        print(f"1 question:  {t1 * 1000:.0f} ms median of {args.runs} ({', '.join(f'{t * 1000:.0f}' for t in one_t)}),"
              f" input_tokens {r1['usage']['input_tokens']}, prefix rows reused {prefix1}")
        print(f"ratio 3/1: {t3 / t1:.2f} (target <= 1.5)")
        return 0
    finally:
        proc.terminate()
        proc.wait(timeout=60)


if __name__ == "__main__":
    raise SystemExit(main())
