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
    _clock: int = attrs.field(init=False, default=0)
    _last_used: list[int] = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self.held = [() for _ in range(self.num_slots)]
        self.busy = [False] * self.num_slots
        self._last_used = [0] * self.num_slots

    @property
    def num_free(self) -> int:
        return self.busy.count(False)

    @property
    def num_busy(self) -> int:
        return self.num_slots - self.num_free

    def try_acquire(self, prompt: tuple[int, ...], *, reuse: bool, align: int = 1) -> tuple[int, int] | None:
        """Take a free slot for `prompt`: (slot, reused rows), or None when every slot is busy.

        Prefers the free slot holding the longest prefix of the prompt, then the least recently
        used. At least the last prompt token is always recomputed: its logits pick the first
        reply token. A prefix that stops short of that token, and short of all the slot holds
        (another request's, not an earlier turn of this conversation), is reused only down to a
        multiple of `align` (the policy's chunk): the rows computed after it are then cut into
        the same chunks as in a fresh run, and a chunk's row count picks its kernel, so they get
        the same bits (a 13-row chunk and a 37-row one take different matmuls on the 4-bit
        engine), and a reply never depends on an unrelated request before it.
        """
        free = [s for s in range(self.num_slots) if not self.busy[s]]
        if not free:
            return None
        if reuse:
            slot = max(free, key=lambda s: (self._reusable(s, prompt, align), -self._last_used[s]))
            rows = self._reusable(slot, prompt, align)
        else:
            slot, rows = min(free, key=lambda s: self._last_used[s]), 0
        self.busy[slot] = True
        self.held[slot] = prompt[:rows]
        return slot, rows

    def _reusable(self, slot: int, prompt: tuple[int, ...], align: int = 1) -> int:
        """Rows of `prompt` that free `slot` can skip: its common prefix with what the slot holds,
        short of the prompt's last token, and down to a multiple of `align` unless it reaches
        that token or covers all the slot holds; where the state is recurrent, all the held
        tokens or none."""
        held = self.held[slot]
        common = common_prefix(held, prompt)
        if not self.reuse_rows:
            return common if common == len(held) and common <= len(prompt) - 1 else 0
        rows = min(common, len(prompt) - 1)
        if rows == len(prompt) - 1 or (held and common == len(held)):
            # all but the last token (a repeated prompt), or everything the slot holds (the next
            # turn of the conversation it held: reused whole, and, as docs/serve.md says, it can
            # differ in a late token from the same prompt sent fresh)
            return rows
        return rows // align * align

    def release(self, slot: int, held: tuple[int, ...]) -> None:
        """Free `slot`; its first len(held) rows stay valid for reuse."""
        assert self.busy[slot]
        self.busy[slot] = False
        self.held[slot] = held
        self._clock += 1
        self._last_used[slot] = self._clock

    def rows_held(self) -> int:
        return sum(len(h) for s, h in enumerate(self.held) if not self.busy[s])
