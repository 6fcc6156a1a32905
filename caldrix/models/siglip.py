"""The SigLIP vision tower of Idefics3 (SmolVLM), plain torch.

A tile of S x S pixels is cut into (S/P)^2 patches of P x P, each projected to D by a strided
convolution, plus a learned position per patch; then L pre-norm encoder layers (LayerNorm,
bidirectional attention with biases, LayerNorm, a tanh-GELU MLP) and a final LayerNorm.

Only whole tiles reach it (caldrix/vision/preprocess.py cuts every image into S x S tiles), so
the patch mask Idefics3 carries for padded images is always full and is left out; the position
ids are computed the way Idefics3's embeddings compute them for a full mask (a bucketing of
fractional coordinates; 0..n-1 for SmolVLM's 32 patches a side, tests/test_idefics3.py).

Shapes: N tiles, S tile side, P patch side, n = (S/P)^2 patches, D hidden, H heads, E head dim.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch
import torch.nn.functional as F
from torch import nn

from caldrix.kernels import native
from caldrix.kernels.packed import PackedLinear, TileLinear


@attrs.frozen
class SiglipConfig:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    image_size: int
    patch_size: int
    layer_norm_eps: float
    num_channels: int = 3

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "SiglipConfig":
        """From a config.json's vision_config (the Idefics3VisionConfig defaults where absent)."""
        act = raw.get("hidden_act", "gelu_pytorch_tanh")
        if act != "gelu_pytorch_tanh":
            raise ValueError(f"unsupported vision hidden_act {act!r}; only gelu_pytorch_tanh is implemented")
        return cls(
            hidden_size=raw.get("hidden_size", 1152),
            intermediate_size=raw.get("intermediate_size", 3072),
            num_layers=raw.get("num_hidden_layers", 12),
            num_heads=raw.get("num_attention_heads", 16),
            image_size=raw.get("image_size", 224),
            patch_size=raw.get("patch_size", 32),
            layer_norm_eps=raw.get("layer_norm_eps", 1e-6),
            num_channels=raw.get("num_channels", 3),
        )

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size


def full_tile_positions(per_side: int) -> torch.Tensor:
    """[n] the position ids of a tile with every patch present, computed as Idefics3's
    embeddings do: each patch's fractional coordinate bucketed against 1/per_side steps."""
    cpu = torch.device("cpu")  # also when the model is built on the meta device
    boundaries = torch.arange(1 / per_side, 1.0, 1 / per_side, device=cpu)
    step = 1.0 / torch.tensor([per_side], dtype=torch.int64, device=cpu)  # as 1 / (patch count), a float
    coords = torch.arange(per_side, dtype=torch.float32, device=cpu) * step
    buckets = torch.bucketize(torch.clamp(coords, max=1.0 - 1e-6), boundaries, right=True)
    return (buckets[:, None] * per_side + buckets[None, :]).reshape(-1)


# Tiles run through the encoder layers a few at a time: the packed oneDNN layers, TILES_PER_PASS.
# Measured on 2 cores (AMX, bfloat16): 13 tiles in one pass 3.14 s, in passes of 2 tiles 2.61 s,
# of 4 2.66 s, one at a time 3.30 s. oneDNN ran the 768-wide outputs of 1024-row calls on one
# thread, and the 13,312-row calls spill their 3072-wide activations out of the caches; 2048
# rows avoid both. The AMX kernels' layers (TileLinear) take one tile a pass, which keeps a
# tile's activations in the caches: the 13 tiles 2.09 s, against 2.33 for oneDNN's layers in
# passes of 2 with tile_attend (one sitting).
TILES_PER_PASS = 2


class EncoderLayer(nn.Module):
    def __init__(self, cfg: SiglipConfig):
        super().__init__()
        d = cfg.hidden_size
        self.heads = cfg.num_heads
        self.norm1 = nn.LayerNorm(d, eps=cfg.layer_norm_eps)
        self.wqkv = nn.Linear(d, 3 * d)  # q, k and v fused: one matmul
        self.wo = nn.Linear(d, d)
        self.norm2 = nn.LayerNorm(d, eps=cfg.layer_norm_eps)
        self.fc1 = nn.Linear(d, cfg.intermediate_size)
        self.fc2 = nn.Linear(cfg.intermediate_size, d)
        self.packing = ""  # pack(): "onednn" (PackedLinear) or "tiles" (TileLinear and kernels/tower.cpp)

    @staticmethod
    def tiles_fit(cfg: SiglipConfig) -> bool:
        """Whether the AMX kernels are built and take this shape: 64-wide heads, widths and a
        tile's patch count in multiples of 32."""
        return (native.has_tower_kernels() and native.has_tile_linear() and cfg.hidden_size // cfg.num_heads == 64
                and cfg.hidden_size % 32 == 0 and cfg.intermediate_size % 32 == 0
                and cfg.patches_per_side ** 2 % 32 == 0)

    def pack(self, tiles: bool) -> None:
        """Swap the four Linears for packed ones (bfloat16 on a CPU with oneDNN's bf16 support
        only: kernels.packed.can_pack). `tiles` (where tiles_fit): TileLinears, with
        caldrix::tile_attend for the attention and the GELU in fc1's epilogue; otherwise
        oneDNN's PackedLinears, the GELU inside fc1's call and the residual sums inside wo's
        and fc2's, and torch's SDPA."""
        for name in ("wqkv", "wo", "fc1", "fc2"):
            lin = getattr(self, name)
            if tiles:
                setattr(self, name, TileLinear(lin.weight, lin.bias))
            else:
                setattr(self, name, PackedLinear(lin.weight, lin.bias, gelu="tanh" if name == "fc1" else ""))
        self.packing = "tiles" if tiles else "onednn"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        N, n, d = x.shape
        h = self.heads
        if self.packing == "tiles":
            attn = torch.ops.caldrix.tile_attend(self.wqkv(x, norm=self.norm1), h, (d // h) ** -0.5)
            x = self.wo(attn, residual=x)
            return self.fc2(self.fc1(x, norm=self.norm2, gelu=True), residual=x)
        qkv = self.wqkv(self.norm1(x)).view(N, n, 3, h, d // h).permute(2, 0, 3, 1, 4)  # [3, N, H, n, E]
        attn = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2])  # every patch sees every patch of its tile
        attn = attn.transpose(1, 2).reshape(N, n, d)
        if self.packing == "onednn":  # the residual sums inside wo's and fc2's calls
            x = self.wo(attn, residual=x)
            return self.fc2(self.fc1(self.norm2(x)), residual=x)
        x = x + self.wo(attn)
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x)), approximate="tanh"))


class SiglipVisionTower(nn.Module):
    def __init__(self, cfg: SiglipConfig):
        super().__init__()
        self.cfg = cfg
        d, p = cfg.hidden_size, cfg.patch_size
        self.patch = nn.Conv2d(cfg.num_channels, d, kernel_size=p, stride=p)
        self.position = nn.Embedding(cfg.patches_per_side ** 2, d)
        self.layers = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.num_layers))
        self.post_norm = nn.LayerNorm(d, eps=cfg.layer_norm_eps)
        self.register_buffer("positions", full_tile_positions(cfg.patches_per_side), persistent=False)
        self.tiles_per_pass = TILES_PER_PASS

    def pack(self) -> None:
        tiles = EncoderLayer.tiles_fit(self.cfg)
        for layer in self.layers:
            layer.pack(tiles)
        self.tiles_per_pass = 1 if tiles else TILES_PER_PASS

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels [N, C, S, S] (whole tiles) -> [N, n, D]."""
        S = self.cfg.image_size
        if pixels.shape[-2:] != (S, S):
            raise ValueError(f"the vision tower takes {S}x{S} tiles, got {tuple(pixels.shape[-2:])}")
        # channels-last pixels: oneDNN's convolution then writes each patch's D values together,
        # so [N, n, D] is contiguous as it comes; the default layout wrote [N, D, n], and the
        # transposing copy took as long as the convolution (13 tiles: 59 -> 29 ms, the same bits)
        pixels = pixels.to(self.patch.weight.dtype).contiguous(memory_format=torch.channels_last)
        x = self.patch(pixels).flatten(2).transpose(1, 2)  # [N, n, D]
        x = x + self.position(self.positions)
        passes = []
        for i in range(0, x.shape[0], self.tiles_per_pass):  # tiles never see each other: any split is exact
            h = x[i:i + self.tiles_per_pass]
            for layer in self.layers:
                h = layer(h)
            passes.append(h)
        return self.post_norm(torch.cat(passes))


def siglip_state(take, prefix: str, cfg: SiglipConfig) -> dict[str, torch.Tensor]:
    """Our parameter names from a Hugging Face Idefics3 checkpoint's vision_model weights:
    `take(name)` reads one tensor (already cast); q, k and v are fused here."""
    ours = {
        "patch.weight": take(prefix + "embeddings.patch_embedding.weight"),
        "patch.bias": take(prefix + "embeddings.patch_embedding.bias"),
        "position.weight": take(prefix + "embeddings.position_embedding.weight"),
        "post_norm.weight": take(prefix + "post_layernorm.weight"),
        "post_norm.bias": take(prefix + "post_layernorm.bias"),
    }
    for i in range(cfg.num_layers):
        src, dst = f"{prefix}encoder.layers.{i}.", f"layers.{i}."
        a = src + "self_attn."
        for kind in ("weight", "bias"):
            ours[dst + "wqkv." + kind] = torch.cat([take(f"{a}{p}_proj.{kind}") for p in "qkv"])
            ours[dst + "wo." + kind] = take(f"{a}out_proj.{kind}")
            ours[dst + "norm1." + kind] = take(f"{src}layer_norm1.{kind}")
            ours[dst + "norm2." + kind] = take(f"{src}layer_norm2.{kind}")
            ours[dst + "fc1." + kind] = take(f"{src}mlp.fc1.{kind}")
            ours[dst + "fc2." + kind] = take(f"{src}mlp.fc2.{kind}")
    return ours
