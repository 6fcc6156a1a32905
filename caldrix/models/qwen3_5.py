"""Plain torch Qwen3.5 (text): gated delta-net linear attention beside gated full attention.

Layers are of two kinds (`layer_types`): "linear_attention" layers keep, per sequence, a conv
window (the last kernel-1 inputs of a depthwise causal conv) and a float32 recurrent matrix
per value head (models/gated_delta.py); "full_attention" layers keep K/V rows, like llama's.
Called as llama's Decoder is: `model(ids [T], at: Attend, state) -> hidden [T, D]`, then
`model.logits(hidden)`. The per-slot state is `Qwen35.new_state(...)`, a `Qwen35State`.

The maths follows transformers' modeling_qwen3_5.py (5.x), which tests/test_qwen3_5.py holds
this file to: zero-centred RMSNorm (x * (1 + w)), a q projection that also yields a sigmoid
output gate, per-head q/k norms, RoPE on the first head_dim * partial_rotary_factor dims (the
multimodal rope's three position rows are equal for text, so it is ordinary RoPE), and a
gated RMSNorm (w * norm(x) * silu(z)) before the linear layers' out_proj.

Shapes: T rows, D hidden, H query/G kv heads, E head dim, R rotary dims, S slots, C context rows,
W conv channels (2*nk*dk + nv*dv), nk/nv linear key/value heads of dk/dv dims, K conv kernel."""

from __future__ import annotations

import json
from pathlib import Path

import attrs
import torch
import torch.nn.functional as F
from torch import nn

from caldrix.kernels import native
from caldrix.kernels.packed import PackedLinear, pack_linears
from caldrix.kernels.q4_quantize import quantize_head, quantize_linears
from caldrix.models import gated_delta
from caldrix.models.base import Attend, attend_cached
from caldrix.models.qwen3_5_state import Qwen35Snapshot, Qwen35State  # noqa: F401 (re-exported)

ARCHITECTURES = ("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration")


@attrs.frozen
class Qwen35Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rotary_dim: int
    rope_theta: float
    rms_norm_eps: float
    tie_embeddings: bool
    max_positions: int
    attention_bias: bool
    layer_types: tuple[str, ...]
    conv_kernel: int
    linear_key_heads: int
    linear_value_heads: int
    linear_key_dim: int
    linear_value_dim: int

    @property
    def full_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "full_attention")

    @property
    def linear_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "linear_attention")

    @property
    def conv_dim(self) -> int:
        return 2 * self.linear_key_heads * self.linear_key_dim + self.linear_value_heads * self.linear_value_dim

    @classmethod
    def from_dir(cls, path: Path) -> "Qwen35Config":
        return cls.from_dict(json.loads((Path(path) / "config.json").read_text()))

    @classmethod
    def from_dict(cls, raw: dict) -> "Qwen35Config":
        """Both shapes of config.json: `qwen3_5_text` (the text fields at the top) and the
        composite `qwen3_5` (them under `text_config`, beside a `vision_config` this file
        ignores). In the composite, the top-level `tie_word_embeddings` is the one the
        checkpoint was saved under (Qwen3.5-0.8B sets it at both levels)."""
        archs = raw.get("architectures") or []
        kind = raw.get("model_type")
        if kind not in ("qwen3_5", "qwen3_5_text") and not any(a in ARCHITECTURES for a in archs):
            raise ValueError(f"not a Qwen3.5 config: model_type {kind!r}, architectures {archs!r}")
        text = raw.get("text_config") if kind == "qwen3_5" or "text_config" in raw else raw
        if not isinstance(text, dict):
            raise ValueError("a qwen3_5 config needs a text_config object")
        tie = raw.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
        if text.get("hidden_act", "silu") not in ("silu", "swish"):  # both SiLU in transformers
            raise ValueError(f"unsupported hidden_act {text['hidden_act']!r}; Qwen3.5 uses silu")
        rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
        if rope.get("rope_type", rope.get("type", "default")) != "default":
            raise ValueError(f"unsupported rope_type {rope.get('rope_type')!r}; only default RoPE is implemented")
        heads = text["num_attention_heads"]
        head_dim = text.get("head_dim") or text["hidden_size"] // heads
        partial = rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25))
        n = text["num_hidden_layers"]
        types = text.get("layer_types")
        if types is None:  # as transformers derives it: every interval-th layer is full attention
            every = text.get("full_attention_interval", 4)
            types = ["linear_attention" if (i + 1) % every else "full_attention" for i in range(n)]
        if len(types) != n or set(types) - {"linear_attention", "full_attention"}:
            raise ValueError(f"layer_types must name {n} layers, each linear_attention or full_attention")
        return cls(
            vocab_size=text["vocab_size"],
            hidden_size=text["hidden_size"],
            intermediate_size=text["intermediate_size"],
            num_layers=n,
            num_heads=heads,
            num_kv_heads=text.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rotary_dim=int(head_dim * partial),
            rope_theta=float(rope.get("rope_theta", text.get("rope_theta", 10000.0))),
            rms_norm_eps=text.get("rms_norm_eps", 1e-6),
            tie_embeddings=bool(tie),
            max_positions=text.get("max_position_embeddings", 32768),
            attention_bias=bool(text.get("attention_bias", False)),
            layer_types=tuple(types),
            conv_kernel=text.get("linear_conv_kernel_dim", 4),
            linear_key_heads=text.get("linear_num_key_heads", 16),
            linear_value_heads=text.get("linear_num_value_heads", 32),
            linear_key_dim=text.get("linear_key_head_dim", 128),
            linear_value_dim=text.get("linear_value_head_dim", 128),
        )


def native_delta(device) -> bool:
    """Whether a linear layer's decode step runs as caldrix::delta_decode (kernels/delta.cpp):
    on the CPU where the kernels compiled, for every step of the process or none (its float
    sums are not torch's, and a reply must not depend on the step)."""
    return torch.device(device).type == "cpu" and native.has_delta_decode()


def dense(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x in `dtype`, contiguous, in one copy (x.to(dtype) keeps a transposed layout)."""
    return torch.empty(x.shape, dtype=dtype, device=x.device).copy_(x)


def zc_norm(x: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """Zero-centred RMSNorm: `scale` is 1 + w, float32, made at load; the product is taken in
    float32 and then cast, as transformers' Qwen3_5RMSNorm does (llama casts first)."""
    return F.rms_norm(x.float(), scale.shape, scale, eps).to(x.dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x [T, heads, E]; cos, sin [T, 1, R]: RoPE on the first R dims (half-split layout), the rest as is
    r = cos.shape[-1]
    xr, rest = x[..., :r], x[..., r:]
    half = torch.cat((-xr[..., r // 2:], xr[..., : r // 2]), dim=-1)
    return torch.cat((xr * cos + half * sin, rest), dim=-1)


class FullAttention(nn.Module):
    def __init__(self, cfg: Qwen35Config, slot: int):
        super().__init__()
        self.cfg, self.slot = cfg, slot  # slot: this layer's index among the full-attention layers
        h, g, e, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size
        self.sizes = (2 * h * e, g * e, g * e)
        self.wqkv = nn.Linear(d, sum(self.sizes), bias=cfg.attention_bias)  # q+gate interleaved per head, k, v
        self.wo = nn.Linear(h * e, d, bias=cfg.attention_bias)
        self.q_scale = nn.Parameter(torch.ones(e, dtype=torch.float32))  # 1 + q_norm.weight
        self.k_scale = nn.Parameter(torch.ones(e, dtype=torch.float32))

    def forward(self, x, cos, sin, at: Attend, state) -> torch.Tensor:
        cfg = self.cfg
        T, h, g, e = x.shape[0], cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        qg, k, v = self.wqkv(x).split(self.sizes, dim=-1)
        qg = qg.view(T, h, 2 * e)
        q, gate = qg[..., :e], qg[..., e:].reshape(T, h * e)
        q = rotate(zc_norm(q, self.q_scale, cfg.rms_norm_eps), cos, sin)  # [T, H, E]
        k = rotate(zc_norm(k.view(T, g, e), self.k_scale, cfg.rms_norm_eps), cos, sin)  # [T, G, E]
        attn = attend_cached(q, k, v.view(T, g, e), at, state.k[self.slot], state.v[self.slot])  # [T, H*E]
        return self.wo(attn * torch.sigmoid(gate))


class LinearAttention(nn.Module):
    """Gated DeltaNet: projections, the depthwise causal conv (kernel K) with its window, the
    gated delta rule with per-head decay g = -exp(A_log) * softplus(a + dt_bias) and write
    strength beta = sigmoid(b), the gated RMSNorm, out_proj."""

    def __init__(self, cfg: Qwen35Config, slot: int):
        super().__init__()
        self.cfg, self.slot = cfg, slot  # slot: this layer's index among the linear layers
        nk, nv, dk, dv, d = (cfg.linear_key_heads, cfg.linear_value_heads, cfg.linear_key_dim,
                             cfg.linear_value_dim, cfg.hidden_size)
        if nv % nk:
            raise ValueError(f"linear_num_value_heads {nv} is not a multiple of linear_num_key_heads {nk}")
        self.sizes = (cfg.conv_dim, nv * dv, nv, nv)
        self.w_in = nn.Linear(d, sum(self.sizes), bias=False)  # in_proj_qkv, in_proj_z, in_proj_b, in_proj_a
        self.conv = nn.Parameter(torch.empty(cfg.conv_dim, cfg.conv_kernel))  # [W, K]
        self.neg_a = nn.Parameter(torch.empty(nv, dtype=torch.float32))  # -exp(A_log), float32
        self.dt_bias = nn.Parameter(torch.empty(nv, dtype=torch.float32))
        self.norm = nn.Parameter(torch.empty(dv))  # the gated RMSNorm's weight (not zero-centred)
        self.out = nn.Linear(nv * dv, d, bias=False)

    def forward(self, x, at: Attend, state) -> torch.Tensor:
        cfg = self.cfg
        T = x.shape[0]
        nk, nv, dk, dv = cfg.linear_key_heads, cfg.linear_value_heads, cfg.linear_key_dim, cfg.linear_value_dim
        proj = self.w_in(x)  # [T, W + nv*dv + 2*nv]
        conv_state, rec_state = state.conv[self.slot], state.rec[self.slot]  # [S, W, K-1], [S, nv, dk, dv]
        if (at.kind == "decode" or T == 1) and native_delta(x.device):
            # the whole step below, one row per slot, as one compiled call (kernels/delta.cpp)
            o = torch.ops.caldrix.delta_decode(proj.contiguous(), conv_state, self.conv, rec_state, list(at.slots),
                                               self.neg_a, self.dt_bias, self.norm, nk, dk, dv, cfg.rms_norm_eps)
            return self.out(o)
        mixed, z, b, a = proj.split(self.sizes, dim=-1)
        g = self.neg_a * F.softplus(a.float() + self.dt_bias)  # [T, nv], log-space decay <= 0
        beta = b.sigmoid().float()
        if at.kind == "decode" or T == 1:
            if at.kind == "decode":
                rows = at.slot_index
                window = torch.cat((conv_state.index_select(0, rows), mixed.unsqueeze(-1)), dim=-1)  # [T, W, K]
                conv_state.index_copy_(0, rows, window[..., 1:])
            else:
                rows = torch.tensor(at.slots, device=x.device)
                window = torch.cat((conv_state[at.slots[0]], mixed.t()), dim=-1)[None]  # [1, W, K]
                conv_state[at.slots[0]] = window[0, :, 1:]
            mixed = F.silu((window * self.conv).sum(-1))  # [T, W]
            q, k, v = mixed.float().split((nk * dk, nk * dk, nv * dv), dim=-1)
            q = gated_delta.l2norm(q.view(T, nk, dk), scale=dk ** -0.5)
            k = gated_delta.l2norm(k.view(T, nk, dk))
            if nv != nk:  # each key head serves nv/nk consecutive value heads
                q, k = q.repeat_interleave(nv // nk, dim=1), k.repeat_interleave(nv // nk, dim=1)
            v = v.reshape(T, nv, dv)
            # one row: its slot's matrices in place (a view); several: gathered and put back
            s = rec_state[at.slots[0]] if T == 1 else rec_state.index_select(0, rows)
            o = gated_delta.recurrent(q.reshape(T * nv, dk), k.reshape(T * nv, dk), v.reshape(T * nv, dv),
                                      g.reshape(T * nv), beta.reshape(T * nv), s.view(T * nv, dk, dv))
            if T > 1:
                rec_state.index_copy_(0, rows, s)
            o = o.view(T, nv, dv)
        else:
            (slot,) = at.slots
            window = torch.cat((conv_state[slot], mixed.t()), dim=-1)  # [W, K-1+T]
            conv_state[slot] = window[:, -(cfg.conv_kernel - 1):]
            mixed = F.silu(F.conv1d(window.unsqueeze(0), self.conv.unsqueeze(1), groups=cfg.conv_dim)[0])  # [W, T]
            # straight to the head-major float32 rows the chunked rule runs over: one copy each
            q, k, v = (dense(m.view(heads, dim, T).transpose(1, 2), torch.float32) for m, heads, dim in
                       zip(mixed.split((nk * dk, nk * dk, nv * dv)), (nk, nk, nv), (dk, dk, dv)))
            q = gated_delta.l2norm(q, scale=dk ** -0.5)  # [nk, T, dk]
            k = gated_delta.l2norm(k)
            if nv != nk:
                q, k = q.repeat_interleave(nv // nk, dim=0), k.repeat_interleave(nv // nk, dim=0)
            o, s = gated_delta.chunked(q, k, v, g.t().contiguous(), beta.t().contiguous(), rec_state[slot])
            rec_state[slot] = s
            o = o.transpose(0, 1)  # [T, nv, dv]
        # gated RMSNorm, with transformers' casts: the rule's output rounded to the model dtype,
        # norm in float32, weight in the model dtype, the silu gate in float32. Every operand is
        # made contiguous [T, nv, dv] in its first copy: on the strided views (the prefill's
        # head-major output, z's columns of the fused projection) each pass ran several times
        # slower and rms_norm fell back to its unfused form.
        o = dense(o, x.dtype).float()
        o = self.norm * F.rms_norm(o, (dv,), eps=cfg.rms_norm_eps).to(x.dtype)
        gate = F.silu(dense(z.view(T, nv, dv), torch.float32))
        return self.out(gate.mul_(o).to(x.dtype).view(T, nv * dv))


class Layer(nn.Module):
    def __init__(self, cfg: Qwen35Config, index: int):
        super().__init__()
        self.cfg = cfg
        self.full = cfg.layer_types[index] == "full_attention"
        n = sum(1 for t in cfg.layer_types[:index] if t == cfg.layer_types[index])
        self.mixer = FullAttention(cfg, n) if self.full else LinearAttention(cfg, n)
        self.input_scale = nn.Parameter(torch.ones(cfg.hidden_size, dtype=torch.float32))
        self.post_scale = nn.Parameter(torch.ones(cfg.hidden_size, dtype=torch.float32))
        self.w_gate_up = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.w_down = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x, cos, sin, at: Attend, state) -> torch.Tensor:
        h = zc_norm(x, self.input_scale, self.cfg.rms_norm_eps)
        x = x + (self.mixer(h, cos, sin, at, state) if self.full else self.mixer(h, at, state))
        gate, up = self.w_gate_up(zc_norm(x, self.post_scale, self.cfg.rms_norm_eps)).chunk(2, dim=-1)
        return x + self.w_down(F.silu(gate) * up)


class Qwen35(nn.Module):
    """The Qwen3.5 text model. `forward(ids, at, state)`: final hidden rows before the last
    norm; `logits(hidden)`: float32 logits. See Qwen35State for what a slot holds."""

    # The linear layers' state is a running summary: a held slot is reusable only whole, or from
    # a snapshot (models/base.py).
    reuses_rows = False

    def __init__(self, cfg: Qwen35Config):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                  _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(Layer(cfg, i) for i in range(cfg.num_layers))
        self.norm_scale = nn.Parameter(torch.ones(cfg.hidden_size, dtype=torch.float32))
        self.lm_head = None if cfg.tie_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.cos = self.sin = None
        self.head: nn.Module | None = None  # set by pack() or quantize(): the head's weight, packed
        self.quantized = False  # set by quantize(): the head and projections are 4-bit groups

    def pack(self) -> None:
        """Swap every bias-free Linear, and the head, for a PackedLinear (bfloat16 on a CPU with
        oneDNN's bf16 support: see can_pack). The tied head gets a packed copy of the embedding
        (the lookup needs the plain rows): 0.5 GB more at decider-0.8b's shape."""
        pack_linears(self)
        self.head = self._packed_head()

    def _packed_head(self) -> nn.Module:
        """The untied lm_head (packed by pack_linears), or a packed copy of the tied embedding."""
        return self.lm_head if self.lm_head is not None else PackedLinear(self.embed.weight)

    def quantize(self, max_int4_rows: int) -> int:
        """`--weights q4` (bfloat16 on the CPU: kernels/q4_quantize.py): the head and every
        projection the 4-bit kernels take become 4-bit groups, the projections with a packed
        copy of their dequantized weights for calls past `max_int4_rows` rows; what they cannot
        take is packed as pack() would. The embedding stays as loaded (the lookup reads plain
        rows). Returns how many layers became 4-bit, the head among them."""
        head = quantize_head(self.embed.weight if self.lm_head is None else self.lm_head.weight, max_int4_rows)
        if head is not None:
            self.head, self.lm_head = head, None if self.lm_head is None else head
        count = (head is not None) + quantize_linears(self.layers, max_int4_rows)
        pack_linears(self)  # what the 4-bit kernels do not take, an unfitting untied head included
        if head is None:
            self.head = self._packed_head()
        self.quantized = True
        return count

    @staticmethod
    def new_state(cfg: Qwen35Config, num_slots: int, rows: int, dtype: torch.dtype, device="cpu") -> Qwen35State:
        return Qwen35State(cfg, num_slots, rows, dtype, device)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    def setup_rope(self, rows: int) -> None:
        """cos and sin for positions 0..rows-1, float32 [rows, R] (forward grows them on need)."""
        r = self.cfg.rotary_dim
        inv = 1.0 / (self.cfg.rope_theta ** (torch.arange(0, r, 2, dtype=torch.int64).float() / r))
        freqs = torch.outer(torch.arange(rows, dtype=torch.int64).float(), inv)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos, self.sin = emb.cos().to(self.embed.weight.device), emb.sin().to(self.embed.weight.device)

    def setup(self, rows: int) -> None:
        """The engine's hook for tables sized by the context (models/base.py)."""
        self.setup_rope(rows)

    def forward(self, token_ids: torch.Tensor, at: Attend, state: Qwen35State) -> torch.Tensor:
        """token_ids [T] -> hidden [T, D] (before the final norm), advancing `state`.

        Prefill form: one slot, positions start..start+T-1, where start is the slot's length
        (continue) or 0 (a new sequence: the slot's linear state is cleared first). Decode
        form: one row per slot, each at its slot's length or at 0; rows with length 0 are
        padding (they run into a scratch slot and their result is meaningless). Any other
        position raises: the recurrent state cannot go back (restore a snapshot instead)."""
        # The delta rule's decays (exp of sums of log-decays) and the recurrent matrices they
        # scale reach float32's subnormal range, where x86 arithmetic runs tens of times slower;
        # flushing subnormals to zero changes results by under 1.2e-38. The flag is per thread
        # (MXCSR), so it is set on whichever thread runs the model for the call, and cleared
        # after it: the thread's other work (another model, the caller's own floats) keeps
        # IEEE subnormals.
        torch.set_flush_denormal(True)
        try:
            return self._forward(token_ids, at, state)
        finally:
            torch.set_flush_denormal(False)

    def _forward(self, token_ids: torch.Tensor, at: Attend, state: Qwen35State) -> torch.Tensor:
        top = state.begin(at)
        if self.cos is None or top >= self.cos.shape[0]:
            self.setup_rope(max(2 * top, 256))
        x = self.embed(token_ids)
        cos = self.cos[at.positions].to(x.dtype).unsqueeze(1)  # [T, 1, R]
        sin = self.sin[at.positions].to(x.dtype).unsqueeze(1)
        for layer in self.layers:
            x = layer(x, cos, sin, at, state)
        state.end(at)
        return x

    def read_logits(self, hidden: torch.Tensor, ids: tuple[int, ...]) -> torch.Tensor | None:
        """hidden [1, D] -> float32 logits [len(ids)] of those tokens alone: a reading needs a
        few label logits, not the whole head. None when the head's plain rows are not kept (an
        untied head packed at load) or where the head is 4-bit (its rows are not the embedding's
        any more: the reading takes the whole head, as decoding does)."""
        if self.quantized:
            return None
        w = self.embed.weight if self.lm_head is None else getattr(self.lm_head, "weight", None)
        if w is None:
            return None
        x = zc_norm(hidden, self.norm_scale, self.cfg.rms_norm_eps)
        return F.linear(x, w[list(ids)]).float()[0]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, D] -> float32 logits [N, V]."""
        x = zc_norm(hidden, self.norm_scale, self.cfg.rms_norm_eps)
        if self.head is not None:
            return self.head(x).float()
        w = self.embed.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(x, w).float()
