"""The GPU lanes' checks, in one call on a lent GPU (issue 31). Never part of the test suite.

    PYTHONUNBUFFERED=1 python3 bench/gpu_check.py --out "$OUT"      # on the device machine

Self-contained: the model is a random llama of SmolLM2-135M's shape (seed 0, built with
transformers' config class and saved as safetensors in a temporary folder), since the device
machine reaches no network and the real weights are too big to carry. Checks, each recorded
as passed / failed / error (an exception, e.g. the engine's GPU wiring that is still pending):

  1. engine_greedy_parity: the caldrix engine on cuda in float32 gives the same greedy tokens
     as on the cpu lane in float32 (4 prompts, 24 tokens each).
  2. engine_batch_invariance: on cuda in bfloat16 at max-batch 8, each prompt's greedy tokens
     decoded beside 7 others equal those decoded alone.
  3. device_pick_reproducible: the device pick on GPU logits [8, V] gives the same tokens
     twice, row by row alone as in the batch, and the same as the same code on CPU tensors
     (counted: exp may differ by an ulp between the two, which moves a pick only at a
     boundary); its time per step beside the CPU pick's.
  4. weight_budget_streaming: transformers' model on the GPU with caldrix's LayerStreamer
     streaming the layers the planner picks for a budget of the non-layer weights plus a quarter
     of the layers' weights (a quarter of all weights is below what cannot stream for this
     shape: the embedding alone is 21%), against the same model wholly on the device: identical
     greedy tokens, and the device's weight bytes.
  5. engine_weight_budget: the same budget through the engine's own path (Engine.load with
     weight_budget, as `caldrix serve --backend cuda --weight-budget` runs it) against the
     engine with every weight on the device: identical greedy tokens at max-batch 4, and the
     peak device memory of each.
  6. throughput: decode tokens/s at 1 and 8 streams, the caldrix engine (bf16) beside
     transformers' generate() (bf16, greedy) on the same GPU.
  7. decode_step_profile: whether CUDA graphs would pay (issue 31 asks to measure first): per
     decode step at 1 and 8 streams, the wall time beside the time the GPU spent in kernels
     (torch.profiler), and the kernel launches. A GPU busy for a small share of the step is
     waiting on Python and launches, which a captured graph would remove.

Writes gpu_check.json and gpu_check.md to --out. Exit status: 0 all passed, 1 some check
failed or errored, 3 no GPU (the summary says so; nothing else ran).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

os.environ.setdefault("CALDRIX_NATIVE", "0")  # no C++ build for the cpu-lane reference run
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

PROMPT_LEN, NEW = 16, 24
SHAPE = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
             num_key_value_heads=3, vocab_size=49152, max_position_embeddings=2048, tie_word_embeddings=True,
             rms_norm_eps=1e-5, rope_theta=100000.0, initializer_range=0.08)


class Report:
    def __init__(self, out: Path, gpu: dict | None):
        self.out, self.data = out, {"gpu": gpu, "torch": torch.__version__, "checks": []}

    def add(self, name: str, status: str, **facts) -> None:
        self.data["checks"].append({"name": name, "status": status, **facts})
        print(f"gpu_check: {name}: {status} {json.dumps(facts, default=str)}", flush=True)
        self.write()

    def write(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "gpu_check.json").write_text(json.dumps(self.data, indent=1, default=str))
        lines = [f"# gpu_check on {self.data['gpu'] or 'no GPU'} (torch {self.data['torch']})", "",
                 "| check | status | facts |", "|---|---|---|"]
        for c in self.data["checks"]:
            facts = {k: v for k, v in c.items() if k not in ("name", "status", "trace")}
            lines.append(f"| {c['name']} | {c['status']} | {json.dumps(facts, default=str)} |")
        (self.out / "gpu_check.md").write_text("\n".join(lines) + "\n")


def run_check(rep: Report, name: str, fn) -> None:
    try:
        status, facts = fn()
    except Exception as exc:  # a check's failure must not stop the others
        status, facts = "error", {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-2000:]}
    rep.add(name, status, **facts)


# --- the model and its prompts ---------------------------------------------------------


def build_model(folder: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SHAPE)).float()
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def prompts(n: int) -> list[tuple[int, ...]]:
    g = torch.Generator().manual_seed(1)
    return [tuple(torch.randint(5, SHAPE["vocab_size"], (PROMPT_LEN,), generator=g).tolist()) for _ in range(n)]


def engine_greedy(engine, ps: list[tuple[int, ...]], n: int, together: bool) -> list[list[int]]:
    """Greedy replies straight through Engine.step: a prefill run per prompt, then one decode
    run per slot per step (all prompts in one batch when together, else one at a time)."""
    from caldrix.batch import Batch, Run

    def go(group: list[tuple[int, ...]]) -> list[list[int]]:
        out = engine.step(Batch(tuple(Run(s, 0, p, (len(p) - 1,)) for s, p in enumerate(group))))
        replies = [[r.token_ids[0]] for r in out.runs]
        for k in range(1, n):
            runs = tuple(Run(s, len(p) + k - 1, (replies[s][-1],), (0,)) for s, p in enumerate(group))
            out = engine.step(Batch(runs))
            for s, r in enumerate(out.runs):
                replies[s].append(r.token_ids[0])
        return replies

    if together:
        return go(ps)
    return [go([p])[0] for p in ps]


def hf_greedy(model, ids: tuple[int, ...], n: int, device) -> list[int]:
    from transformers import DynamicCache

    cache, out, step = DynamicCache(), [], torch.tensor([ids], device=device)
    with torch.inference_mode():
        for _ in range(n):
            logits = model(input_ids=step, past_key_values=cache, use_cache=True).logits[0, -1]
            out.append(int(torch.argmax(logits)))
            step = torch.tensor([[out[-1]]], device=device)
    return out


# --- the checks --------------------------------------------------------------------------


def check_parity(path: Path):
    from caldrix.engine import Engine

    ps = prompts(4)
    cpu = engine_greedy(Engine.load(path, dtype=torch.float32, max_batch=1, context=128, device="cpu"), ps, NEW, False)
    gpu = engine_greedy(Engine.load(path, dtype=torch.float32, max_batch=1, context=128, device="cuda"), ps, NEW, False)
    same = [a == b for a, b in zip(cpu, gpu)]
    first = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None) for a, b in zip(cpu, gpu)]
    return ("passed" if all(same) else "failed"), {"prompts_equal": same, "first_divergence": first}


def check_batch_invariance(path: Path):
    from caldrix.engine import Engine

    engine = Engine.load(path, dtype=torch.bfloat16, max_batch=8, context=128, device="cuda")
    ps = prompts(8)
    together = engine_greedy(engine, ps, NEW, True)
    alone = engine_greedy(engine, ps, NEW, False)
    same = [a == b for a, b in zip(together, alone)]
    return ("passed" if all(same) else "failed"), {"rows_equal": same}


def check_device_pick():
    from caldrix import sampler
    from caldrix.device_pick import device_pick
    from caldrix.protocol import SamplingParams

    g = torch.Generator().manual_seed(2)
    v = SHAPE["vocab_size"]
    logits = (torch.randn(8, v, generator=g) * 3).cuda()
    params = [SamplingParams(temperature=0.7 + 0.1 * i, top_k=(0, 40, 1000)[i % 3], top_p=(1.0, 0.9, 0.6)[i % 3],
                             min_p=(0.0, 0.02)[i % 2], repetition_penalty=(1.0, 1.2)[i % 2], seed=100 + i)
              for i in range(8)]
    seen = [torch.randint(0, v, (50,), generator=g) if p.repetition_penalty != 1 else None for p in params]
    idx = list(range(8))
    a = device_pick(logits, params, seen, idx)
    b = device_pick(logits, params, seen, idx)
    alone = [device_pick(logits[i:i + 1], [params[i]], [seen[i]], [i])[0] for i in range(8)]
    on_cpu = device_pick(logits.cpu(), params, seen, idx)
    torch.cuda.synchronize()
    reps = 50
    t0 = time.perf_counter()
    for _ in range(reps):
        device_pick(logits, params, seen, idx)
    t_dev = (time.perf_counter() - t0) / reps
    host = logits.cpu()
    t0 = time.perf_counter()
    for _ in range(5):
        [sampler.pick(host[i], params[i], seen[i], i) for i in range(8)]
    t_cpu = (time.perf_counter() - t0) / 5
    ok = a == b == alone
    return ("passed" if ok else "failed"), {
        "repeat_equal": a == b, "alone_equal": a == alone, "gpu_vs_cpu_tensors_equal_rows": sum(x == y for x, y in zip(a, on_cpu)),
        "ms_per_step_device_pick_8_rows": round(t_dev * 1e3, 3), "ms_per_step_cpu_pick_8_rows": round(t_cpu * 1e3, 3)}


def check_streaming(path: Path):
    from transformers import LlamaForCausalLM

    from caldrix.weight_budget import CudaOps, LayerStreamer, attach, plan, sizes_of_model

    dev = torch.device("cuda")
    fixed, layers = sizes_of_model(path)
    half = 2  # bf16 bytes per float32 byte stored: / 2
    fixed, layers = fixed // half, tuple(b // half for b in layers)
    budget = fixed + 2 * max(layers) + sum(layers) // 4
    p = plan(budget, fixed, layers)
    ref = LlamaForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(dev).eval()
    ps = prompts(4)
    want = [hf_greedy(ref, q, NEW, dev) for q in ps]
    del ref
    torch.cuda.empty_cache()

    model = LlamaForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    blocks = model.model.layers
    streamer = LayerStreamer(p, lambda i: {k: t.detach() for k, t in blocks[i].named_parameters()}, CudaOps(dev))
    attach(blocks, streamer, "cpu")  # streamed layers hold no weights; the rest move below
    model.to(dev)
    on_device = sum(t.numel() * t.element_size() for t in model.parameters() if t.device.type == "cuda"
                    and t.numel()) + sum(s.numel() for s in streamer.slots)
    got = [hf_greedy(model, q, NEW, dev) for q in ps]
    ok = got == want
    return ("passed" if ok else "failed"), {"plan": p.line(), "budget": budget, "device_weight_bytes_max": p.device_bytes,
                                            "device_bytes_measured_at_rest": on_device, "tokens_equal": ok}


def check_engine_streaming(path: Path):
    """The engine's own --weight-budget path (Engine.load(weight_budget=...), what the cuda lane
    runs): a quarter of the layers' weights plus what never streams, against the engine with
    every weight on the device; the peak device memory of each."""
    from caldrix.engine import Engine
    from caldrix.weight_budget import sizes_of_model

    fixed, layers = sizes_of_model(path, 2)  # bfloat16
    budget = fixed + 2 * max(layers) + sum(layers) // 4
    ps = prompts(4)
    torch.cuda.reset_peak_memory_stats()
    whole = Engine.load(path, dtype=torch.bfloat16, max_batch=4, context=128, device="cuda")
    want = engine_greedy(whole, ps, NEW, True)
    peak_whole = torch.cuda.max_memory_allocated()
    del whole
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    engine = Engine.load(path, dtype=torch.bfloat16, max_batch=4, context=128, device="cuda", weight_budget=budget)
    got = engine_greedy(engine, ps, NEW, True)
    ok = got == want
    return ("passed" if ok else "failed"), {"plan": engine.weight_plan.line(), "budget": budget,
                                            "peak_device_bytes_whole": peak_whole,
                                            "peak_device_bytes_streamed": torch.cuda.max_memory_allocated(),
                                            "tokens_equal": ok}


def check_throughput(path: Path):
    from transformers import LlamaForCausalLM

    facts: dict = {}
    steps = 128
    model = LlamaForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    for b in (1, 8):
        ids = torch.tensor(prompts(b), device="cuda")
        kw = dict(max_new_tokens=steps, min_new_tokens=steps, do_sample=False, pad_token_id=0)
        model.generate(ids, **{**kw, "max_new_tokens": 8, "min_new_tokens": 8})
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        model.generate(ids, **kw)
        torch.cuda.synchronize()
        facts[f"transformers_tok_s_{b}"] = round(b * steps / (time.perf_counter() - t0), 1)
    del model
    torch.cuda.empty_cache()
    try:
        from caldrix.batch import Batch, Run
        from caldrix.engine import Engine

        engine = Engine.load(path, dtype=torch.bfloat16, max_batch=8, context=512, device="cuda")
        for b in (1, 8):
            ps = prompts(b)
            engine.step(Batch(tuple(Run(s, 0, q, (len(q) - 1,)) for s, q in enumerate(ps))))
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for k in range(steps):
                engine.step(Batch(tuple(Run(s, PROMPT_LEN + k, (7,), (0,)) for s in range(b))))
            torch.cuda.synchronize()
            facts[f"caldrix_tok_s_{b}"] = round(b * steps / (time.perf_counter() - t0), 1)
    except Exception as exc:
        facts["caldrix_error"] = f"{type(exc).__name__}: {exc}"
        return "error", facts
    return "measured", facts


def decode_profile(engine, streams: int, steps: int, device: str = "cuda") -> dict:
    """Per decode step of `streams` rows after a prompt each: wall ms, the ms the device spent
    in kernels (on the CPU, in operators: a dry run of this code) and the kernels launched."""
    from torch.profiler import ProfilerActivity, profile

    from caldrix.batch import Batch, Run

    ps = prompts(streams)
    engine.step(Batch(tuple(Run(s, 0, q, (len(q) - 1,)) for s, q in enumerate(ps))))
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def go(k0: int) -> None:
        for k in range(k0, k0 + steps):
            engine.step(Batch(tuple(Run(s, PROMPT_LEN + k, (7,), (0,)) for s in range(streams))))
        sync()

    go(0)  # warm: the allocator, cuBLAS handles, the first launches
    activity = ProfilerActivity.CUDA if device == "cuda" else ProfilerActivity.CPU
    with profile(activities=[activity]) as prof:
        t0 = time.perf_counter()
        go(steps)
        wall = time.perf_counter() - t0
    if device == "cuda":
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        busy_us = sum(e.device_time_total for e in kernels)  # kernels and copies; overlaps count twice
    else:
        kernels = [e for e in prof.events() if e.name.startswith("aten::") and not e.cpu_parent]
        busy_us = sum(e.cpu_time_total for e in kernels)
    return {"wall_ms_per_step": round(wall / steps * 1e3, 3), "busy_ms_per_step": round(busy_us / steps / 1e3, 3),
            "busy_share": round(busy_us / 1e6 / wall, 3), "launches_per_step": round(len(kernels) / steps, 1)}


def check_decode_profile(path: Path):
    from caldrix.engine import Engine

    engine = Engine.load(path, dtype=torch.bfloat16, max_batch=8, context=512, device="cuda")
    return "measured", {f"streams_{b}": decode_profile(engine, b, 32) for b in (1, 8)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for gpu_check.json and .md (default $OUT)")
    args = ap.parse_args(argv)
    out = Path(args.out)
    if not torch.cuda.is_available():
        rep = Report(out, None)
        rep.data["why"] = "torch.cuda.is_available() is False"
        rep.write()
        print("gpu_check: no GPU here (torch.cuda.is_available() is False): nothing to check; "
              "run this on a lent GPU machine", file=sys.stderr)
        return 3
    props = torch.cuda.get_device_properties(0)
    gpu = {"name": props.name, "memory_bytes": props.total_memory, "hip": getattr(torch.version, "hip", None)}
    rep = Report(out, gpu)
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 parity means float32 matmuls
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        path = build_model(Path(tmp))
        rep.data["model"] = {"shape": SHAPE, "built_s": round(time.perf_counter() - t0, 1)}
        run_check(rep, "device_pick_reproducible", check_device_pick)
        run_check(rep, "weight_budget_streaming", lambda: check_streaming(path))
        run_check(rep, "engine_greedy_parity", lambda: check_parity(path))
        run_check(rep, "engine_weight_budget", lambda: check_engine_streaming(path))
        run_check(rep, "engine_batch_invariance", lambda: check_batch_invariance(path))
        run_check(rep, "throughput", lambda: check_throughput(path))
        run_check(rep, "decode_step_profile", lambda: check_decode_profile(path))
    bad = [c["name"] for c in rep.data["checks"] if c["status"] in ("failed", "error")]
    print(f"gpu_check: done; {'all passed' if not bad else 'not passed: ' + ', '.join(bad)}", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
