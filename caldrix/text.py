"""Generated ids to the text a client is sent: incremental detokenizing and stop strings.

A route pushes each new token through an `IncrementalDetokenizer`, feeds the text that comes
out into a `StopMatcher`, and sends what the matcher lets through. At the end of a reply it
flushes both, in that order:

    detok, stops = IncrementalDetokenizer(tokenizer), StopMatcher(request.stop)
    for token in reply:
        text, stopped = stops.feed(detok.push(token))
        send(text)
        if stopped:
            break                   # finish_reason "stop"; the stop string is never sent
    else:
        text, stopped = stops.feed(detok.flush())
        send(text if stopped else text + stops.flush())

Both are pure and synchronous, and each belongs to one request.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

REPLACEMENT = "\ufffd"
# Prompt ids kept as left context for the first reply tokens. A SentencePiece decoder drops
# the leading space of the first token it decodes; with context the reply keeps it.
PROMPT_CONTEXT = 5
# The window's bound. While the decoded tail ends in U+FFFD the window grows; a tail still
# unfinished after this many tokens is not a character being spelled out byte by byte (one
# is at most 4 bytes) but bytes that never form one, and goes out as U+FFFD.
MAX_PENDING_TOKENS = 16
UTF8_MAX_BYTES = 4  # the longest character in UTF-8


class Decoder(Protocol):
    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = ...) -> str: ...


class IncrementalDetokenizer:
    """Turns one reply's token ids into text, a token at a time.

    `push` returns only text that is complete. A trailing run of U+FFFD in the decoded text
    (a character whose bytes are split across tokens) is held back, and the character comes
    out whole with the token that completes it; the text before the run goes out at once.
    Joining every push and the final `flush` gives the decode of the whole reply (for a
    byte-level BPE such as SmolLM2's or Qwen3's, exactly `tokenizer.decode(reply_ids)`).

    Each push decodes a short window, never the whole reply: the tokens of the last text
    sent, as context, and the tokens since. The context matters for decoders that read a
    token differently at the start of a text (SentencePiece drops its leading space) and for
    byte-fallback tokens, which decode as one group of bytes.

    `tokenizer` is a caldrix Tokenizer, or anything with `decode(ids, skip_special_tokens=)`.
    `prompt_ids`: the prompt's last few ids serve as the first context; they are never sent.
    A prompt that ends inside a character gives no context.
    `skip_special_tokens` (default True, as OpenAI-compatible servers do) leaves eos and
    other special tokens out of the text.
    """

    def __init__(
        self,
        tokenizer: Decoder,
        *,
        prompt_ids: Sequence[int] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        # ids[:read] is the context; ids[read:] are the tokens since the context was set.
        # decode(ids)[:sent] is accounted for: the context's own text, plus whatever went out
        # ahead of a held tail. An offset, not a text: a byte-fallback group that grows can
        # turn the context's own character into U+FFFD until the group is whole again.
        self._ids: list[int] = list(prompt_ids[-PROMPT_CONTEXT:]) if prompt_ids else []
        if self._decode(self._ids).endswith(REPLACEMENT):
            # A token-id prompt can end inside a character. Its bytes are the prompt's, so the
            # reply starts without context, and its text stays the decode of its own ids.
            self._ids = []
        self._read = len(self._ids)
        self._sent = len(self._decode(self._ids))

    def push(self, token_id: int) -> str:
        """The text that `token_id` completes, possibly empty."""
        self._ids.append(token_id)
        return self._advance(final=False)

    def flush(self) -> str:
        """The text still held at the end of the reply (an unfinished character as U+FFFD)."""
        return self._advance(final=True)

    def _advance(self, *, final: bool) -> str:
        pending = len(self._ids) - self._read
        if pending == 0:
            return ""
        text = self._decode(self._ids)
        if not final and pending >= MAX_PENDING_TOKENS and text.endswith(REPLACEMENT):
            # Bytes that never formed a character go out as U+FFFD, but the last few tokens stay
            # pending: the tail's U+FFFD may be the start of a character they have not finished
            # (at most 3 bytes of one, so at most 3 tokens), and sent now that character would
            # be lost when its last byte came.
            cut = len(self._ids) - (UTF8_MAX_BYTES - 1)
            new = self._decode(self._ids[:cut])[self._sent :]
            # Slide the window to the cut: the tokens sent become the next context.
            del self._ids[: self._read]
            self._read = cut - self._read  # the cut, less the context just dropped
            self._sent = len(self._decode(self._ids[: self._read]))
            return new
        if not final and pending < MAX_PENDING_TOKENS:
            if text.endswith(REPLACEMENT):
                # Send what comes before the unfinished tail, and keep the window, so the
                # tail's bytes decode together once the rest arrive.
                end = max(len(text.rstrip(REPLACEMENT)), self._sent)
                new, self._sent = text[self._sent : end], end
                return new
            if len(text) <= self._sent:
                # No text of its own (a skipped special token): keep the context as it is.
                return ""
        new = text[self._sent :]
        # Slide the window: the tokens since the context become the next context.
        del self._ids[: self._read]
        self._read = len(self._ids)
        self._sent = len(self._decode(self._ids))
        return new

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip)


class StopMatcher:
    """Holds back reply text that could begin a stop string, and ends the reply at one.

    `feed` returns (text to send now, stopped). Text that could be the start of a stop string
    stays held until later text settles it; a stop string split across tokens or feeds is
    found all the same. When a stop string completes, `feed` returns the text before it and
    True: the stop string and everything after it are never sent. With several stop strings
    the one that completes first in the reply wins (the earliest end; of those ending at the
    same place, the one starting earliest), so the answer does not depend on how the text
    was cut into feeds. After a stop every feed returns ("", True).

    `flush` returns the held text at the end of a reply that no stop string ended.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        if any(not s for s in stops):
            raise ValueError("a stop string cannot be empty")
        self._stops = tuple(dict.fromkeys(stops))  # dedupe, keep order
        self._held = ""
        self._stopped = False

    @property
    def stopped(self) -> bool:
        return self._stopped

    def feed(self, text: str) -> tuple[str, bool]:
        if self._stopped:
            return "", True
        if not self._stops:
            return text, False
        if not text:
            return "", False
        buf = self._held + text
        cut = self._first_stop(buf)
        if cut is not None:
            self._held, self._stopped = "", True
            return buf[:cut], True
        keep = self._partial_suffix(buf)
        self._held = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep], False

    def flush(self) -> str:
        """Held text, released when the reply ends without a stop string."""
        held, self._held = self._held, ""
        return "" if self._stopped else held

    def _first_stop(self, buf: str) -> int | None:
        """Where the first stop string to complete in `buf` starts, or None."""
        best: tuple[int, int] | None = None  # (end, start)
        for stop in self._stops:
            start = buf.find(stop)
            if start >= 0:
                candidate = (start + len(stop), start)
                if best is None or candidate < best:
                    best = candidate
        return None if best is None else best[1]

    def _partial_suffix(self, buf: str) -> int:
        """Length of the longest tail of `buf` that is a proper prefix of some stop string."""
        keep = 0
        for stop in self._stops:
            first = stop[0]
            # Only positions holding the stop's first character can start it.
            i = buf.find(first, max(0, len(buf) - len(stop) + 1))
            while i != -1:
                tail = len(buf) - i
                if tail <= keep:
                    break  # later starts are shorter than what is already kept
                if stop.startswith(buf[i:]):
                    keep = tail
                    break  # the earliest matching start is this stop's longest tail
                i = buf.find(first, i + 1)
        return keep
