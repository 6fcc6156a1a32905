"""The image decode limiter under load: 8 concurrent image requests against a text stream.

Starts `caldrix serve` on a random Idefics3 (built here in a temporary directory with SmolVLM's
tokenizer: SmolLM2's plus SmolVLM's added tokens, tests/vision_util.py), then
  1. idle: one streamed text-only request, its inter-token latencies (ITL);
     (measured before and after the loaded run, pooled: this machine's load drifts);
  2. loaded: the same text request while 8 image requests (detail `--detail`) arrive at once;
     /metrics' caldrix:num_images_decoding gauge is sampled every 20 ms throughout.
Prints the gauge's maximum (the limiter must hold it at 2), the image requests' wall times
(each answers 4 tokens), and the text stream's median and p90 ITL idle and loaded (the aim:
loaded within 2x of idle).

  PYTHONPATH=$PWD:$PWD/tests nice -n 5 .venv/bin/python bench/vision_load.py --shape small
`--shape published` builds SmolVLM-256M's published shape (minutes to build and run here).
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import numpy as np
from PIL import Image

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[1] / "tests")]

SHAPES = {
    # (vision hidden, layers, heads, image size, patch, scale, text hidden, layers, heads, kv, inter)
    "small": dict(vision=dict(hidden_size=192, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
                              image_size=128, patch_size=16),
                  text=dict(hidden_size=192, intermediate_size=512, num_hidden_layers=6, num_attention_heads=4,
                            num_key_value_heads=2), scale=2),
    "published": dict(vision=dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                                  num_attention_heads=12, image_size=512, patch_size=16),
                      text=dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                num_attention_heads=9, num_key_value_heads=3), scale=4),
}


def build(shape: str, out: Path) -> Path:
    import torch
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration

    import vision_util
    from caldrix.weights import gguf, source

    s = SHAPES[shape]
    cfg = Idefics3Config(vision_config=s["vision"],
                         text_config=dict(model_type="llama", vocab_size=49280, max_position_embeddings=8192,
                                          rope_theta=100000.0, tie_word_embeddings=False, **s["text"]),
                         scale_factor=s["scale"], image_token_id=49190, tie_word_embeddings=False)
    torch.manual_seed(0)
    Idefics3ForConditionalGeneration(cfg).save_pretrained(out)
    vision_util.smolvlm_tokenizer(gguf.convert(source.embedded_gguf(), progress=False)).save_pretrained(out)
    tile = s["vision"]["image_size"]
    (out / "preprocessor_config.json").write_text(json.dumps({
        "size": {"longest_edge": 4 * tile}, "max_image_size": {"longest_edge": tile}, "rescale_factor": 1 / 255,
        "image_mean": [0.5] * 3, "image_std": [0.5] * 3}))
    per_side = tile // s["vision"]["patch_size"]
    (out / "processor_config.json").write_text(json.dumps({"image_seq_len": per_side ** 2 // s["scale"] ** 2}))
    return out


def png_url(seed: int) -> str:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, size=(480, 640, 3), dtype=np.uint8), "RGB").save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def text_itl(base: str, tokens: int) -> list[float]:
    """A streamed text-only chat request: the gaps between its content events (s)."""
    body = {"model": "m", "messages": [{"role": "user", "content": "Tell me a long story."}],
            "max_tokens": tokens, "stream": True, "ignore_eos": True}
    stamps = []
    with httpx.Client(timeout=600) as http, http.stream("POST", base + "/v1/chat/completions", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: {") and '"content"' in line:
                stamps.append(time.perf_counter())
    return [b - a for a, b in zip(stamps, stamps[1:])]


def image_request(base: str, seed: int, detail: str, out: list) -> None:
    body = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": png_url(seed), "detail": detail}},
        {"type": "text", "text": "What is it?"}]}]}
    t = time.perf_counter()
    with httpx.Client(timeout=600) as http:
        status = http.post(base + "/v1/chat/completions", json=body).status_code
    out.append((status, time.perf_counter() - t))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=sorted(SHAPES), default="small")
    ap.add_argument("--detail", default="high")
    ap.add_argument("--images", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args()
    from server_harness import ServerProcess

    with tempfile.TemporaryDirectory() as tmp:
        path = build(args.shape, Path(tmp))
        with ServerProcess.start(path, "--served-name", "m", "--max-batch", "4", "--context", "4096") as srv:
            base = srv.url
            text_itl(base, 8)  # warm-up
            idle = text_itl(base, args.tokens)
            seen, stop, statuses = [], threading.Event(), []

            def watch() -> None:
                with httpx.Client(timeout=30) as http:
                    while not stop.is_set():
                        for line in http.get(base + "/metrics").text.splitlines():
                            if line.startswith("caldrix:num_images_decoding{"):
                                seen.append(float(line.split()[-1]))
                        time.sleep(0.02)

            watcher = threading.Thread(target=watch)
            watcher.start()
            senders = [threading.Thread(target=image_request, args=(base, i, args.detail, statuses))
                       for i in range(args.images)]
            for t in senders:
                t.start()
            time.sleep(0.3)  # the images are being decoded
            loaded = text_itl(base, args.tokens)
            for t in senders:
                t.join()
            stop.set()
            watcher.join()
            idle += text_itl(base, args.tokens)  # idle again after: the machine's load drifts

    def q(xs, p):
        return sorted(xs)[min(len(xs) - 1, int(p * len(xs)))] * 1000

    print(f"shape {args.shape}, {args.images} image requests (detail {args.detail}), "
          f"statuses {sorted(status for status, _ in statuses)}")
    took = sorted(seconds for _, seconds in statuses)
    print(f"image requests' wall time (s): first {took[0]:.1f}, median {statistics.median(took):.1f}, "
          f"last {took[-1]:.1f}")
    print(f"caldrix:num_images_decoding: max {max(seen):.0f} over {len(seen)} samples "
          f"(samples at 2: {sum(1 for x in seen if x == 2)})")
    print(f"text ITL idle:   median {statistics.median(idle) * 1000:.1f} ms, p90 {q(idle, 0.9):.1f} ms")
    print(f"text ITL loaded: median {statistics.median(loaded) * 1000:.1f} ms, p90 {q(loaded, 0.9):.1f} ms "
          f"({statistics.median(loaded) / statistics.median(idle):.2f}x idle)")


if __name__ == "__main__":
    main()
