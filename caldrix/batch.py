"""Records that cross from sched/ to the engine and back: plain ints, floats and tuples.

One forward pass takes a packed list of `Run`s. A run is a stretch of tokens written into one KV
slot at consecutive positions, with the offsets inside it whose next-token logits are wanted.
The same shape serves chunked prefill (logits at the last prompt token, or none for a middle
chunk), decode (one token, logits at it), speculative verify (k tokens, logits at each) and
logit reads (`read_ids`).

Two more things a run may ask, both by key, so that no tensor crosses: `embeds` names input
embeddings (image features) the engine holds for some of the run's positions (Engine.embeddings,
put by whoever made them; the token table supplies the other positions), and `restore` /
`snapshot` restore a kept state of the slot before the run or keep one after it
(Engine.snapshot, Engine.restore; models/base.py says what a snapshot holds).
"""

from __future__ import annotations

import attrs

from caldrix.protocol import EmbedSpan, SamplingParams

MAX_DRAFT_TOKENS = 8  # guesses in one speculative verify at most (--draft-tokens 1..8)


@attrs.frozen
class Run:
    slot: int
    start: int  # position of token_ids[0] in the slot; rows >= start are overwritten
    token_ids: tuple[int, ...]
    # Offsets into token_ids whose next token is picked. Empty: fill KV rows only.
    pick_at: tuple[int, ...] = ()
    sampling: SamplingParams = SamplingParams()
    # How many tokens this sequence had drawn before this run: keys the seeded random draw,
    # so a reply does not depend on which other runs share the step.
    draw_index: int = 0
    # Token ids whose raw logits are returned at the last pick_at offset.
    read_ids: tuple[int, ...] = ()
    # Only `read_ids` are wanted at the last row, no pick (a /v1/systemone probe): the engine
    # may compute just those logits, and RunOutput.token_ids may then be empty.
    read_only: bool = False
    # A speculative verify: token_ids are the last known token and the guesses after it, with
    # pick_at at every offset. The engine computes each row exactly as a one-row decode step
    # would, so the picks are the tokens plain decoding gives.
    verify: bool = False
    # Input embeddings for some positions: the spans that overlap start..end-1 (a span may
    # reach past the run either way; the engine takes the overlap).
    embeds: tuple[EmbedSpan, ...] = ()
    # Before the run, restore the snapshot kept under this key into the slot; its length must
    # be `start`. 0: none.
    restore: int = 0
    # After the run, keep the slot's state at `end` as a snapshot under this key (not on a
    # verify run, whose rows past the kept guesses are thrown away). 0: none.
    snapshot: int = 0
    # --speculate draft: token_ids is the last known token alone; the engine's draft model
    # proposes up to this many guesses after it and the run becomes a verify of them
    # (RunOutput.drafted says which). 0: none.
    draft: int = 0

    @property
    def end(self) -> int:
        return self.start + len(self.token_ids)


@attrs.frozen
class Batch:
    runs: tuple[Run, ...]
    # CPU threads the step may use; 0: the engine decides. The scheduler gives 1 to each of
    # two steps it runs at once (a decode step beside a prefill chunk), one core each.
    threads: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(len(r.token_ids) for r in self.runs)


@attrs.frozen
class RunOutput:
    token_ids: tuple[int, ...]  # one per pick_at offset
    read: tuple[float, ...] = ()  # one per read_ids entry
    # A draft run's guesses, verified: token_ids then has one pick per guess and one after them.
    drafted: tuple[int, ...] = ()


@attrs.frozen
class StepOutput:
    runs: tuple[RunOutput, ...]  # in the order of Batch.runs
