"""N-gram speculation: pure, synchronous proposal and accounting (no torch, no trio).

A sequence's own tokens (prompt and reply) propose its next ones: the longest suffix of
`min_n..max_n` tokens that occurred earlier proposes the tokens that followed its most recent
earlier occurrence (prompt lookup, as llama.cpp's and vLLM's n-gram proposers do). The loaded
model then verifies the guesses in one forward pass with logits at every position, and the
greedy pick at each position decides: guesses are kept up to the first one the model would not
have picked, plus the model's own pick after them. So a greedy reply is the same tokens plain
decoding gives, as long as every row of the verify pass computes exactly what a one-row decode
step computes (the engine guarantees that, or refuses speculation: engine.py).

The draft length is tuned live (when --draft-tokens does not fix it), server-wide, by
DraftTuner: from the measured acceptance and the measured pass times, the length with the most
tokens per second, or none at all when a plain step is expected to yield more.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import attrs

from caldrix.batch import MAX_DRAFT_TOKENS

if TYPE_CHECKING:
    from caldrix.sched.spec_memory import TunerState


@attrs.frozen
class SpecConfig:
    """--speculate's settings as resolved at start: mode "ngram" (the sequence's own n-grams
    propose) or "draft" (the engine's draft model proposes, Run.draft)."""

    mode: str = attrs.field(default="ngram", kw_only=True)
    min_n: int = 2
    max_n: int = 4
    draft_tokens: int | None = None  # None: tuned live between 1 and MAX_DRAFT_TOKENS

    def __attrs_post_init__(self) -> None:
        if self.mode not in ("ngram", "draft"):
            raise ValueError(f"speculation mode must be ngram or draft, got {self.mode!r}")
        if not 1 <= self.min_n <= self.max_n:
            raise ValueError(f"n-gram lengths must satisfy 1 <= min <= max, got {self.min_n}:{self.max_n}")
        if self.draft_tokens is not None and not 1 <= self.draft_tokens <= MAX_DRAFT_TOKENS:
            raise ValueError(f"draft tokens must be 1..{MAX_DRAFT_TOKENS}, got {self.draft_tokens}")


@attrs.define
class NgramIndex:
    """Where each n-gram of one sequence last occurred with a token after it.

    `ends[n][gram]` is the end (exclusive) of gram's most recent occurrence that is followed
    by at least one known token. Fed incrementally: each call to `extend` registers only the
    grams that became followable since the last one, so a step costs O(max_n - min_n) dict
    operations per new token, not a scan of the sequence."""

    min_n: int
    max_n: int
    tokens: list[int] = attrs.Factory(list)
    ends: dict[int, dict[tuple[int, ...], int]] = attrs.Factory(dict)
    _registered: int = 0  # grams ending before this position are in `ends`

    def extend(self, tokens) -> None:
        self.tokens.extend(tokens)
        last = len(self.tokens) - 1  # a gram ending at e is followable when tokens[e] exists
        for e in range(max(self._registered, self.min_n), last + 1):
            for n in range(self.min_n, min(self.max_n, e) + 1):
                self.ends.setdefault(n, {})[tuple(self.tokens[e - n : e])] = e
        self._registered = max(self._registered, last + 1)

    def propose(self, k: int) -> tuple[int, ...]:
        """Up to k guessed next tokens; () when no suffix occurred before."""
        toks = self.tokens
        for n in range(min(self.max_n, len(toks) - 1), self.min_n - 1, -1):
            e = self.ends.get(n, {}).get(tuple(toks[len(toks) - n :]))
            if e is not None:
                return tuple(toks[e : e + k])
        return ()


def accepted(drafts: tuple[int, ...], picks: tuple[int, ...]) -> int:
    """How many leading drafts the model's picks confirm. picks[i] is the pick after the
    verify run's token i, where token 0 is the last known token and token i + 1 is drafts[i]."""
    n = 0
    while n < len(drafts) and picks[n] == drafts[n]:
        n += 1
    return n


@attrs.define
class DraftTuner:
    """The server-wide draft length, owned by the policy (the scheduler task).

    Unless fixed, it picks the length with the most expected tokens per second of step time:
    with p the measured chance that a guess is kept once the ones before it were, a draft of k
    yields (1 - p^(k+1)) / (1 - p) tokens in a pass of k + 1 rows, and each row count's pass
    time is measured live (the loop reports it through `timed`). A row count not yet measured
    is assumed to cost little more than one row, so it gets tried. Measured on 2 cores with the
    4-bit SmolLM2, a pass of 2 / 4 / 5 rows costs 1.3 / 1.7 / 2.5 one-row steps, which is why
    the length must follow the machine and not a constant."""

    fixed: int | None = None
    proposed: int = 0  # totals over the server's life
    accepted: int = 0
    # Decayed counts of kept guesses and of first misses: p = kept / (kept + missed).
    _kept: float = 2.0
    _missed: float = 1.0
    _seconds: dict[int, float] = attrs.Factory(dict)  # rows -> decayed mean pass time

    def next_length(self) -> int:
        """Guesses for the next pass; 0: a plain one-row step is expected to yield more tokens
        per second than any verify (the guesses keep failing). The policy then checks the
        lookup's first guess against the plain pick for free (`shadow`), so the acceptance
        estimate keeps moving and guessing resumes when the text starts repeating."""
        if self.fixed is not None:
            return self.fixed
        one = self._seconds.get(1)
        if one is None:
            return 1
        total = self._kept + self._missed  # never 0 from the start, but decay and a restored state can
        p = min(self._kept / total, 0.99) if total > 0 else 2 / 3
        best, best_rate = 0, 1.0 / one
        for k in range(1, MAX_DRAFT_TOKENS + 1):
            t = self._seconds.get(k + 1, one * (1 + 0.05 * k))
            rate = (1 - p ** (k + 1)) / (1 - p) / t
            if rate > best_rate:
                best, best_rate = k, rate
        return best

    def record(self, proposed: int, accepted: int) -> None:
        """A verify of `proposed` guesses kept `accepted` of them."""
        self.proposed += proposed
        self.accepted += accepted
        self._kept = DECAY * self._kept + accepted
        self._missed = DECAY * self._missed + (accepted < proposed)

    def shadow(self, kept: bool) -> None:
        """A guess looked up but not verified: the plain step's pick did (or did not) equal it.
        Moves the acceptance estimate only; the proposed and accepted totals count verified
        guesses."""
        self._kept = DECAY * self._kept + kept
        self._missed = DECAY * self._missed + (not kept)

    def state(self) -> "TunerState":
        """What the tuner has learned, for --speculation-memory (sched/spec_memory.py)."""
        from caldrix.sched.spec_memory import TunerState

        return TunerState(self._kept, self._missed, tuple(sorted(self._seconds.items())))

    def restore(self, state: "TunerState") -> None:
        """Start from a state kept by an earlier run (the totals start at zero)."""
        self._kept, self._missed = state.kept, state.missed
        self._seconds = dict(state.seconds)

    def timed(self, rows: int, seconds: float) -> None:
        """A decode or verify pass of `rows` rows took `seconds`."""
        old = self._seconds.get(rows)
        self._seconds[rows] = seconds if old is None else DECAY * old + (1 - DECAY) * seconds


DECAY = 0.9  # weight of the past in the tuner's running estimates
