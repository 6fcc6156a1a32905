"""Time to first token for an image prompt: caldrix's Idefics3 against transformers, same run.

    .venv/bin/python bench/vision.py [--hf-dtypes float32,bfloat16] [--dtype auto] [--json OUT]

The model is random, of SmolVLM-256M-Instruct's published shape (its config.json: SigLIP
768 wide, 12 layers, 12 heads, 512 px tiles of 16 px patches; scale_factor 4; llama text 576
wide, 30 layers, 9 heads, 3 kv heads, intermediate 1536, vocab 49280, rope_theta 100000),
built with transformers' config classes and saved as safetensors, so both sides read the same
weights. The tokenizer is SmolLM2's (SmolVLM's base vocabulary) with SmolVLM's added tokens at
SmolVLM's ids. Two prompts: a 512x512 PNG with detail "low" (one tile, 67 image tokens) and a
1024x768 PNG with detail "high" (3 x 4 tiles and the global image: 832 <image> tokens).

Time to first token counts, on each side: decoding the PNG, the image processor, laying out
and tokenizing the prompt, the vision tower, the prompt pass and the first pick.
- transformers: Idefics3Processor (its PIL image processor) then generate(max_new_tokens=1).
- caldrix: caldrix/vision/preprocess.py (pixels in the tower's dtype), Idefics3.image_features,
  the prompt in `--chunk`-row chunks (default 512: the server's --prefill-chunk where its
  lanes overlap, else 128), the last token in the last chunk, as the engine runs an image
  request.
Each side runs in its own process (peak memory is that process's high-water mark over the
case, reset before it through /proc/self/clear_refs, model included), warmed up with one
untimed low case; the cases then run interleaved across the sides, `--rounds` times, and the
best time of each is reported.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TEXT = "<|im_start|>User:<image>Describe this image in one sentence.<end_of_utterance>\nAssistant:"
CASES = {"low": (512, 512, "low"), "high": (1024, 768, "high")}

SMOLVLM_256M_CONFIG = dict(
    architectures=["Idefics3ForConditionalGeneration"], image_token_id=49190, scale_factor=4,
    tie_word_embeddings=False,
    text_config=dict(model_type="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                     num_attention_heads=9, num_key_value_heads=3, vocab_size=49280, max_position_embeddings=8192,
                     rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=False),
    vision_config=dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                       image_size=512, patch_size=16, layer_norm_eps=1e-6),
)


def progress(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def png(width: int, height: int) -> bytes:
    import numpy as np
    from PIL import Image

    y, x = np.mgrid[0:height, 0:width]
    rgb = np.stack([x * 255 // width, y * 255 // height, (x ^ y) & 255], -1).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(rgb, "RGB").save(buf, format="PNG")
    return buf.getvalue()


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def build_model(out: Path) -> None:
    import torch
    from transformers import AutoTokenizer, Idefics3Config, Idefics3ForConditionalGeneration

    from caldrix.weights import gguf, source

    torch.manual_seed(0)
    Idefics3ForConditionalGeneration(Idefics3Config(**SMOLVLM_256M_CONFIG)).save_pretrained(out)
    tok = AutoTokenizer.from_pretrained(gguf.convert(source.embedded_gguf(), progress=False))
    added = ["<global-img>"] + [f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)]
    added += ["<fake_token_around_image>", "<image>"] + [f"<|reserved_special_token_{i}|>" for i in range(88)]
    tok.add_special_tokens({"additional_special_tokens": added + ["<end_of_utterance>"]})
    assert tok.convert_tokens_to_ids("<image>") == 49190
    tok.save_pretrained(out)


def child_hf(path: Path, dtype_name: str) -> None:
    import warnings

    import torch
    from PIL import Image
    from transformers import AutoTokenizer, Idefics3ForConditionalGeneration, Idefics3Processor

    warnings.simplefilter("ignore")
    from transformers import Idefics3ImageProcessor

    dtype = getattr(torch, dtype_name)
    model = Idefics3ForConditionalGeneration.from_pretrained(path, dtype=dtype).eval()
    ip = Idefics3ImageProcessor(size={"longest_edge": 2048}, max_image_size={"longest_edge": 512}, resample=1,
                                image_mean=[0.5] * 3, image_std=[0.5] * 3, rescale_factor=1 / 255)
    proc = Idefics3Processor(image_processor=ip, tokenizer=AutoTokenizer.from_pretrained(path), image_seq_len=64)

    def ttft(data: bytes, detail: str) -> tuple[float, int, int]:
        t = time.perf_counter()
        im = Image.open(io.BytesIO(data))
        im.load()
        enc = proc(text=[TEXT], images=[[im]], return_tensors="pt", do_image_splitting=detail != "low")
        with torch.inference_mode():
            out = model.generate(**enc, max_new_tokens=1, do_sample=False)
        return time.perf_counter() - t, enc["input_ids"].shape[1], int(out[0, -1])

    serve(ttft)


def child_caldrix(path: Path, dtype_name: str) -> None:
    import torch
    from PIL import Image
    from transformers import AutoTokenizer

    from caldrix.engine import resolve_dtype
    from caldrix.models.base import Attend
    from caldrix.models.idefics3 import Idefics3, load_idefics3
    from caldrix.vision import preprocess as pp

    dtype = resolve_dtype(dtype_name, "cpu")
    model = load_idefics3(path, dtype)
    from caldrix.runtime import release_freed_heap

    release_freed_heap()  # as the server does once loaded: loading's freed heap back to the OS
    tok = AutoTokenizer.from_pretrained(path)
    tokens = pp.ImageTokens.lookup(tok.convert_tokens_to_ids)
    rows = 8192
    model.setup_rope(rows)
    kv = Idefics3.new_state(model.cfg, 1, rows, dtype, "cpu")
    chunk = int(os.environ.get("CALDRIX_BENCH_CHUNK", "512"))
    pixel_dtype = torch.bfloat16 if dtype == torch.bfloat16 else torch.float32  # as Engine.pixel_dtype

    def ttft(data: bytes, detail: str) -> tuple[float, int, int]:
        t = time.perf_counter()
        im = Image.open(io.BytesIO(data))
        im.load()
        prepared = pp.preprocess(im, detail, dtype=pixel_dtype)
        prompt = pp.layout_prompt(TEXT, [prepared.grid], tokens, lambda s: tok.encode(s, add_special_tokens=False))
        ids, image_rows = torch.tensor(prompt.ids), torch.tensor(prompt.image_rows)
        with torch.inference_mode():
            feats = model.image_features(prepared.pixels)
            n = len(ids)
            for s in range(0, n, chunk):  # the last row in the last chunk, as the policy runs an image request
                e = min(s + chunk, n)
                inside = (image_rows >= s) & (image_rows < e)
                at = Attend("prefill", (0,), torch.arange(s, e), torch.arange(s, e),
                            embeds=feats[inside], embed_rows=image_rows[inside] - s)
                hidden = model(ids[s:e], at, kv)
            first = int(model.logits(hidden[-1:]).argmax(-1))
        return time.perf_counter() - t, len(ids), first

    serve(ttft)


def serve(ttft) -> None:
    """Answer the parent: one case name a line on stdin, one JSON result a line on stdout."""
    images = {name: png(w, h) for name, (w, h, _) in CASES.items()}
    ttft(images["low"], "low")  # warm-up: one-time kernel and allocator set-up
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        name = line.strip()
        reset_peak()
        seconds, prompt_len, first = ttft(images[name], CASES[name][2])
        print(json.dumps({"ttft_s": round(seconds, 3), "prompt_tokens": prompt_len, "first_token": first,
                          "peak_rss_mib": round(peak_mib())}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="auto", help="caldrix's --dtype (auto: bfloat16 where the CPU has it)")
    ap.add_argument("--hf-dtypes", default="float32,bfloat16")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--chunk", type=int, default=512,
                    help="caldrix's prompt chunk (the server's default --prefill-chunk where its lanes overlap, else 128)")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--child", choices=["hf", "caldrix"], help=argparse.SUPPRESS)
    ap.add_argument("--path", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--child-dtype", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        (child_hf if args.child == "hf" else child_caldrix)(args.path, args.child_dtype)
        return

    import torch

    with tempfile.TemporaryDirectory() as tmp:
        progress("building the random model of SmolVLM-256M's shape")
        build_model(Path(tmp))
        from caldrix.engine import resolve_dtype

        ours_dtype = str(resolve_dtype(args.dtype, "cpu")).removeprefix("torch.")
        sides = [("caldrix", ours_dtype)] + [("hf", d) for d in args.hf_dtypes.split(",") if d]
        children = {}
        for side, dtype in sides:  # all loaded and warm before any case is timed
            progress(f"loading {side} {dtype}")
            child = subprocess.Popen([sys.executable, __file__, "--child", side, "--path", tmp, "--child-dtype", dtype],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env=os.environ | {"CALDRIX_BENCH_CHUNK": str(args.chunk)})
            assert json.loads(child.stdout.readline())["ready"]
            children[f"{side} {dtype}"] = child
        # Interleaved, so every side sees the same machine: on a shared machine the load drifts
        # over minutes, and one side after the other measured the drift as much as the code.
        runs: dict[str, dict[str, list]] = {key: {c: [] for c in CASES} for key in children}
        for r in range(args.rounds):
            for case in CASES:
                for key, child in children.items():
                    child.stdin.write(case + "\n")
                    child.stdin.flush()
                    got = json.loads(child.stdout.readline())
                    runs[key][case].append(got)
                    progress(f"round {r + 1} {case} {key}: {got}")
        for child in children.values():
            child.stdin.close()
            child.wait()
    # The best of the rounds: the least disturbed by other work on the machine.
    results = {key: {c: min(rs, key=lambda x: x["ttft_s"]) | {"peak_rss_mib": max(x["peak_rss_mib"] for x in rs)}
                     for c, rs in cases.items()} for key, cases in runs.items()}
    ours_key = next(k for k in results if k.startswith("caldrix"))
    ours = results[ours_key]
    for key, r in results.items():  # the same prompt on every side, or the comparison means nothing
        assert all(r[c]["prompt_tokens"] == ours[c]["prompt_tokens"] for c in CASES), (key, r, ours)
    print(f"torch {torch.__version__}, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}; "
          f"best of {args.rounds} interleaved rounds; caldrix prompt chunks of {args.chunk}")
    print(f"{'':22}{'low 512x512 TTFT':>18}{'high 1024x768 TTFT':>20}{'peak MiB low/high':>20}")
    for key, r in results.items():
        ratio = "" if key == ours_key else (f"   caldrix x{r['low']['ttft_s'] / ours['low']['ttft_s']:.2f}"
                                            f" / x{r['high']['ttft_s'] / ours['high']['ttft_s']:.2f}")
        print(f"{key:22}{r['low']['ttft_s']:>16.2f} s{r['high']['ttft_s']:>18.2f} s"
              f"{r['low']['peak_rss_mib']:>12}/{r['high']['peak_rss_mib']}{ratio}")
    print(f"prompt tokens: low {ours['low']['prompt_tokens']}, high {ours['high']['prompt_tokens']}")
    if args.json:
        args.json.write_text(json.dumps({"best": results, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
