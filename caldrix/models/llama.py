"""Plain torch decoders for the llama family: Llama (SmolLM2) and Qwen3 (per-head q/k RMSNorm).

The first implementation of the model contract (models/base.py): called with packed token rows
and an explicit `Attend` plan saying which KV slot and position each row belongs to; its state
is a `KVCache` the engine allocates once (`Decoder.new_state`) and passes in. Loading, from a
Hugging Face directory and a GGUF's 4-bit blocks, is models/llama_load.py; the compiled decode
kernels and the scripted decode pass it may take are caldrix/kernels/.

Shapes: T packed rows, D hidden, H query heads, G kv heads, E head dim, S slots, C context rows.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import attrs
import torch
import torch.nn.functional as F
from torch import nn

from caldrix.kernels import native
from caldrix.kernels.ops import apply_rope, rms_norm
from caldrix.kernels.packed import pack_linears
from caldrix.kernels.q4_quantize import quantize_head, quantize_linears
from caldrix.kernels.q4 import Q8Embedding
from caldrix.models.base import Attend, KVCache, attend_cached, input_rows

SUPPORTED = ("llama", "qwen3")  # the model_types this file runs (caldrix.models.model_type reads them)


@attrs.frozen
class DecoderConfig:
    arch: str  # "llama" or "qwen3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    tie_embeddings: bool
    max_positions: int

    @classmethod
    def from_dir(cls, path: Path) -> "DecoderConfig":
        from caldrix.models import model_type_of  # the package's one reading of an architecture

        raw = json.loads((Path(path) / "config.json").read_text())
        arch = model_type_of(raw)
        if arch not in SUPPORTED:
            raise ValueError(f"not a {' or '.join(SUPPORTED)} model: {arch!r}")
        refuse_unimplemented(raw)
        rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        theta = rope.get("rope_theta", raw.get("rope_theta", 10000.0))
        heads = raw["num_attention_heads"]
        return cls(
            arch=arch,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            tie_embeddings=bool(raw.get("tie_word_embeddings", False)),
            max_positions=raw.get("max_position_embeddings", 2048),
        )


def refuse_unimplemented(raw: dict) -> None:
    """ValueError naming the first field of a llama-family config.json that would make the
    model compute otherwise than this file does: a scaled RoPE, biases, an activation other
    than SiLU, sliding-window layers. transformers honours each, so serving the weights without
    it would give other replies with no sign of why."""
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in (None, "default"):
        raise ValueError(f"unsupported rope_type {rope_type!r}; only default RoPE is implemented")
    for flag in ("attention_bias", "mlp_bias"):
        if raw.get(flag):
            raise ValueError(f"unsupported {flag}: true; the llama-family layers here have no biases")
    act = raw.get("hidden_act", "silu")
    if act not in ("silu", "swish"):  # transformers' ACT2FN maps both to SiLU
        raise ValueError(f"unsupported hidden_act {act!r}; the llama-family MLP here uses silu")
    # transformers' Qwen3: a window only with use_sliding_window, on the layers layer_types
    # (or, without it, max_window_layers) marks; without the switch every layer attends fully.
    layer_types = raw.get("layer_types") or ()
    if raw.get("use_sliding_window") and raw.get("sliding_window") is not None:
        windowed = (any(t == "sliding_attention" for t in layer_types) if layer_types
                    else raw.get("max_window_layers", 0) < raw.get("num_hidden_layers", 0))
    else:
        windowed = False
    if windowed:
        raise ValueError(f"unsupported sliding-window attention (use_sliding_window, sliding_window "
                         f"{raw.get('sliding_window')}); every layer here attends to the whole context")


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rope_tables(cfg: DecoderConfig, rows: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and signed sin, fp32 [rows, E], in the half-split layout (rotate_half); the sin
    table's first half is negated, for apply_rope."""
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.int64).float() / cfg.head_dim))
    t = torch.arange(rows, dtype=torch.int64).float()
    freqs = torch.outer(t, inv)
    emb = torch.cat((freqs, freqs), dim=-1)
    sin = emb.sin()
    sin[:, : cfg.head_dim // 2].neg_()
    return emb.cos().to(device), sin.to(device)


class Block(nn.Module):
    def __init__(self, cfg: DecoderConfig, index: int):
        super().__init__()
        self.cfg = cfg
        self.index = index
        h, g, e, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size
        self.q_size, self.kv_size = h * e, g * e
        self.input_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.post_norm = RMSNorm(d, cfg.rms_norm_eps)
        # fused projections: one matmul for q, k and v, one for gate and up
        self.wqkv = nn.Linear(d, (h + 2 * g) * e, bias=False)
        self.wo = nn.Linear(h * e, d, bias=False)
        self.w_gate_up = nn.Linear(d, 2 * cfg.intermediate_size, bias=False)
        self.w_down = nn.Linear(cfg.intermediate_size, d, bias=False)
        if cfg.arch == "qwen3":
            self.q_norm = RMSNorm(e, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(e, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x, cos, sin, at: Attend, kv: KVCache) -> torch.Tensor:
        if at.native and at.kind == "decode" and self.q_norm is None:
            return self._decode_native(x, cos, sin, at, kv)
        cfg = self.cfg
        T = x.shape[0]
        h, g, e = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        qkv = self.wqkv(self.input_norm(x))  # [T, (H+2G)E]
        qk, v = qkv.split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        qk, v = qk.view(T, h + g, e), v.view(T, g, e)
        if self.q_norm is not None:
            qk = torch.cat((self.q_norm(qk[:, :h]), self.k_norm(qk[:, h:])), dim=1)
        qk = apply_rope(qk, cos, sin)  # q and k heads rotate alike: one pass for both
        q, k = qk[:, :h], qk[:, h:]
        attn = self._attend(q, k, v, at, kv)  # [T, H*E]
        x = x + self.wo(attn)
        gate, up = self.w_gate_up(self.post_norm(x)).chunk(2, dim=-1)
        return x + self.w_down(F.silu(gate) * up)

    def _decode_native(self, x, cos, sin, at: Attend, kv: KVCache) -> torch.Tensor:
        """The decode form with the compiled kernels (kernels/attend.cpp): RMSNorm, and RoPE with
        the attention, one call each, where the general form makes about 20 small torch calls.
        The RoPE is torch's bits; the norm's float sum runs in an order of its own. The scripted
        stack (kernels/scripted.py) makes the same calls in the same order."""
        cfg, ops = self.cfg, torch.ops.caldrix
        K, V = kv.k[self.index], kv.v[self.index]
        qkv = self.wqkv(ops.decode_norm(x, self.input_norm.weight, cfg.rms_norm_eps))  # [T, (H+2G)E]
        attn = ops.decode_rope_attend(qkv, cos, sin, K, V, list(at.slots), list(at.lengths), cfg.num_heads,
                                      1.0 / math.sqrt(cfg.head_dim))  # [T, H*E]
        x = x + self.wo(attn)
        gate, up = self.w_gate_up(ops.decode_norm(x, self.post_norm.weight, cfg.rms_norm_eps)).chunk(2, dim=-1)
        return x + self.w_down(F.silu(gate) * up)

    def _attend(self, q, k, v, at: Attend, kv: KVCache) -> torch.Tensor:
        T, h, e = q.shape
        K, V = kv.k[self.index], kv.v[self.index]  # [S, G, C+1, E]
        scale = 1.0 / math.sqrt(e)
        if at.kind == "decode" and at.native:
            return torch.ops.caldrix.decode_attend(q, k, v, K, V, list(at.slots), list(at.lengths), scale)
        if at.kind == "decode" and T == 1 and at.lengths[0]:
            # One row (single-stream decode): attend_cached's decode form with its list and cat
            # taken out, about 8 us a layer; the same call on the same rows.
            s, n = at.slots[0], at.lengths[0]
            K[s, :, n - 1], V[s, :, n - 1] = k[0], v[0]
            out = F.scaled_dot_product_attention(q.unsqueeze(2), K[s : s + 1, :, :n], V[s : s + 1, :, :n],
                                                 scale=scale, enable_gqa=True)
            return out.reshape(1, h * e)
        return attend_cached(q, k, v, at, K, V)


class Decoder(nn.Module):
    """The llama family as a models/base.py Model: attention-only, so its state is a KVCache
    and a slot's rows can be reused up to any common prefix."""

    reuses_rows = True

    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.cfg = cfg
        # token ids -> rows: dense, or read from the Q8_0 head's blocks (llama_load.embed_from_head).
        # Given its weight, nn.Embedding skips its random init: under llama_load's meta device
        # that init (normal_) imports some 800 modules of torch's meta kernels, 67 MB for good.
        self.embed: nn.Embedding | Q8Embedding = nn.Embedding(
            cfg.vocab_size, cfg.hidden_size, _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.head: nn.Module | None = None  # a quantized stand-in for the lm_head (GGUF blocks or --weights q4)
        # scripted.decode_stack and its weights, set by the loader when every layer is 4-bit
        # llama: a decode-form pass through all layers as one TorchScript call.
        self.stack_fn = None
        self.stack_weights: list[torch.Tensor] = []
        # scripted.decode_logits and the Q8_0 head's operands, set by the loader where the stack
        # is and the head is Q8_0 blocks: the whole decode pass, head and arg-max, as one call.
        self.logits_fn = None
        self.head_weights: list[torch.Tensor] = []
        self.cos = self.sin = None  # set by setup_rope

    @classmethod
    def new_state(cls, cfg: DecoderConfig, num_slots: int, rows: int, dtype: torch.dtype, device) -> KVCache:
        return KVCache(cfg, num_slots, rows, dtype, device)

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.weight.dtype

    def setup(self, rows: int) -> None:
        """The RoPE tables for `rows` positions."""
        self.setup_rope(rows)

    def pack(self) -> None:
        """Swap the layers' dense projections (nn.Linear; 4-bit ones stay as they are) for
        PackedLinears: oneDNN's blocked bfloat16 layout, made once, and the same bits as the
        plain matmul. Measured at SmolVLM-256M's text shape on 2 cores: an 877-token prompt in
        128-row chunks 546 -> 475 ms, a decode step 36 -> 31 ms. For loaders, where
        kernels.packed.can_pack says so (bfloat16 on a CPU with oneDNN's bf16 support)."""
        pack_linears(self.layers)

    def quantize(self, max_int4_rows: int) -> int:
        """`--weights q4` (bfloat16 on the CPU: kernels/q4_quantize.py): the head and every
        projection the 4-bit kernels take become 4-bit groups, the projections with a packed
        copy of their dequantized weights for calls past `max_int4_rows` rows; what they cannot
        take is packed as pack() would. The embedding stays as loaded. Returns how many layers
        became 4-bit, the head among them."""
        head = quantize_head(self.embed.weight if self.lm_head is None else self.lm_head.weight, max_int4_rows)
        if head is not None:
            self.head, self.lm_head = head, None if self.lm_head is None else head
        count = (head is not None) + quantize_linears(self.layers, max_int4_rows)
        pack_linears(self.layers)
        return count

    def setup_rope(self, rows: int) -> None:
        self.cos, self.sin = rope_tables(self.cfg, rows, self.norm.weight.device)

    def uses_native(self, device) -> bool:
        """Whether decode-form passes take the compiled kernels (kernels/native.py)."""
        return native.usable(self.dtype, self.cfg.head_dim, device)

    def forward(self, token_ids: torch.Tensor, at: Attend, kv: KVCache) -> torch.Tensor:
        """token_ids [T] -> final hidden states [T, D] (before the last norm)."""
        x = input_rows(self.embed, token_ids, at)
        dtype = x.dtype
        cos = self.cos[at.positions].to(dtype).unsqueeze(1)  # [T, 1, E]
        sin = self.sin[at.positions].to(dtype).unsqueeze(1)
        if self.stack_fn is not None and at.kind == "decode" and x.shape[0] <= self.layers[0].wqkv.max_int4_rows:
            cfg = self.cfg
            return self.stack_fn(x, self.stack_weights, cfg.rms_norm_eps, kv.k, kv.v,
                                 list(at.slots), list(at.lengths), at.slot_index, at.write_rows, cos, sin,
                                 cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, 1.0 / math.sqrt(cfg.head_dim),
                                 at.native, self.layers[0].wqkv.ours)
        for layer in self.layers:
            x = layer(x, cos, sin, at, kv)
        return x

    def decode_logits(self, token_ids: torch.Tensor, at: Attend, kv: KVCache) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A decode-form pass straight to (fp32 logits [T, V], their arg-max [T]) as one scripted
        call, the same bits as logits(forward(...)); None where that call is not set up or the
        rows exceed the 4-bit kernel's (the caller then takes forward and logits)."""
        if (self.logits_fn is None or at.kind != "decode" or at.embeds is not None
                or token_ids.shape[0] > self.layers[0].wqkv.max_int4_rows):
            return None
        cfg = self.cfg
        embed = self.embed.operands if isinstance(self.embed, Q8Embedding) else [self.embed.weight]
        return self.logits_fn(token_ids, embed, self.cos, self.sin, at.positions, self.stack_weights,
                              cfg.rms_norm_eps, kv.k, kv.v, list(at.slots), list(at.lengths), at.slot_index,
                              at.write_rows, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                              1.0 / math.sqrt(cfg.head_dim), at.native, self.layers[0].wqkv.ours,
                              self.norm.weight, self.head_weights)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, D] -> fp32 logits [N, V]."""
        if self.head is not None:
            return self.head(self.norm(hidden)).float()
        w = self.embed.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(self.norm(hidden), w).float()
