"""Qwen3.5 at decider-0.8b's shape: caldrix's models/qwen3_5.py against transformers' torch fallback.

    nice -n 5 .venv/bin/python bench/qwen3_5.py [--dtype auto|float32|bfloat16] [--prompt 1000]
        [--tokens 32] [--threads N] [--rounds R] [--ftz-transformers] [--dir DIR]

One random model (seed 0, transformers' own init), saved once as bf16 safetensors under --dir
and loaded by both sides in --dtype. `auto` (the default) is each side as a user runs it by
default: caldrix in bfloat16 where oneDNN has bf16 kernels for this CPU (else float32), as the
engine's --dtype auto does, and transformers' from_pretrained with no dtype argument (5.x:
the checkpoint's config dtype, bfloat16 here). Each side runs in a child process of its own,
so that each peak RSS is its own, the sides alternating for --rounds rounds (the machine is
shared: each side's best round is reported, and the spread). In each: load, a 16-token warm-up, then a --prompt-token
prefill in one call (timed; logits of the last row only, which is also what transformers'
generate asks for), then --tokens greedy decode steps single stream (timed from the second).
transformers runs a plain loop over its forward with its cache, no generate() around it, and
its fallbacks for the delta rule and the conv (no fla, no causal-conv1d installed).

The shape is Qwen/Qwen3.5-0.8B's config.json (decider-0.8b is that model fine-tuned; the
registry's geometry in shared/research/decider.md section 11 agrees): a composite qwen3_5
config whose text_config has hidden 1024, 24 layers in [3 x linear, 1 x full] x 6
(full_attention_interval 4), intermediate 3584, 8 heads, 2 kv heads, head_dim 256,
linear_num_key_heads 16, linear_num_value_heads 16, linear key/value head dim 128, conv kernel
4, rope_theta 1e7, partial_rotary_factor 0.25, vocab 248320, tied embeddings. The numbers
were read from two independent public copies of that config.json, one in a C++ test
(brolm qwen35 config test) and one in a model-config parser test, which agree field for field.
The vision tower is left out: nothing here reads it.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TEXT_0_8B = dict(vocab_size=248320, hidden_size=1024, intermediate_size=3584, num_hidden_layers=24,
                 num_attention_heads=8, num_key_value_heads=2, head_dim=256, full_attention_interval=4,
                 linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128,
                 linear_value_head_dim=128, linear_conv_kernel_dim=4, rms_norm_eps=1e-6,
                 max_position_embeddings=262144, tie_word_embeddings=True,
                 rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                                  "mrope_section": [11, 11, 10], "mrope_interleaved": True})


def progress(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class Clock:
    """Wall and process CPU seconds since the last lap: on a shared machine the CPU seconds
    (with --threads 1, where no thread waits on another) are the steadier measure."""

    def __init__(self):
        self.wall, self.cpu = time.perf_counter(), time.process_time()

    def lap(self) -> tuple[float, float]:
        wall, cpu = time.perf_counter(), time.process_time()
        out = (wall - self.wall, cpu - self.cpu)
        self.wall, self.cpu = wall, cpu
        return out


def make(path: Path) -> None:
    import torch
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(0)
    model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**TEXT_0_8B)).to(torch.bfloat16)
    model.save_pretrained(path)
    cfg = json.loads((path / "config.json").read_text())  # as the real one: composite, text inside
    (path / "config.json").write_text(json.dumps({"architectures": ["Qwen3_5ForConditionalGeneration"],
                                                  "model_type": "qwen3_5", "tie_word_embeddings": True,
                                                  "text_config": cfg}, indent=1))
    # and its weights under the composite's prefix, as the real checkpoint names them
    from safetensors.torch import load_file, save_file
    for f in path.glob("*.safetensors"):
        tensors = load_file(f)
        save_file({k.replace("model.", "model.language_model.", 1): v for k, v in tensors.items()}, f,
                  metadata={"format": "pt"})


def run_ours(path: Path, dtype, prompt: list[int], steps: int, weights: str = "dense") -> dict:
    import torch
    from caldrix.batch import MAX_DRAFT_TOKENS
    from caldrix.models.base import Attend
    from caldrix.models.qwen3_5 import Qwen35
    from caldrix.models.qwen3_5_load import load

    if dtype is None:
        dtype = torch.bfloat16 if torch.ops.mkldnn._is_mkldnn_bf16_supported() else torch.float32
    t = time.perf_counter()
    # the engine's own load call: --weights q4 rounds to 4-bit groups, 4-bit kernel up to a verify pass's rows
    model = load(path, dtype=dtype, int4_rows=1 + MAX_DRAFT_TOKENS, quantize=weights == "q4").model
    load_s = time.perf_counter() - t
    state = Qwen35.new_state(model.cfg, 1, len(prompt) + steps + 16, dtype, "cpu")

    def prefill(ids):
        rows = torch.arange(len(ids))
        hidden = model(torch.tensor(ids), Attend("prefill", (0,), rows, rows), state)
        return model.logits(hidden[-1:])[0]

    def decode(tok, pos):
        p = torch.tensor([pos])
        return model.logits(model(torch.tensor([tok]), Attend("decode", (0,), p, p, (pos + 1,), torch.tensor([0])), state))[0]

    with torch.inference_mode():
        prefill(prompt[:16])
        clock = Clock()
        last = prefill(prompt)
        prefill_s = clock.lap()
        first = last.clone()
        tokens, times = [], []
        for i in range(steps):
            tokens.append(int(last.argmax()))
            clock.lap()
            last = decode(tokens[-1], len(prompt) + i)
            times.append(clock.lap())
    return dict(load_s=load_s, prefill_s=prefill_s, step_s=times, tokens=tokens, first=first.tolist(),
                dtype=str(model.dtype))


def run_transformers(path: Path, dtype, prompt: list[int], steps: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM
    import importlib.util

    fast = [n for n in ("fla", "causal_conv1d") if importlib.util.find_spec(n) is not None]
    t = time.perf_counter()
    kw = {} if dtype is None else {"dtype": dtype}  # None: transformers' own default
    model = AutoModelForCausalLM.from_pretrained(path, **kw).eval()
    load_s = time.perf_counter() - t
    with torch.inference_mode():
        model(input_ids=torch.tensor([prompt[:16]]), use_cache=True, logits_to_keep=1)
        clock = Clock()
        out = model(input_ids=torch.tensor([prompt]), use_cache=True, logits_to_keep=1)
        prefill_s = clock.lap()
        last = out.logits[0, -1].float()
        first = last.clone()
        cache, tokens, times = out.past_key_values, [], []
        for _ in range(steps):
            tokens.append(int(last.argmax()))
            clock.lap()
            out = model(input_ids=torch.tensor([[tokens[-1]]]), cache=cache, use_cache=True, logits_to_keep=1)
            times.append(clock.lap())
            cache, last = out.past_key_values, out.logits[0, -1].float()
    return dict(load_s=load_s, prefill_s=prefill_s, step_s=times, tokens=tokens, first=first.tolist(),
                kernels=fast or "torch fallbacks", dtype=str(model.dtype))


def child(args) -> None:
    import torch

    dtype = None if args.dtype == "auto" else getattr(torch, args.dtype)
    if args.ftz and args.child == "transformers":
        torch.set_flush_denormal(True)  # what caldrix's forward does; off in transformers by default
    if args.threads:
        torch.set_num_threads(args.threads)
    prompt = torch.randint(0, 248000, (args.prompt,), generator=torch.Generator().manual_seed(1)).tolist()
    if args.child == "caldrix":
        result = run_ours(Path(args.dir), dtype, prompt, args.tokens, args.weights)
    else:
        result = run_transformers(Path(args.dir), dtype, prompt, args.tokens)
    result.update(peak_rss_mib=peak_mib(), threads=torch.get_num_threads())
    Path(args.out).write_text(json.dumps(result))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    ap.add_argument("--rounds", type=int, default=1, help="alternate the two sides this many times")
    ap.add_argument("--ftz-transformers", dest="ftz", action="store_true",
                    help="flush subnormals to zero in transformers' process too, as caldrix does")
    ap.add_argument("--prompt", type=int, default=1000)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=0, help="torch threads in both (0: torch's default)")
    ap.add_argument("--weights", default="dense", choices=["dense", "q4"],
                    help="caldrix's --weights: dense (as loaded) or q4 (4-bit groups made at load)")
    ap.add_argument("--dir", default=str(Path.home() / ".cache" / "caldrix" / "bench-qwen3_5-0.8b-random"))
    ap.add_argument("--child", choices=["caldrix", "transformers", "make"])
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.child == "make":
        return make(Path(args.dir))
    if args.child:
        return child(args)
    path = Path(args.dir)
    if not (path / "config.json").exists():
        progress(f"building the random 0.8b-shaped checkpoint in {path}")
        subprocess.run([sys.executable, __file__, "--child", "make", "--dir", str(path)], check=True)
    runs: dict[str, list[dict]] = {"caldrix": [], "transformers": []}
    for r in range(args.rounds):
        for side in runs:
            progress(f"round {r + 1}/{args.rounds}, {side}: {args.dtype}, prefill {args.prompt}, decode {args.tokens}")
            out = path / f"result-{side}.json"
            subprocess.run([sys.executable, __file__, "--child", side, "--out", str(out), "--dir", str(path),
                            "--dtype", args.dtype, "--prompt", str(args.prompt), "--tokens", str(args.tokens),
                            "--threads", str(args.threads), "--weights", args.weights] + (["--ftz-transformers"] if args.ftz else []),
                           check=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
            runs[side].append(json.loads(out.read_text()))
    res = {side: v[0] for side, v in runs.items()}
    ours, theirs = res["caldrix"], res["transformers"]
    diff = max(abs(a - b) for a, b in zip(ours["first"], theirs["first"]))
    same = sum(a == b for a, b in zip(ours["tokens"], theirs["tokens"]))
    print(f"Qwen3.5 0.8b shape, random weights, --dtype {args.dtype} (caldrix {ours['dtype']}"
          f"{', --weights q4' if args.weights == 'q4' else ''}, transformers "
          f"{theirs['dtype']}), {ours['threads']} threads, best of {args.rounds} alternating rounds; transformers "
          f"kernels: {theirs['kernels']}{', subnormals flushed' if args.ftz else ''}")
    print(f"{'':24}{'caldrix':>10}{'transformers':>14}{'ratio':>8}")

    def tps(v, k):  # decode tokens/s, from the second step on
        return (len(v["step_s"]) - 1) / sum(t[k] for t in v["step_s"][1:])

    for k, clock in enumerate(("wall", "cpu")):
        dec = {s: [tps(v, k) for v in vs] for s, vs in runs.items()}
        pre = {s: [v["prefill_s"][k] for v in vs] for s, vs in runs.items()}
        d = {s: max(x) for s, x in dec.items()}
        p = {s: min(x) for s, x in pre.items()}
        spread = "" if args.rounds == 1 else (f"  rounds: {', '.join(f'{x:.2f}' for x in dec['caldrix'])} / "
                                               f"{', '.join(f'{x:.2f}' for x in dec['transformers'])}")
        print(f"{'decode tok/s (' + clock + ')':24}{d['caldrix']:10.2f}{d['transformers']:14.2f}"
              f"{d['caldrix'] / d['transformers']:8.2f}x  (target >= 3x){spread}")
        spread = "" if args.rounds == 1 else (f"  rounds: {', '.join(f'{x:.2f}' for x in pre['caldrix'])} / "
                                               f"{', '.join(f'{x:.2f}' for x in pre['transformers'])}")
        print(f"{f'prefill {args.prompt} s ({clock})':24}{p['caldrix']:10.2f}{p['transformers']:14.2f}"
              f"{p['transformers'] / p['caldrix']:8.2f}x  (target >= 2x){spread}")
    rss = {s: max(v["peak_rss_mib"] for v in vs) for s, vs in runs.items()}
    print(f"{'peak RSS MiB':24}{rss['caldrix']:10.0f}{rss['transformers']:14.0f}")
    print(f"{'load s (wall)':24}{ours['load_s']:10.2f}{theirs['load_s']:14.2f}")
    print(f"prefill last-row logits max |diff| {diff:.2e}; greedy tokens equal {same}/{len(ours['tokens'])}")

if __name__ == "__main__":
    main()
