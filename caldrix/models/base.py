"""The seam between the engine and an architecture: what every model file implements.

The engine (caldrix/engine.py) drives any model through this contract and nothing else:

    state  = Model.new_state(cfg, num_slots, rows, dtype, device)  # per-slot state, allocated once
    hidden = model(ids, at, state)       # ids LongTensor [T], `Attend` plan -> hidden rows [T, D]
    logits = model.logits(hidden)        # [N, D] -> float32 [N, V]
    snap   = state.snapshot(slot, length); state.restore(snap, slot)

plus these attributes: `cfg.vocab_size`, `dtype` (the activations' dtype), the class attribute
`reuses_rows` (True: the state at position p depends only on tokens 0..p-1 and survives a later
write past p, so a slot's held rows can be reused up to any common prefix; False: the state is a
running summary, reusable only whole, at the end of what the slot computed, or from a snapshot),
and optionally `setup(rows)` (tables sized by the context), `uses_native(device)` (whether its
decode-form passes take the compiled kernels, which Attend.native then says to every pass) and
`decode_logits(ids, at, state)` (a fused decode pass straight to (logits, arg-max), or None).

A model file never sees a request, a scheduler or a server (tests/test_layering.py checks the
imports). Architectures are found by config model_type in caldrix/models/__init__.py.

Shapes: T packed rows, D hidden, S slots, C context rows, G kv heads, E head dim, N rows.
"""

from __future__ import annotations

import functools
import math
from typing import Any, ClassVar, Protocol

import attrs
import torch
import torch.nn.functional as F


@attrs.frozen
class Attend:
    """Where the T rows of one forward pass live in the per-slot state.

    Two forms, one per call:
    - decode: one row per slot in `slots`, at `positions` [T]; `lengths` [T] is each row's
      visible key count (position + 1). A padding row has length 0: it writes into the
      engine's scratch slot and its attention output is zero. (A verify run's rows share a slot.)
    - prefill: T rows of one slot at positions start..start+T-1 (`slots` = (slot,)).

    `embeds` [N, D] with `embed_rows` [N]: input embeddings that replace the token table's rows
    at those rows of the pass (image features; `input_rows` applies them); None for text.
    """

    kind: str  # "decode" | "prefill"
    slots: tuple[int, ...]
    positions: torch.Tensor  # [T] int64: RoPE positions
    write_rows: torch.Tensor  # [T] int64: KV row each token is written to
    lengths: tuple[int, ...] = ()  # decode only
    slot_index: torch.Tensor | None = None  # decode only: torch.tensor(slots), built once per pass
    # decode only: attend with the compiled caldrix::decode_attend (kernels/native.py). The
    # engine sets it for all its decode passes or none, since its bits are not SDPA's.
    native: bool = False
    embeds: torch.Tensor | None = None  # [N, D]
    embed_rows: torch.Tensor | None = None  # [N] int64, rows of this pass
    # prefill only: write_rows[0] as a Python int. Every layer needs it to slice the cache, and
    # reading it from a GPU tensor would wait for the device once per layer (the engine passes
    # it; other callers get it read once here).
    start: int = attrs.field(default=attrs.Factory(
        lambda self: int(self.write_rows[0]) if self.kind == "prefill" else 0, takes_self=True))


def input_rows(table, ids: torch.Tensor, at: Attend) -> torch.Tensor:
    """ids [T] -> input rows [T, D]: the token table's rows, with `at.embeds` in place of the rows
    `at.embed_rows` names."""
    x = table(ids)
    if at.embeds is not None:
        x[at.embed_rows] = at.embeds.to(x.dtype)
    return x


class Snapshot(Protocol):
    """A slot's state at a position, to restore into a slot later. `in_place`: it still lives in
    the slot's own rows (an attention cache keeps them), so a write into that slot below
    `length` spoils it; the engine tracks that and refuses to restore a spoiled one."""

    slot: int
    length: int
    in_place: bool


class SlotState(Protocol):
    """Per-slot state of one model, for `num_slots` sequences of up to `rows` positions."""

    @property
    def nbytes(self) -> int: ...

    def snapshot(self, slot: int, length: int) -> Snapshot: ...

    def restore(self, snap: Snapshot, slot: int) -> None: ...


class Model(Protocol):
    """What the engine calls (see the module docstring). nn.Module subclasses satisfy it."""

    cfg: Any
    reuses_rows: ClassVar[bool]

    @classmethod
    def new_state(cls, cfg: Any, num_slots: int, rows: int, dtype: torch.dtype, device) -> SlotState: ...

    @property
    def dtype(self) -> torch.dtype: ...

    def __call__(self, ids: torch.Tensor, at: Attend, state: SlotState) -> torch.Tensor: ...

    def logits(self, hidden: torch.Tensor) -> torch.Tensor: ...


@attrs.frozen
class RowsSnapshot:
    """An attention cache's snapshot: the rows stay in the slot; only the length is kept."""

    slot: int
    length: int
    in_place: bool = True


class KVCache:
    """K and V rows for `num_slots` sequences of `rows` positions, allocated once: the state of
    attention-only models.

    Layout per layer: [S, G, C, E]. The rows start uninitialized: attention reads a slot's
    rows only below the positions written into it (prefill up to its own rows, decode up to
    its length, padding rows none), so no value there is ever read. Zeroing them cost 7 s of
    start-up at --max-batch 8 and the default 8192 rows (3 GiB of float32 touched at once);
    left empty, the OS maps the pages as rows are first written. tests/test_engine.py fills
    them with NaN to check nothing reads them."""

    def __init__(self, cfg, num_slots: int, rows: int, dtype: torch.dtype, device):
        shape = (cfg.num_layers, num_slots, cfg.num_kv_heads, rows, cfg.head_dim)
        self.k = torch.empty(shape, dtype=dtype, device=device)
        self.v = torch.empty(shape, dtype=dtype, device=device)
        self.rows = rows
        self.num_slots = num_slots

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def copy_rows(self, src: int, dst: int, n: int) -> None:
        """Copy the first n rows of slot src into slot dst (all layers)."""
        self.k[:, dst, :, :n] = self.k[:, src, :, :n]
        self.v[:, dst, :, :n] = self.v[:, src, :, :n]

    def snapshot(self, slot: int, length: int) -> RowsSnapshot:
        """Free: the rows stay where they are (a later write past `length` does not touch them)."""
        return RowsSnapshot(slot, length)

    def restore(self, snap: RowsSnapshot, slot: int) -> None:
        """Into its own slot nothing moves; into another the rows are copied."""
        if slot != snap.slot:
            self.copy_rows(snap.slot, slot, snap.length)


@attrs.frozen
class Loaded:
    """What an architecture's loader hands the engine: the model, and what loading chose (the
    start-up line reports it; tests check it)."""

    model: Any  # a Model
    # Whether the model's matmuls may give a row other bits with another row count (dense
    # weights): the engine then pads every decode step to --max-batch rows.
    row_count_dependent: bool = True
    int4_layers: int = 0  # projections kept as 4-bit GGUF blocks
    int4_head: bool = False  # the lm_head kept as the GGUF's Q8_0 blocks
    q8_embed: bool = False  # and the tied embedding read from them
    int4_ours: bool = False  # the 4-bit matmuls run caldrix's kernel, not torch's
    scripted_rows: bool = False  # decode-form layers run as one TorchScript call
    scripted_pass: bool = False  # and the embedding, head and arg-max with them


@functools.cache
def _prompt_kernel() -> bool:
    """Whether caldrix::prompt_attend was built here (decided once a process)."""
    from caldrix.kernels import native

    return native.has_prompt_attend()


def attend_cached(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, at: Attend, K: torch.Tensor,
                  V: torch.Tensor) -> torch.Tensor:
    """Write a pass's keys and values into one layer's per-slot rows and attend over them, in
    torch's SDPA: q [T, H, E], k and v [T, G, E]; K and V [S, G, C, E]. Returns [T, H*E].
    A prompt chunk that carries image rows (`at.embeds`), in bfloat16 with E = 64, attends on
    caldrix::prompt_attend where it was built (AMX CPUs; kernels/prompt_attend.cpp says why):
    the same sums to bfloat16 rounding, where a text chunk keeps SDPA's bits.

    decode: one row per slot (at.slots, at.lengths), one call per slot over exactly its own
    rows: a padded, masked batch would change the float reduction with the batch mates'
    lengths (measured in bf16), and a reply must not depend on who else is decoding. A
    padding row (length 0) gets zeros. prefill: T rows of one slot from at.write_rows[0],
    causal over the slot's rows before them and their own."""
    T, h, e = q.shape
    scale = 1.0 / math.sqrt(e)
    if at.kind == "decode":
        K[at.slot_index, :, at.write_rows] = k
        V[at.slot_index, :, at.write_rows] = v
        qs = q.unsqueeze(2)  # [T, H, 1, E]
        zero = q.new_zeros(1, h, 1, e)
        out = [F.scaled_dot_product_attention(qs[i:i + 1], K[s:s + 1, :, :n], V[s:s + 1, :, :n],
                                              scale=scale, enable_gqa=True) if n else zero
               for i, (s, n) in enumerate(zip(at.slots, at.lengths))]
        return torch.cat(out).reshape(T, h * e)
    (slot,) = at.slots
    start = at.start
    K[slot, :, start:start + T] = k.transpose(0, 1)  # [G, T, E]
    V[slot, :, start:start + T] = v.transpose(0, 1)
    n = start + T
    if at.embeds is not None and q.dtype == torch.bfloat16 and e == 64 and q.device.type == "cpu" and _prompt_kernel():
        return torch.ops.caldrix.prompt_attend(q.contiguous(), K[slot], V[slot], start, scale)
    qh = q.transpose(0, 1).unsqueeze(0)  # [1, H, T, E]
    keys, values = K[slot:slot + 1, :, :n], V[slot:slot + 1, :, :n]
    if start == 0:
        out = F.scaled_dot_product_attention(qh, keys, values, is_causal=True, scale=scale, enable_gqa=True)
    else:  # row i sees keys 0..start+i; as an additive mask, which SDPA takes 5-10% faster than
        # the same boolean one, with the same bits
        sees = torch.arange(n, device=q.device)[None] <= (torch.arange(T, device=q.device) + start)[:, None]
        mask = torch.zeros(sees.shape, dtype=q.dtype, device=q.device).masked_fill_(~sees, float("-inf"))
        out = F.scaled_dot_product_attention(qh, keys, values, attn_mask=mask, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1).reshape(T, h * e)
