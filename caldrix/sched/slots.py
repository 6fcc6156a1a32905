"""KV slot accounting: which slot is free, and which token ids its rows still hold.

Pure Python; the tensors live in the engine. A slot whose request ended keeps its rows ("held")
so that a later request with the same prefix can skip recomputing them, as llama-server's slot
reuse does.

Two kinds of model state (the engine's `reuses_rows`): attention-only models keep a row per
position, so a held slot serves any common prefix of a new prompt; a model with a recurrent
state (a running summary of every token so far) can restart only where the state was kept,
which for a held slot is the end of what it computed: it serves a prompt that starts with the
whole of its held tokens, and a slot whose tokens diverge mid-prefix starts over.
"""

from __future__ import annotations

import attrs


def common_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


@attrs.define
class SlotTable:
    num_slots: int
    reuse_rows: bool = True  # False: a held slot is reused only whole (a recurrent state)
    held: list[tuple[int, ...]] = attrs.field(init=False)
    busy: list[bool] = attrs.field(init=False)
    # Per slot, which held rows have the bits a fresh run gives them (a row's bits depend on the
    # chunk it was computed in, and chunks are cut at multiples of the chunk size from 0):
    # `fresh`, the rows in whole chunks, the same for any prompt that shares their tokens;
    # `fresh_len`, n when every row but the last of an n-token prompt is as that prompt's own
    # run computed them, its last partial chunk included (0: not so): a fresh run's, or, over
    # the next turn's reuse, that send's, which a repeat then gets again.
    fresh: list[int] = attrs.field(init=False)
    fresh_len: list[int] = attrs.field(init=False)
    _align: list[int] = attrs.field(init=False)  # the chunk each slot's run was cut by
    _clock: int = attrs.field(init=False, default=0)
    _last_used: list[int] = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self.held = [() for _ in range(self.num_slots)]
        self.busy = [False] * self.num_slots
        self.fresh = [0] * self.num_slots
        self.fresh_len = [0] * self.num_slots
        self._align = [1] * self.num_slots
        self._last_used = [0] * self.num_slots

    @property
    def num_free(self) -> int:
        return self.busy.count(False)

    @property
    def num_busy(self) -> int:
        return self.num_slots - self.num_free

    def try_acquire(self, prompt: tuple[int, ...], *, reuse: bool, align: int = 1,
                    read_only: bool = False) -> tuple[int, int] | None:
        """Take a free slot for `prompt`: (slot, reused rows), or None when every slot is busy.

        Prefers the free slot holding the longest prefix of the prompt, then the least recently
        used. At least the last prompt token is always recomputed: its logits pick the first
        reply token. `align` is the policy's chunk. Held rows are reused only where they have
        the bits a fresh run of this prompt gives them, so a reply never depends on the request
        before it: in whole chunks (a chunk's row count picks its kernel: a 13-row chunk and a
        37-row one take different matmuls on the 4-bit engine), or all of them when the same
        prompt computed them (a repeated prompt). The exception is the next turn of the
        conversation a slot holds (a prompt extending all it holds), reused whole, which can
        differ in a late token from the same prompt sent fresh (docs/serve.md). A read-only
        prompt has no reply to keep so and reuses any common prefix.
        """
        free = [s for s in range(self.num_slots) if not self.busy[s]]
        if not free:
            return None
        if reuse:
            slot = max(free, key=lambda s: (self._reusable(s, prompt, align, read_only), -self._last_used[s]))
            rows = self._reusable(slot, prompt, align, read_only)
        else:
            slot, rows = min(free, key=lambda s: self._last_used[s]), 0
        self._note_fresh(slot, len(prompt), rows, align, read_only)
        self.busy[slot] = True
        self.held[slot] = prompt[:rows]
        return slot, rows

    def _reusable(self, slot: int, prompt: tuple[int, ...], align: int = 1, read_only: bool = False) -> int:
        """Rows of `prompt` that free `slot` can skip (see try_acquire); where the state is
        recurrent, all the held tokens or none."""
        held = self.held[slot]
        common = common_prefix(held, prompt)
        if not self.reuse_rows:
            return common if common == len(held) and common <= len(prompt) - 1 else 0
        rows = min(common, len(prompt) - 1)
        if read_only or (held and common == len(held)):
            return rows  # a read-only prompt; the next turn of the conversation the slot held
        if rows == len(prompt) - 1 and self.fresh_len[slot] == len(prompt):
            return rows  # the same prompt again: its rows as its own run computed them
        return min(rows, self.fresh[slot]) // align * align

    def _note_fresh(self, slot: int, n: int, rows: int, align: int, read_only: bool) -> None:
        """What the run about to compute `slot`'s rows from `rows` on leaves fresh (see the
        fields): its chunks from an aligned start are cut as a fresh run's, from an unaligned
        one (the next turn's reuse) they are not, nor are a read-only run's (its last row rides
        in its last chunk, and a kept state cuts a chunk short). A prompt sent again gets the
        rows its own run computed, so `fresh_len` is n after any run but a read-only one: over
        the next turn's reuse too, where a repeat then gets that run's reply, not a fresh one."""
        old, old_len = self.fresh[slot], self.fresh_len[slot]
        self._align[slot] = align
        if read_only:
            self.fresh[slot], self.fresh_len[slot] = min(old, rows) // align * align, 0
        elif rows == 0 or (rows <= old and rows % align == 0):
            self.fresh[slot], self.fresh_len[slot] = (n - 1) // align * align, n
        elif rows == n - 1 and old_len == n:
            pass  # a repeat: the rows stay as they were
        else:
            self.fresh[slot], self.fresh_len[slot] = min(old, rows) // align * align, n

    def release(self, slot: int, held: tuple[int, ...]) -> None:
        """Free `slot`; its first len(held) rows stay valid for reuse."""
        assert self.busy[slot]
        self.busy[slot] = False
        self.held[slot] = held
        if len(held) < self.fresh[slot]:  # ended mid-prompt: its whole chunks so far stay fresh
            align = self._align[slot]
            self.fresh[slot], self.fresh_len[slot] = len(held) // align * align, 0
        elif len(held) < self.fresh_len[slot] - 1:
            self.fresh_len[slot] = 0
        self._clock += 1
        self._last_used[slot] = self._clock

    def rows_held(self) -> int:
        return sum(len(h) for s, h in enumerate(self.held) if not self.busy[s])
