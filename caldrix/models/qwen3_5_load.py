"""Qwen3.5's entry in the architecture map (models/__init__.py), and its weights: the Hugging
Face layout read into models/qwen3_5.py's Qwen35. Both config shapes (qwen3_5, qwen3_5_text)
load here."""

from __future__ import annotations

from pathlib import Path

import torch

from caldrix.kernels import q4_quantize
from caldrix.kernels.packed import can_pack
from caldrix.models.base import Loaded
from caldrix.models.qwen3_5 import Qwen35, Qwen35Config


def load(path: Path, *, dtype: torch.dtype, device: str = "cpu", int4_from: Path | None = None,
         max_batch: int = 1, int4_rows: int = 8, pack: bool = True, quantize: bool = False) -> Loaded:
    """A Qwen35 from the Hugging Face directory `path`, in `dtype`. `quantize` (`--weights q4`):
    the head and projections rounded to 4-bit groups at load (Qwen35.quantize), calls of up to
    `int4_rows` rows on the 4-bit kernel; bfloat16 on the CPU only. GGUF 4-bit weights are a
    llama-family path only; `max_batch` chooses nothing here."""
    if int4_from is not None:
        raise ValueError("qwen3_5: GGUF weights are not supported for this architecture; serve its "
                         "Hugging Face directory (safetensors)")
    if not quantize:
        return Loaded(load_qwen35(Path(path), dtype, device, pack=pack))
    if not (pack and q4_quantize.usable(dtype, device)):
        raise ValueError("--weights q4 needs --dtype bfloat16 on the cpu lane, "
                         f"not {str(dtype).removeprefix('torch.')} on {device}")
    model = load_qwen35(Path(path), dtype, device, pack=False)
    layers = model.quantize(int4_rows)
    # the 4-bit kernels give a row the same bits at any row count, but the layers they cannot
    # take stay dense: pad decode steps unless every projection is 4-bit
    return Loaded(model, row_count_dependent=q4_quantize.dense_left(model), int4_layers=layers)


def load_qwen35(path: Path, dtype: torch.dtype, device="cpu", pack: bool = True) -> Qwen35:
    """A Qwen35 from a Hugging Face directory (config.json and *.safetensors), in `dtype`.

    Weights are read one at a time (weights/tensor_files.py) under `model.language_model.`
    (the composite checkpoint) or `model.` (the text one); the vision tower's and the MTP
    head's are never read. q/k/v, the four linear-layer input projections and gate/up are
    fused into one matmul each; norm weights become float32 scales 1 + w and A_log becomes
    -exp(A_log), both from the `dtype`-rounded weights, as transformers computes them."""
    from caldrix.weights.tensor_files import MissingWeight, TensorFiles, model_files

    path = Path(path)
    cfg = Qwen35Config.from_dir(path)
    files = model_files(path)
    ours: dict[str, torch.Tensor] = {}
    with TensorFiles(files) as hf:
        prefix = next((p for p in ("model.language_model.", "model.", "") if p + "embed_tokens.weight" in hf), None)
        if prefix is None:
            raise MissingWeight(path, "model.language_model.embed_tokens.weight")

        def take(name: str, head: str = prefix) -> torch.Tensor:
            if head + name not in hf:
                raise MissingWeight(path, head + name)
            return hf.get(head + name).to(dtype)

        def scale(name: str) -> torch.Tensor:
            return 1.0 + take(name).float()

        ours["embed.weight"] = take("embed_tokens.weight")
        ours["norm_scale"] = scale("norm.weight")
        if not cfg.tie_embeddings:
            ours["lm_head.weight"] = take("lm_head.weight", "")
        for i, kind in enumerate(cfg.layer_types):
            p, m, o = f"layers.{i}.", f"layers.{i}.mlp.", f"layers.{i}.mixer."
            ours[p + "input_scale"] = scale(p + "input_layernorm.weight")
            ours[p + "post_scale"] = scale(p + "post_attention_layernorm.weight")
            ours[p + "w_gate_up.weight"] = torch.cat([take(m + "gate_proj.weight"), take(m + "up_proj.weight")])
            ours[p + "w_down.weight"] = take(m + "down_proj.weight")
            if kind == "full_attention":
                a = p + "self_attn."
                for part in ("weight", "bias") if cfg.attention_bias else ("weight",):
                    ours[o + "wqkv." + part] = torch.cat([take(f"{a}{n}_proj.{part}") for n in "qkv"])
                    ours[o + "wo." + part] = take(f"{a}o_proj.{part}")
                ours[o + "q_scale"] = scale(a + "q_norm.weight")
                ours[o + "k_scale"] = scale(a + "k_norm.weight")
            else:
                a = p + "linear_attn."
                ours[o + "w_in.weight"] = torch.cat([take(a + f"in_proj_{n}.weight") for n in ("qkv", "z", "b", "a")])
                ours[o + "conv"] = take(a + "conv1d.weight").squeeze(1)  # [W, 1, K] -> [W, K]
                ours[o + "neg_a"] = -take(a + "A_log").float().exp()
                ours[o + "dt_bias"] = take(a + "dt_bias").float()
                ours[o + "norm"] = take(a + "norm.weight")
                ours[o + "out.weight"] = take(a + "out_proj.weight")
    with torch.device("meta"):
        model = Qwen35(cfg)
    missing, unexpected = model.load_state_dict(ours, strict=False, assign=True)
    del ours  # the model holds the weights now: pack() below then frees each plain one as it goes
    if missing or unexpected:
        raise RuntimeError(f"loading {path}: unexpected weights {sorted(unexpected)[:3]}, missing {sorted(missing)[:3]}")
    model = model.to(device).eval().requires_grad_(False)
    if pack and can_pack(dtype, device):
        model.pack()
    return model
