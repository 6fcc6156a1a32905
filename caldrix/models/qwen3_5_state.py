"""Per-slot state of a Qwen3.5 model (models/qwen3_5.py), and snapshots of it.

A slot holds one sequence. Its state has two parts:
- K/V rows of the full-attention layers: [La, S, G, C, E] each, like llama's KVCache (rows
  start uninitialized; attention reads a slot's rows only below what was written).
- for each linear-attention layer, a conv window (the last K-1 conv inputs, [Ll, S, W, K-1], in
  the model dtype, as transformers keeps it) and the recurrent matrices ([Ll, S, nv, dk, dv],
  always float32).
The K/V rows can be cut back to any length; the linear part exists only at the slot's current
length (`lengths[slot]`), because the recurrence cannot be undone. So going back means a
snapshot: the linear part copied at some length, restored later.

Shapes: La/Ll full/linear layers, S slots, G kv heads, C rows, E head dim, W conv channels,
K conv kernel, nv linear value heads, dk/dv their dims.
"""

from __future__ import annotations

import attrs
import torch


@attrs.frozen(eq=False)
class Qwen35Snapshot:
    """The state of `slot` at `length` tokens: the linear layers' conv windows [Ll, W, K-1]
    and recurrent matrices [Ll, nv, dk, dv] (copies), and the full-attention layers' K/V rows
    0..length-1 either copied (`k`, `v` [La, G, length, E]) or left in `slot`'s rows (None)."""

    slot: int
    length: int
    epoch: int  # the slot's epoch when taken: its K/V rows are still the snapshot's while it holds
    conv: torch.Tensor
    rec: torch.Tensor
    k: torch.Tensor | None = None
    v: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.conv, self.rec, self.k, self.v) if t is not None)

    @property
    def in_place(self) -> bool:
        """Whether its K/V rows still live in the slot (models/base.py Snapshot)."""
        return self.k is None


class Qwen35State:
    """The state of `num_slots` sequences of up to `rows` tokens. See the module docstring."""

    def __init__(self, cfg, num_slots: int, rows: int, dtype: torch.dtype, device="cpu"):
        la, ll = len(cfg.full_layers), len(cfg.linear_layers)
        self.k = torch.empty(la, num_slots, cfg.num_kv_heads, rows, cfg.head_dim, dtype=dtype, device=device)
        self.v = torch.empty_like(self.k)
        self.conv = torch.zeros(ll, num_slots, cfg.conv_dim, cfg.conv_kernel - 1, dtype=dtype, device=device)
        self.rec = torch.zeros(ll, num_slots, cfg.linear_value_heads, cfg.linear_key_dim, cfg.linear_value_dim,
                               dtype=torch.float32, device=device)
        self.rows = rows
        self.num_slots = num_slots
        self.lengths = [0] * num_slots  # tokens each slot's linear state has seen
        # bumped whenever a slot's K/V rows may be rewritten below its length (a reset, a restore
        # that copies rows in): a snapshot that left its rows in the slot checks it
        self.epochs = [0] * num_slots

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes + self.conv.nbytes + self.rec.nbytes

    def reset(self, slot: int) -> None:
        """Empty `slot` for a new sequence (a prefill at position 0 does this itself)."""
        self.conv[:, slot].zero_()
        self.rec[:, slot].zero_()
        self.lengths[slot] = 0
        self.epochs[slot] += 1

    def snapshot(self, slot: int, length: int, copy_kv: bool = False) -> Qwen35Snapshot:
        """The state of `slot` now, which must be at `length` tokens (the linear layers hold no
        other). With copy_kv the K/V rows below `length` are copied too, so the snapshot stands
        alone; without, they stay in `slot`, and restoring elsewhere copies them from there:
        the caller must not have rewritten that slot's rows below `length` meanwhile (going on
        past `length` is fine; resetting it or restoring another slot's snapshot into it is not, and
        restore then raises)."""
        if self.lengths[slot] != length:
            raise ValueError(f"slot {slot} is at {self.lengths[slot]} tokens, not {length}: a snapshot "
                             f"of the linear layers exists only at the slot's current length")
        k = self.k[:, slot, :, :length].clone() if copy_kv else None
        v = self.v[:, slot, :, :length].clone() if copy_kv else None
        return Qwen35Snapshot(slot, length, self.epochs[slot], self.conv[:, slot].clone(), self.rec[:, slot].clone(),
                              k, v)

    def restore(self, snap: Qwen35Snapshot, slot: int) -> None:
        """Put `snap` into `slot` (the one it came from or another): afterwards the slot
        continues exactly, bit for bit, as the snapshotted one would have."""
        n = snap.length
        if snap.k is None and self.epochs[snap.slot] != snap.epoch:
            raise ValueError(f"slot {snap.slot} has started another sequence since this snapshot was taken, "
                             f"and the snapshot's K/V rows were left there (take it with copy_kv=True)")
        if n > self.rows:
            raise ValueError(f"the snapshot's {n} tokens exceed the state's {self.rows} rows")
        if snap.k is not None:
            self.k[:, slot, :, :n] = snap.k
            self.v[:, slot, :, :n] = snap.v
        elif slot != snap.slot:
            self.k[:, slot, :, :n] = self.k[:, snap.slot, :, :n]
            self.v[:, slot, :, :n] = self.v[:, snap.slot, :, :n]
        if snap.k is not None or slot != snap.slot:
            self.epochs[slot] += 1  # its rows changed: snapshots that left rows in it are void
        self.conv[:, slot] = snap.conv
        self.rec[:, slot] = snap.rec
        self.lengths[slot] = n

    def begin(self, at) -> int:
        """Check an Attend against the slots' lengths, clear the slots that start over, and
        return one past the highest position (for the RoPE tables)."""
        if at.kind == "prefill":
            (slot,) = at.slots
            start, stop = int(at.positions[0]), int(at.positions[-1]) + 1
            if start == 0:
                self.reset(slot)
            elif start != self.lengths[slot]:
                raise ValueError(f"slot {slot} is at {self.lengths[slot]} tokens; a prefill must continue "
                                 f"there or start at 0, not at {start} (restore a snapshot to go back)")
            if stop > self.rows:
                raise ValueError(f"{stop} tokens exceed the state's {self.rows} rows")
            return stop
        seen: set[int] = set()
        for s, n in zip(at.slots, at.lengths):
            if not n:
                continue  # a padding row: it runs into a scratch slot, whatever that holds
            if s in seen:
                raise ValueError(f"slot {s} has two decode rows; this model decodes one token per slot a pass")
            seen.add(s)
            if n == 1:
                self.reset(s)
            elif n - 1 != self.lengths[s]:
                raise ValueError(f"slot {s} is at {self.lengths[s]} tokens; a decode row must be at that "
                                 f"position, not {n - 1}")
            if n > self.rows:
                raise ValueError(f"{n} tokens exceed the state's {self.rows} rows")
        return max(at.lengths, default=1)

    def end(self, at) -> None:
        if at.kind == "prefill":
            self.lengths[at.slots[0]] = int(at.positions[-1]) + 1
        else:
            for s, n in zip(at.slots, at.lengths):
                if n:
                    self.lengths[s] = n
