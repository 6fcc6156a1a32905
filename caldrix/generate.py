"""One generation as seen from the front end: submit, then read text pieces as tokens arrive.

Shared by the HTTP routes and `caldrix run`. Detokenizing and stop strings live here, in the
front end, not in the scheduler: a stop string ends the generation by closing the event channel,
which the scheduler notices within one step and frees the slot.
"""

from __future__ import annotations

from typing import AsyncIterator

import attrs
import trio

from caldrix.protocol import FinishReason, SamplingParams, StateLease, Submission, TokenEvent
from caldrix.request_queue import EngineStopped, QueueFull, RequestQueue  # noqa: F401 -- re-exported
from caldrix.text import IncrementalDetokenizer, StopMatcher


class EngineFailed(Exception):
    """The engine failed during this request: answer 500 (or an SSE error event)."""


@attrs.frozen
class Piece:
    text: str
    token_ids: tuple[int, ...]  # the tokens this piece completes (may be empty)
    finish: FinishReason | None = None
    # The request's speculative guesses so far (proposed, accepted), None when it does not speculate.
    speculative: tuple[int, int] | None = None


@attrs.frozen
class GenRequest:
    request_id: str
    prompt_ids: tuple[int, ...]
    max_tokens: int
    sampling: SamplingParams
    stop_token_ids: frozenset[int]
    stops: tuple[str, ...] = ()
    # image requests (caldrix/vision/serving.py): no held rows reused or left, input embeddings
    reuse_prefix: bool = True
    embeds: tuple = ()  # protocol.EmbedSpan


def submit(queue: RequestQueue, req: GenRequest, *, read_ids: tuple[int, ...] = (),
           lease: StateLease | None = None, keep_state: bool = False) -> trio.MemoryReceiveChannel[TokenEvent]:
    """Queue req without waiting. Returns the receive end of its event channel, which the
    caller owns and must close (closing it early cancels the generation, and while it still
    waits gives back its place in the queue).

    Raises QueueFull when --queue-depth requests already wait, EngineStopped when the
    scheduler is gone."""
    # Bound: the scheduler sends at most one event per token plus the final one.
    tx, rx = trio.open_memory_channel(req.max_tokens + 1)
    sub = Submission(
        request_id=req.request_id,
        prompt_ids=req.prompt_ids,
        max_tokens=req.max_tokens,
        sampling=req.sampling,
        stop_token_ids=req.stop_token_ids,
        events=tx,
        read_ids=read_ids,
        reuse_prefix=req.reuse_prefix,
        embeds=req.embeds,
        lease=lease,
        keep_state=keep_state,
    )
    try:
        queue.put(sub)
    except (QueueFull, EngineStopped):
        rx.close()
        raise
    return rx


async def pieces(rx: trio.MemoryReceiveChannel[TokenEvent], tokenizer, stops: tuple[str, ...], *, prompt_ids: tuple[int, ...] = ()) -> AsyncIterator[Piece]:
    """Turn token events into text pieces: UTF-8-safe, with stop strings held back and cut.

    Closes rx when done or when the caller stops iterating. The last piece carries finish.
    Raises EngineFailed if the engine fails mid-way, EngineStopped if the server ends the
    request (shutdown)."""
    detok = IncrementalDetokenizer(tokenizer, prompt_ids=prompt_ids)
    matcher = StopMatcher(stops)
    with rx:
        async for event in rx:
            if event.finish is FinishReason.ERROR:
                raise EngineFailed(event.error or "the engine failed")
            if event.finish is FinishReason.ABORT:  # ended by the server (shutting down)
                raise EngineStopped(event.error or "the engine is unavailable")
            ids = () if event.token_id is None else (event.token_id,)
            text = detok.push(event.token_id) if ids else ""
            safe, stopped = matcher.feed(text)
            spec = event.speculative
            if stopped:
                yield Piece(safe, ids, FinishReason.STOP, spec)
                return
            if event.finish is not None:
                # The detokenizer's flush is only the U+FFFD of bytes the reply ended before
                # finishing: no stop string is matched against it (the reply ended for length
                # or end of sequence, not at a "\ufffd" stop).
                yield Piece(safe + matcher.flush() + detok.flush(), ids, event.finish, spec)
                return
            yield Piece(safe, ids, speculative=spec)
        # The channel closed with no final event: the scheduler went away under us.
        raise EngineFailed("the engine stopped during the request")
