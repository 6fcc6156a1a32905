"""Idefics3 (SmolVLM): the SigLIP vision tower, the pixel-shuffle connector, and the llama text
model of caldrix/models/llama.py, plain torch.

An image reaches the model as tiles (caldrix/vision/preprocess.py). `image_features` runs them
through the tower, folds each tile's n = (S/P)^2 patch rows into n / r^2 rows of r^2 times the
width (the pixel shuffle, r = scale_factor), and projects those to the text width: one row per
<image> token of the prompt, tiles in order. The text model then runs as for any llama prompt,
except that the rows at the <image> positions take those features instead of the token table's
row: `at.embeds` / `at.embed_rows` of the pass, an "embedding run" (models/base.py).

Calling convention, models/base.py's: `hidden = model(ids [T], at, kv)` -> [T, D],
`model.logits(hidden)` -> float32 [T, V]; `Idefics3.new_state(...)` makes the per-slot KV state.

Shapes: N tiles, n patches a tile, Dv vision width, r scale factor, D text width, T rows.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs
import torch
from torch import nn

from caldrix.kernels.packed import can_pack
from caldrix.models.base import Attend, KVCache
from caldrix.models.llama import Decoder, DecoderConfig, refuse_unimplemented
from caldrix.models.siglip import SiglipConfig, SiglipVisionTower, siglip_state


@attrs.frozen
class Idefics3Config:
    vision: SiglipConfig
    text: DecoderConfig
    scale_factor: int
    image_token_id: int

    @property
    def vocab_size(self) -> int:
        return self.text.vocab_size

    @property
    def max_positions(self) -> int:
        return self.text.max_positions

    @property
    def image_seq_len(self) -> int:
        """<image> tokens (feature rows) per tile."""
        return self.vision.patches_per_side ** 2 // self.scale_factor ** 2

    @classmethod
    def from_dir(cls, path: Path) -> "Idefics3Config":
        raw = json.loads((Path(path) / "config.json").read_text())
        archs = raw.get("architectures") or []
        if "Idefics3ForConditionalGeneration" not in archs and raw.get("model_type") != "idefics3":
            raise ValueError(f"not an Idefics3 model: {archs or raw.get('model_type')!r}")
        return cls.from_dict(raw)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "Idefics3Config":
        text = raw.get("text_config") or {}
        if text.get("model_type", "llama") != "llama":
            raise ValueError(f"unsupported Idefics3 text model {text.get('model_type')!r}; only llama is implemented")
        refuse_unimplemented(text)
        rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
        heads = text.get("num_attention_heads", 32)
        hidden = text.get("hidden_size", 4096)
        vision = SiglipConfig.from_dict(raw.get("vision_config") or {})
        scale = raw.get("scale_factor", 2)
        if vision.patches_per_side % scale:
            raise ValueError(f"scale_factor {scale} does not divide {vision.patches_per_side} patches a side")
        return cls(
            vision=vision,
            text=DecoderConfig(
                arch="llama",
                vocab_size=text.get("vocab_size", 32000),
                hidden_size=hidden,
                intermediate_size=text.get("intermediate_size", 11008),
                num_layers=text.get("num_hidden_layers", 32),
                num_heads=heads,
                num_kv_heads=text.get("num_key_value_heads") or heads,
                head_dim=text.get("head_dim") or hidden // heads,
                rms_norm_eps=text.get("rms_norm_eps", 1e-5),
                rope_theta=float(rope.get("rope_theta", text.get("rope_theta", 10000.0))),
                tie_embeddings=bool(raw.get("tie_word_embeddings", False)),
                max_positions=text.get("max_position_embeddings", 2048),
            ),
            scale_factor=scale,
            image_token_id=raw.get("image_token_id", 128257),
        )


def pixel_shuffle(x: torch.Tensor, r: int) -> torch.Tensor:
    """[N, n, Dv] -> [N, n / r^2, Dv * r^2]: each r x r block of patches becomes one row,
    in Idefics3's order (its reshapes and transposes, so the projection's weights line up)."""
    N, n, d = x.shape
    side = int(n ** 0.5)
    x = x.reshape(N, side, side // r, d * r)  # r neighbours along a row joined
    x = x.permute(0, 2, 1, 3).reshape(N, side // r, side // r, d * r * r)  # then r along a column
    return x.permute(0, 2, 1, 3).reshape(N, n // (r * r), d * r * r)


class Idefics3(nn.Module):
    def __init__(self, cfg: Idefics3Config):
        super().__init__()
        self.cfg = cfg
        self.vision = SiglipVisionTower(cfg.vision)
        self.proj = nn.Linear(cfg.vision.hidden_size * cfg.scale_factor ** 2, cfg.text.hidden_size, bias=False)
        self.text = Decoder(cfg.text)

    # The text model's state is a KV cache: rows at position p depend on tokens 0..p-1 only.
    reuses_rows = True

    @staticmethod
    def new_state(cfg: Idefics3Config, num_slots: int, rows: int, dtype: torch.dtype, device) -> KVCache:
        """The text model's KV rows: the vision tower keeps no state between calls."""
        return KVCache(cfg.text, num_slots, rows, dtype, device)

    @property
    def dtype(self) -> torch.dtype:
        return self.text.dtype

    def setup(self, rows: int) -> None:
        """The text model's RoPE tables for `rows` positions."""
        self.text.setup_rope(rows)

    def setup_rope(self, rows: int) -> None:
        self.text.setup_rope(rows)

    def uses_native(self, device) -> bool:
        return self.text.uses_native(device)

    def image_features(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels [N, 3, S, S] (the tiles of one or more images, in prompt order) -> [N * seq, D]
        in the text model's dtype: the rows for the prompt's <image> positions, in order."""
        x = self.vision(pixels.to(self.vision_dtype))  # [N, n, Dv]
        x = self.proj(pixel_shuffle(x, self.cfg.scale_factor))  # [N, seq, D]
        return x.reshape(-1, x.shape[-1]).to(self.text.norm.weight.dtype)

    @property
    def vision_dtype(self) -> torch.dtype:
        return self.proj.weight.dtype

    def forward(self, token_ids: torch.Tensor, at: Attend, kv: KVCache) -> torch.Tensor:
        """token_ids [T] -> hidden [T, D]. Rows `at.embed_rows` take `at.embeds` (image features,
        an "embedding run") instead of their token's embedding (base.input_rows, in the text
        model); the ids there are <image> tokens and are not looked up."""
        return self.text(token_ids, at, kv)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.text.logits(hidden)


def load_idefics3(path: Path, dtype: torch.dtype, device="cpu") -> Idefics3:
    """An Idefics3 from a Hugging Face directory (Idefics3ForConditionalGeneration's names:
    model.vision_model.*, model.connector.modality_projection.proj.weight, model.text_model.*,
    lm_head.weight), cast to `dtype` tensor by tensor as read. Without lm_head.weight the
    head is the token table (tied)."""
    from caldrix.weights.tensor_files import MissingWeight, TensorFiles, model_files

    cfg = Idefics3Config.from_dir(path)
    files = model_files(path)
    with TensorFiles(files) as hf:

        def take(name: str) -> torch.Tensor:
            if name not in hf:
                raise MissingWeight(path, name)
            return hf.get(name).to(dtype)

        tied = "lm_head.weight" not in hf
        if tied != cfg.text.tie_embeddings:
            cfg = attrs.evolve(cfg, text=attrs.evolve(cfg.text, tie_embeddings=tied))
        ours = {f"vision.{k}": v for k, v in siglip_state(take, "model.vision_model.", cfg.vision).items()}
        ours["proj.weight"] = take("model.connector.modality_projection.proj.weight")
        t = "model.text_model."
        ours["text.embed.weight"] = take(t + "embed_tokens.weight")
        ours["text.norm.weight"] = take(t + "norm.weight")
        if not tied:
            ours["text.lm_head.weight"] = take("lm_head.weight")
        for i in range(cfg.text.num_layers):
            src, dst = f"{t}layers.{i}.", f"text.layers.{i}."
            a, m = src + "self_attn.", src + "mlp."
            ours[dst + "input_norm.weight"] = take(src + "input_layernorm.weight")
            ours[dst + "post_norm.weight"] = take(src + "post_attention_layernorm.weight")
            ours[dst + "wqkv.weight"] = torch.cat([take(f"{a}{p}_proj.weight") for p in "qkv"])
            ours[dst + "wo.weight"] = take(a + "o_proj.weight")
            ours[dst + "w_gate_up.weight"] = torch.cat([take(m + "gate_proj.weight"), take(m + "up_proj.weight")])
            ours[dst + "w_down.weight"] = take(m + "down_proj.weight")
    with torch.device("meta"):
        model = Idefics3(cfg)
    missing, unexpected = model.load_state_dict(ours, strict=False, assign=True)
    del ours  # the model holds the weights now: packing below frees each one as it replaces it
    if missing or unexpected:
        raise RuntimeError(f"loading {path}: missing {sorted(missing)[:3]}, unexpected {sorted(unexpected)[:3]}")
    model = model.to(device).eval().requires_grad_(False)
    if can_pack(dtype, device):
        model.vision.pack()  # the tower's matmuls are most of an image's time to first token
        model.text.pack()
    return model
