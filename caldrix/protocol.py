"""Records that cross from routes/ to sched/ and back.

routes/ parses and validates a request into a `Submission`; the scheduler answers on the
submission's own event channel with `TokenEvent`s and closes that channel after the last one.
No dicts, JSON or tensors cross this boundary.
"""

from __future__ import annotations

import enum
import time
import attrs
import trio


# A top_k at or past every vocabulary keeps every token, as 0 does (both picks cut at
# min(top_k, V)); such values are stored as 0, so a request's record and the device pick's int64
# tensors never meet an integer past 64 bits (`"top_k": 1e30` as an integer literal is valid).
# Token ids are 32-bit in every tokenizer, so no vocabulary reaches this.
TOP_K_KEEPS_ALL = 2**31


def _top_k(k: int) -> int:
    return 0 if k >= TOP_K_KEEPS_ALL else k


@attrs.frozen
class SamplingParams:
    """The six knobs of http-api.md "Sampling", resolved against the server's defaults.

    `seed` is always concrete here: routes/ draws fresh entropy for a request that asked for
    none, so the record of every request names the seed that reproduces it.
    """

    temperature: float = 0.0
    top_k: int = attrs.field(default=0, converter=_top_k)  # 0 keeps every token
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int = 0

    @property
    def is_greedy(self) -> bool:
        """Greedy picks the arg-max (after the penalty); top_k 1 is greedy too."""
        return self.temperature == 0.0 or self.top_k == 1


class FinishReason(str, enum.Enum):
    STOP = "stop"  # end-of-sequence token, a stop token or a stop string (set by routes/)
    LENGTH = "length"  # max_tokens reached or the context is full
    ABORT = "abort"  # the client went away; nobody reads this one
    ERROR = "error"  # the engine failed


@attrs.frozen
class TokenEvent:
    """One step's result for one request.

    `token_id` is None only on an event that carries no new token (an error, or the end of a
    read-only request). `finish` is set on the last event of a request; the scheduler closes the
    channel right after sending it.
    """

    token_id: int | None
    finish: FinishReason | None = None
    error: str | None = None
    # Filled on the last event only: prompt rows reused from a held slot.
    prefix_rows: int = 0
    # Logits of Submission.read_ids at the next-token position (read-only requests).
    read: tuple[float, ...] = ()
    # A request that runs under speculation: its guesses (proposed, accepted) so far, on each
    # token event and the last one; None otherwise.
    speculative: tuple[int, int] | None = None


@attrs.frozen
class EmbedSpan:
    """Positions start..start+count-1 of a sequence take rows 0..count-1 of the input embeddings
    the engine holds under `key` (Engine.embeddings), in place of their token ids' rows."""

    key: int
    start: int
    count: int


@attrs.define(eq=False)
class StateLease:
    """A model state kept for several read-only prompts of one request (the decider reading's
    state read once): the state after the first `length` prompt tokens, which every prompt of
    the request shares, kept by the engine under `key`.

    The route makes it and sets `released` (synchronously, in its finally) when the request
    ends, however it ends; the scheduler task then drops the engine's snapshot. Nothing else
    touches it."""

    key: int  # nonzero, unique among live leases
    length: int
    released: bool = False


@attrs.frozen(eq=False)
class Submission:
    """A validated request, handed to the scheduler through the bounded request channel.

    Ownership: the scheduler is the only sender on `events` and closes it after the final
    event. The route owns the receive end and closes it when it stops listening (client gone,
    stop string); the scheduler then frees the request's slot at its next step.

    `events` must be opened with a buffer of at least `max_tokens + 1`, so the scheduler's
    `send_nowait` can never block on a slow client.
    """

    request_id: str
    prompt_ids: tuple[int, ...]
    max_tokens: int  # already capped so prompt + reply fit the context
    sampling: SamplingParams
    stop_token_ids: frozenset[int]  # empty when ignore_eos
    events: "trio.MemorySendChannel[TokenEvent]"
    # Read-only request (systemone): no token is generated; the logits of these ids at the
    # position after the prompt come back on the final event.
    read_ids: tuple[int, ...] = ()
    # Image requests never reuse held prompt rows and leave none behind.
    reuse_prefix: bool = True
    # Input embeddings for some prompt positions (image features), held by the engine under
    # each span's key; the scheduler drops them from the engine when the request ends.
    embeds: tuple[EmbedSpan, ...] = ()
    # A state shared with the request's other prompts (read-only requests): with `keep_state`
    # this prompt keeps the state after its first lease.length tokens; without, it starts from
    # that kept state where the scheduler still has it, else reads the prompt whole.
    lease: StateLease | None = None
    keep_state: bool = False
    # When the route handed it over (monotonic seconds): queue time and TTFT count from here.
    arrived: float = attrs.field(factory=time.monotonic)
    # Set by the scheduler when it takes the submission off the request channel: from then on
    # it no longer counts toward --queue-depth (request_queue.py).
    taken: trio.Event = attrs.field(factory=trio.Event)

    @property
    def is_read_only(self) -> bool:
        return bool(self.read_ids)
