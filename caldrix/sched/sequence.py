"""Per-request mutable state. Only the scheduler task creates, reads or changes a Sequence."""

from __future__ import annotations

import enum

import attrs

from caldrix.protocol import FinishReason, Submission
from caldrix.sched.speculate import NgramIndex


class Status(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    # Anything from here on is finished.
    FINISHED = 2


@attrs.define(eq=False)
class Sequence:
    sub: Submission
    slot: int = -1
    status: Status = Status.WAITING
    num_computed: int = 0  # KV rows written for this sequence: prompt + output[:-1] at most
    output: list[int] = attrs.Factory(list)
    prefix_rows: int = 0  # prompt rows reused from a held slot
    finish: FinishReason | None = None
    # Speculation (policy.py): whether this request speculates (set at admission), the n-gram
    # index of prompt + output (built at its first decode step), the guesses proposed and kept.
    speculating: bool = False
    ngram: NgramIndex | None = None
    proposed: int = 0
    accepted: int = 0
    shadow: int | None = None
    # The kept state (Submission.lease) the first chunk restores: set at admission when the
    # policy still has it; 0 when the prompt is read from its start.
    restore_key: int = 0  # a guess looked up but not verified this step (DraftTuner.shadow)
    # Timings, monotonic seconds, set by the loop; telemetry only.
    t_admitted: float = 0.0
    t_first_token: float = 0.0
    # When each reply token was emitted (inter-token latency); at most max_tokens entries.
    t_tokens: list[float] = attrs.Factory(list)
    batch_sizes: list[int] = attrs.Factory(list)

    @property
    def prompt(self) -> tuple[int, ...]:
        return self.sub.prompt_ids

    @property
    def in_prefill(self) -> bool:
        return self.num_computed < len(self.sub.prompt_ids)

    @property
    def is_finished(self) -> bool:
        return self.status >= Status.FINISHED

    def tokens(self) -> tuple[int, ...]:
        """Every token whose KV row is (or is about to be) written: prompt then output."""
        return self.sub.prompt_ids + tuple(self.output)
