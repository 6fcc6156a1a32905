"""Loading a llama-family Decoder: a Hugging Face directory, and where the directory was
converted from a GGUF, that file's 4-bit blocks kept as they are.

`load` is the one entry (models/__init__.py names it for model_type llama and qwen3), in one
straight line: plan from the GGUF's index which weights stay 4-bit (nothing unpacked), read the
directory's other tensors one at a time (load_decoder), swap the projections for Int4Linear
layers (quantize_from_gguf), the head for the Q8_0 blocks (head_from_gguf), serve a tied
embedding from them (embed_from_head), and give the model the scripted decode pass where every
layer can take it. The blocks and layers are caldrix/kernels/q4.py's; which GGUF tensor makes
which Decoder weight (the fused projections, llama.cpp's q/k row permutation) is llama's and
lives here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch
from torch import nn

from caldrix.kernels import native, q4_quantize, scripted
from caldrix.kernels.packed import can_pack
from caldrix.kernels.q4 import (
    Q4_1,
    Q8_0,
    HEAD_SLICE,
    Int4Linear,
    Q8AsInt4Linear,
    Q8Embedding,
    ours_built,
    ours_fits,
    runs_4bit,
    unpack_q4_1,
    unpack_q8_0,
)
from caldrix.models.base import Loaded
from caldrix.models.llama import Decoder, DecoderConfig
from caldrix.weights.gguf_index import read_tensors
from caldrix.weights.tensor_files import MissingWeight, TensorFiles, model_files


def load(path: Path, *, dtype: torch.dtype, device: str = "cpu", int4_from: Path | None = None,
         max_batch: int = 1, int4_rows: int = 8, pack: bool = True, quantize: bool = False) -> Loaded:
    """A Decoder from the Hugging Face directory `path`. `int4_from`: the GGUF the directory was
    converted from; its Q4_1 projections then stay 4-bit (the CPU only: bfloat16, or float32
    where caldrix::q4_mm_f32 is built). `int4_rows`: calls of up to this many rows take the 4-bit
    kernel where a layer keeps dense weights beside its blocks (torch's kernel); `max_batch`: the
    most decode rows a step has (the head's kernel is chosen by it, below)."""
    if quantize:
        if int4_from is not None or not (pack and q4_quantize.usable(dtype, device)):
            raise ValueError("--weights q4 needs --dtype bfloat16 on the cpu lane and a Hugging Face directory "
                             "(a GGUF keeps its own 4-bit blocks)")
        model = load_decoder(path, dtype, device)
        layers = model.quantize(int4_rows)
        return Loaded(model, row_count_dependent=q4_quantize.dense_left(model.layers), int4_layers=layers)
    skip: frozenset[str] = frozenset()
    if int4_from is not None:
        if not runs_4bit(dtype, device):
            raise ValueError("4-bit weights need the cpu lane and --dtype bfloat16, or float32 on a CPU with "
                             "AVX2, FMA and F16C")
        cfg = DecoderConfig.from_dir(path)
        skip = dense_not_kept(int4_from, cfg.num_layers, dtype, tied=cfg.tie_embeddings)
    model = load_decoder(path, dtype, device, skip=skip)
    if int4_from is None:
        if pack and can_pack(dtype, device):
            model.pack()
        return Loaded(model)
    layers = quantize_from_gguf(model, int4_from)
    ours = bool(getattr(model, "int4_ours", False)) and layers > 0
    int4_head = q8_embed = scripted_rows = scripted_pass = False
    if layers:
        set_max_int4_rows(model, int4_rows)
        # The Q8_0 head's 4-bit halves: through caldrix::q4_mm they cost less than the dense
        # head at 1 row and at 8; through torch's int4 kernel half of it at 1 row but twice
        # it at 8. A head chosen by the step's row count would make a reply depend on its
        # batch mates, so it is chosen once: by the kernel, else by --max-batch.
        int4_head = (ours or max_batch == 1) and head_from_gguf(model, int4_from)
        # A tied embedding read from the head's blocks: 56 MB less for SmolLM2, same bits,
        # checked against the table read back a slice at a time.
        q8_embed = int4_head and embed_from_head(model, lambda start, stop: read_embedding(path, dtype, (start, stop)))
        scripted_rows = script_decode_rows(model)
        scripted_pass = scripted_rows and int4_head and script_decode_logits(model)
    if isinstance(model.embed, Pending):  # skipped for the head's blocks, which did not serve it
        model.embed = nn.Embedding.from_pretrained(read_embedding(path, dtype).to(device), freeze=True)
    pending = [name for name, module in model.named_modules() if isinstance(module, Pending)]
    if pending:
        raise RuntimeError(f"the 4-bit load left {pending[0]} without weights")
    return Loaded(model, row_count_dependent=not layers, int4_layers=layers, int4_head=int4_head,
                  q8_embed=q8_embed, int4_ours=ours, scripted_rows=scripted_rows, scripted_pass=scripted_pass)


def unpermute_rows(n_rows: int, n_head: int) -> torch.Tensor:
    """Index that undoes llama.cpp's q/k row permutation: hf = gguf[index]."""
    perm = torch.arange(n_rows).reshape(n_head, 2, n_rows // n_head // 2).transpose(1, 2).reshape(-1)
    return torch.argsort(perm)


def script_decode_rows(model: nn.Module) -> bool:
    """Where every layer's four projections are 4-bit and no layer has q/k norms, give the
    model the scripted decode path through all its layers (kernels/scripted.py). Whether it did."""
    projections = [m for b in model.layers for m in (b.wqkv, b.wo, b.w_gate_up, b.w_down)]
    if not all(b.q_norm is None for b in model.layers) or not all(isinstance(m, Int4Linear) for m in projections):
        return False
    if len({m.ours for m in projections}) != 1:
        return False  # the stack names one kernel for every projection
    fn = scripted.compile_stack()
    if fn is None:
        return False
    model.stack_fn, model.stack_weights = fn, scripted.stack_weights(model.layers)
    return True


def script_decode_logits(model: nn.Module) -> bool:
    """Where the decode layers are scripted and the head is Q8_0 blocks through the same kernel,
    give the model the whole decode pass, head and arg-max included, as one TorchScript call
    (scripted.decode_logits). Whether it did."""
    head = scripted.head_weights(model.head)
    if model.stack_fn is None or head is None or model.head.ours != model.layers[0].wqkv.ours:
        return False
    fn = scripted.compile_stack(scripted.decode_logits)
    if fn is None:
        return False
    model.logits_fn, model.head_weights = fn, head
    return True


def set_max_int4_rows(model: nn.Module, rows: int) -> None:
    for module in model.modules():
        if isinstance(module, Int4Linear):
            module.max_int4_rows = rows


def head_from_gguf(model: nn.Module, gguf_path: Path) -> bool:
    """Give the model a Q8AsInt4Linear lm_head where the GGUF holds it (or the tied embedding)
    as Q8_0. Returns whether it did; the dense head stays otherwise."""
    tensors = read_tensors(gguf_path)
    t = tensors.get("token_embd.weight") if model.cfg.tie_embeddings else tensors.get("output.weight")
    if t is None or int(t.tensor_type) != Q8_0:
        return False
    q, d = unpack_q8_0(t.data, int(t.shape[0]))
    dtype = model.norm.weight.dtype
    ours = getattr(model, "int4_ours", False) and ours_fits(*q.shape, dtype)
    if dtype != torch.bfloat16 and not ours:
        return False
    model.head = Q8AsInt4Linear(q, d, ours=ours, dtype=dtype)
    return True


def embed_from_head(model: nn.Module, dense_rows: Callable[[int, int], torch.Tensor]) -> bool:
    """Serve a tied embedding from the Q8_0 head's blocks (model.embed becomes a Q8Embedding),
    where the head runs on caldrix::q4_mm and every row read back equals the dense table's bits
    (they do for a GGUF dequantized to float32 and cast to bfloat16). `dense_rows(start, stop)`
    gives the dense table's rows, read a slice at a time, so the whole table is never held.
    Whether it did; where not, model.embed is left as it was."""
    head, cfg = model.head, model.cfg
    if not (cfg.tie_embeddings and isinstance(head, Q8AsInt4Linear) and head.ours
            and model.norm.weight.dtype == torch.bfloat16 and native.has_q4_mm()):
        return False
    q8 = Q8Embedding(head)
    if (q8.num_embeddings, q8.embedding_dim) != (cfg.vocab_size, cfg.hidden_size):
        return False
    with torch.inference_mode():
        for i in range(0, q8.num_embeddings, HEAD_SLICE):
            stop = min(i + HEAD_SLICE, q8.num_embeddings)
            if not torch.equal(q8(torch.arange(i, stop)), dense_rows(i, stop)):
                return False
    model.embed = q8
    return True


# A decoder layer's fused projections and the GGUF tensors each is made of, in order.
PROJECTIONS = {"wqkv": ("attn_q", "attn_k", "attn_v"), "wo": ("attn_output",),
               "w_gate_up": ("ffn_gate", "ffn_up"), "w_down": ("ffn_down",)}


def plan_4bit(gguf_path: Path, num_layers: int, dtype: torch.dtype) -> tuple[bool, list[tuple[int, str]]]:
    """From the GGUF's tensor index alone, nothing unpacked: (whether caldrix's own kernel will
    run the 4-bit layers, the (layer, projection) pairs whose tensors are all Q4_1 and so become
    Int4Linear). One kernel serves every 4-bit layer: caldrix's where it is built for `dtype`
    and takes every shape, else torch's (bfloat16 only; a float32 model then stays dense)."""
    tensors = read_tensors(gguf_path)

    def all_q4(i: int, proj: str) -> bool:
        ts = [tensors.get(f"blk.{i}.{n}.weight") for n in PROJECTIONS[proj]]
        return all(t is not None and int(t.tensor_type) == Q4_1 for t in ts)

    def fits(i: int, proj: str) -> bool:  # a projection that stays dense has no say in the kernel
        ts = [tensors[f"blk.{i}.{n}.weight"] for n in PROJECTIONS[proj]]
        return ours_fits(sum(int(t.shape[1]) for t in ts), int(ts[0].shape[0]), dtype)  # gguf shapes are [K, N]

    pairs = [(i, proj) for i in range(num_layers) for proj in PROJECTIONS if all_q4(i, proj)]
    ours = ours_built(dtype) and all(fits(i, proj) for i, proj in pairs)
    if dtype != torch.bfloat16 and not ours:
        return False, []  # dense weights throughout
    return ours, pairs


def dense_not_kept(gguf_path: Path, num_layers: int, dtype: torch.dtype, tied: bool = False) -> frozenset[str]:
    """The Decoder state names (layers.<i>.<projection>.weight) that quantize_from_gguf will
    replace without keeping a dense copy, so a loader need not read them (load_decoder's
    `skip`). Through caldrix's kernels every call takes the 4-bit blocks, prefill chunks too;
    torch's int4 kernel is slower than the dense matmul for long chunks, so there the dense
    weights stay beside the blocks. And embed.weight, where a `tied` embedding is the GGUF's
    Q8_0 blocks and q4_mm will run the head: embed_from_head then serves it (checked against
    the table read back in slices), else the caller reads the table after all."""
    ours, pairs = plan_4bit(gguf_path, num_layers, dtype)
    if not ours:
        return frozenset()
    names = {f"layers.{i}.{proj}.weight" for i, proj in pairs}
    embd = read_tensors(gguf_path).get("token_embd.weight")
    if (tied and dtype == torch.bfloat16 and embd is not None and int(embd.tensor_type) == Q8_0
            and ours_fits(int(embd.shape[1]), int(embd.shape[0]), dtype)):
        names.add("embed.weight")
    return frozenset(names)


def quantize_from_gguf(model: nn.Module, gguf_path: Path) -> int:
    """Swap the model's projection layers for Int4Linear where the GGUF holds them as Q4_1.

    Returns how many layers were swapped; a layer whose tensors are of another type keeps its
    dense weights. The model must be the Decoder loaded from the same file's conversion (its
    projections may be load_decoder's placeholders where `dense_not_kept` named them). Through
    caldrix's kernels the dense weights are dropped (prefill chunks take the 4-bit blocks too);
    through torch's they stay for calls of more than `max_int4_rows` rows."""
    cfg = model.cfg
    tensors = read_tensors(gguf_path)
    dtype = model.norm.weight.dtype
    ours, pairs = plan_4bit(gguf_path, len(model.layers), dtype)
    model.int4_ours = ours

    def q4(name: str, heads: int | None = None):
        t = tensors[name]
        cols = int(t.shape[0])  # gguf shapes are [K, N]
        q, d, m = unpack_q4_1(t.data, cols)
        if heads is not None:
            idx = unpermute_rows(q.shape[0], heads)
            q, d, m = q[idx], d[idx], m[idx]
        return q, d, m

    permute = cfg.arch == "llama"  # llama.cpp permutes q/k only for its llama family
    heads = {"attn_q": cfg.num_heads, "attn_k": cfg.num_kv_heads} if permute else {}
    swapped = 0
    for i, proj in pairs:
        layer = model.layers[i]
        dense = getattr(layer, proj)
        parts = [q4(f"blk.{i}.{n}.weight", heads.get(n)) for n in PROJECTIONS[proj]]
        keep = None if ours else dense.weight
        setattr(layer, proj, Int4Linear(*(torch.cat(xs) for xs in zip(*parts)), dense=keep, ours=ours, dtype=dtype))
        swapped += 1
    return swapped


def load_decoder(path: Path, dtype: torch.dtype, device="cpu", skip: frozenset[str] = frozenset()) -> Decoder:
    """Build a Decoder from a Hugging Face directory, fusing q/k/v and gate/up on the way.

    Tensors are read one at a time (weights/tensor_files.py) and cast to `dtype` as they come,
    so loading never holds the file's float32 weights beside their cast copies: reading the
    whole float32 state first made loading SmolLM2 peak at 1340 MiB for an engine that then
    holds about 800 (docs/performance-history.md). Casting pieces before concatenating them gives the
    same values.

    `skip`: weights not to read at all, projections (layers.<i>.<wqkv|wo|w_gate_up|w_down>.weight)
    or the embedding (embed.weight); their modules are Pending placeholders, for the caller to
    replace before any forward (the 4-bit load, dense_not_kept: reading them only to drop
    them made loading's peak memory)."""
    cfg = DecoderConfig.from_dir(path)
    with _tensor_files(path) as hf:

        def take(name: str) -> torch.Tensor:
            return hf.get(_stored_name(hf, name, path)).to(dtype)

        ours: dict[str, torch.Tensor] = {"norm.weight": take("norm.weight")}
        if "embed.weight" not in skip:
            ours["embed.weight"] = take("embed_tokens.weight")
        if not cfg.tie_embeddings:
            ours["lm_head.weight"] = take("lm_head.weight")
        for i in range(cfg.num_layers):
            p, a, m = f"layers.{i}.", f"layers.{i}.self_attn.", f"layers.{i}.mlp."
            ours[p + "input_norm.weight"] = take(p + "input_layernorm.weight")
            ours[p + "post_norm.weight"] = take(p + "post_attention_layernorm.weight")
            parts = {"wqkv": (a + "q_proj", a + "k_proj", a + "v_proj"), "wo": (a + "o_proj",),
                     "w_gate_up": (m + "gate_proj", m + "up_proj"), "w_down": (m + "down_proj",)}
            for proj, names in parts.items():
                if p + proj + ".weight" not in skip:
                    ours[p + proj + ".weight"] = torch.cat([take(n + ".weight") for n in names])
            if cfg.arch == "qwen3":
                ours[p + "q_norm.weight"] = take(a + "q_norm.weight")
                ours[p + "k_norm.weight"] = take(a + "k_norm.weight")
    with torch.device("meta"):
        model = Decoder(cfg)
    missing, unexpected = model.load_state_dict(ours, strict=False, assign=True)
    if unexpected or set(missing) != set(skip):
        raise RuntimeError(f"loading {path}: unexpected weights {sorted(unexpected)[:3]}, "
                           f"missing {sorted(set(missing) ^ set(skip))[:3]}")
    for name in skip:
        if name == "embed.weight":
            model.embed = Pending(cfg.vocab_size, cfg.hidden_size)
            continue
        owner, proj, _ = name.rsplit(".", 2)
        linear = getattr(model.get_submodule(owner), proj)
        setattr(model.get_submodule(owner), proj, Pending(linear.out_features, linear.in_features))
    return model.to(device).eval().requires_grad_(False)


def _tensor_files(path: Path):
    return TensorFiles(model_files(path))


def _stored_name(hf, name: str, path: Path) -> str:
    for prefix in ("model.", ""):
        if prefix + name in hf:
            return prefix + name
    raise MissingWeight(path, ("" if name.startswith("lm_head") else "model.") + name)


def read_embedding(path: Path, dtype: torch.dtype, rows: tuple[int, int] | None = None) -> torch.Tensor:
    """The token embedding of a Hugging Face directory cast to `dtype`, whole or only rows
    start..stop-1: for a loader that skipped it (load_decoder's `skip`) and reads it back in
    slices to check another source of the same rows, or whole where that source is not taken."""
    with _tensor_files(path) as hf:
        return hf.get(_stored_name(hf, "embed_tokens.weight", path), rows).to(dtype)


class Pending(nn.Module):
    """A projection or the embedding whose weights load_decoder did not read: the 4-bit load
    replaces it (quantize_from_gguf; `load` for the embedding). Running one means that
    never happened."""

    def __init__(self, out_features: int, in_features: int):
        super().__init__()
        self.out_features, self.in_features = out_features, in_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("a module whose weights were never loaded ran")
