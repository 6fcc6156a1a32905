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
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

from servebench.common import CONTEXT, ENV, ROOT, T0, THREADS, cpu_name, loadavg, progress
from servebench.peers import CALDRIX_FLAGS, ensure_llama_venv, hf_worker, run_hf, start_caldrix, start_llama
from servebench.report import PEERS, failed, phase, table
from servebench.workloads import Plan, Words, run_http


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
    from caldrix.weights.gguf import convert
    from caldrix.weights.source import embedded_gguf

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


if __name__ == "__main__":
    sys.exit(main())
