"""A request's prompt text to token ids, refused cheaply when it cannot fit, and built off the
event loop when it is long.

Tokenizing a 3 MB prompt (under the 4 MiB body limit) takes seconds. Done on the event loop,
it held every other request, every stream's next chunk and /healthz for that long. So:

- Before tokenizing, a text whose bytes need more tokens than the context holds, even at the
  vocabulary's longest token each (`Tokenizer.at_least_tokens`), is a 400 at once.
- A text longer than `INLINE_CHARS` is tokenized (and a chat rendered through its template) on
  a worker thread, at most `PROMPT_THREADS` at a time server-wide; shorter ones are cheaper
  inline than the thread hop. The tokenizers library releases the GIL while it encodes, so the
  loop goes on serving meanwhile.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import trio

from caldrix.routes.errors import ApiError

T = TypeVar("T")
log = logging.getLogger("caldrix.request")

INLINE_CHARS = 8192  # about 6 ms of tokenizing on one core: below this, no thread hop
# A request body past this is parsed and checked on a worker thread too: a 4 MiB body of half a
# million array elements took about 1 s to parse, check for duplicate keys and validate, and on
# the event loop every stream waited for it. Below, parsing takes about a millisecond.
INLINE_BODY_BYTES = 64 * 1024
PROMPT_THREADS = 2  # worker threads building prompts at once, server-wide (the extension below)
LIMITER_KEY = "caldrix.prompt_threads"


def new_limiter() -> trio.CapacityLimiter:
    """The server's prompt-building limiter; made in create_app, under the server's nursery."""
    return trio.CapacityLimiter(PROMPT_THREADS)


def check_fits(tokenizer: Any, chars: Sequence[str], context: int, param: str) -> None:
    """A 400 at `param` when `chars` (the prompt's texts) cannot fit the context at any
    tokenization: at least `context` tokens leave no row for a reply."""
    at_least = sum(tokenizer.at_least_tokens(t) for t in chars)
    if at_least >= context:
        raise ApiError.past_context(
            f"the prompt is at least {at_least} tokens and the context holds {context}; "
            "that leaves no room for a reply",
            param,
        )


def check_in_vocab(ids: Sequence[int], vocab_size: int, tokenizer: Any, param: str | None) -> None:
    """A 400 at `param` when a prompt built from text holds an id the model has no embedding
    row for: a tokenizer with added tokens the model was never resized for. Run, the id would
    fail the engine's step and with it the server (vLLM refuses such a prompt the same way)."""
    top = max(ids, default=-1)
    if top >= vocab_size:
        piece = tokenizer.hf.convert_ids_to_tokens(top)
        raise ApiError.invalid(
            f"the prompt tokenizes to token id {top} ({piece!r}), which this model has no embedding for "
            f"(its vocabulary is 0 to {vocab_size - 1}): the tokenizer has tokens the model does not",
            param,
        )


async def build(limiter: trio.CapacityLimiter, size: int, fn: Callable[..., T], *args: Any) -> T:
    """fn(*args), on a worker thread of `limiter` when `size` (characters) is past INLINE_CHARS.
    Cancelling the caller abandons the thread's result; the thread itself runs to its end."""
    if size <= INLINE_CHARS:
        return fn(*args)
    return await trio.to_thread.run_sync(fn, *args, limiter=limiter, abandon_on_cancel=True)


async def parsed(parse: Callable[..., T], *args: Any) -> T:
    """parse(the request's body, *args): inline, or on a thread of the prompt limiter when the
    body is past INLINE_BODY_BYTES. Its ApiError comes back raised; cancelling the caller
    abandons the thread's result. Call in the request's context."""
    from quart import current_app, request

    try:
        raw = await request.get_data(cache=False)
    except trio.Cancelled:
        # A client that hangs up mid-upload cancels its handler here (hypercorn's disconnect),
        # as does a stop's grace period running out: no response is sent, so this is the
        # request's only trace in the log.
        log.info("request - %s %s cancelled before its body was read (Content-Length %s): the client left, "
                 "or the server is stopping",
                 request.method, request.path, request.headers.get("Content-Length", "-"))
        raise
    if len(raw) <= INLINE_BODY_BYTES:
        return parse(raw, *args)
    return await trio.to_thread.run_sync(parse, raw, *args, limiter=current_app.extensions[LIMITER_KEY],
                                         abandon_on_cancel=True)
