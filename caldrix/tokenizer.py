"""The model's tokenizer: text to ids, chat messages to ids, ids back to text.

A thin wrapper over a transformers tokenizer loaded from a Hugging Face directory (or a GGUF
file), so the rest of caldrix sees plain lists of ints and one place decides the choices:

- `encode` adds what the model's tokenizer adds by default (add_special_tokens=True), as
  `tokenizer(text)` in transformers and vLLM's /v1/completions do: a Llama-style tokenizer
  puts its BOS first, SmolLM2 and Qwen3 add nothing. Special-token text typed into a prompt
  ("<|im_end|>") is read as that token, as both of them read it.
- `render_chat` renders through the model's own chat template with add_generation_prompt=True
  and the template's other defaults (a Qwen3 template keeps thinking on), then encodes the
  result without adding special tokens: the template writes its own. This is exactly what
  `apply_chat_template(tokenize=True)` gives.
- `decode` never cleans up tokenization spaces: clean-up is not stable under appending
  tokens, so streamed text would differ from the whole reply's.

Calls only read the transformers tokenizer (no call changes its truncation or padding), so
worker threads may share one `Tokenizer`.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

log = logging.getLogger("caldrix")

# The spec's "says so once in its log": once per process, not once per tokenizer.
_warned_system_fallback = False


class ChatTemplateError(ValueError):
    """The chat template refused these messages. The route answers 400 at param "messages"."""


class Tokenizer:
    """A loaded tokenizer and the ids that end a sequence.

    `eos_token_ids` is the tokenizer's eos token plus every eos id of the directory's
    generation_config.json (config.json's when there is no generation config): Qwen3 ends
    a chat reply on <|im_end|> and a base completion on <|endoftext|>.
    """

    def __init__(self, hf: Any, eos_token_ids: Iterable[int] = ()) -> None:
        self._hf = hf
        eos = set(eos_token_ids)
        if hf.eos_token_id is not None:
            eos.add(hf.eos_token_id)
        self.eos_token_ids: frozenset[int] = frozenset(eos)
        # Set once a template has refused a system message: later requests merge up front
        # rather than fail a render first.
        self._merge_system = False
        self._longest: int | None = None

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """Load from a Hugging Face directory, or from a .gguf file's embedded tokenizer."""
        from transformers import AutoTokenizer  # heavy: only when a model is loaded

        path = Path(path)
        if path.is_file() and path.suffix == ".gguf":
            hf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
            return cls(hf)
        hf = AutoTokenizer.from_pretrained(str(path))
        return cls(hf, _config_eos_ids(path))

    # -- properties ---------------------------------------------------------------------------

    @property
    def hf(self) -> Any:
        """The wrapped transformers tokenizer, for what this class does not cover."""
        return self._hf

    @property
    def vocab_size(self) -> int:
        """The tokenizer's length, added tokens included. The model's embedding table may be
        larger (Qwen3 pads it); validation uses the model's size, not this one."""
        return len(self._hf)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self._hf, "chat_template", None))

    @property
    def longest_token_bytes(self) -> int:
        """An upper bound on the UTF-8 bytes one token stands for: the longest vocabulary entry
        in UTF-8 (byte-level BPE writes a byte as one character of at most two bytes), so a
        text of B bytes is at least B / this many tokens, for text the tokenizer's
        normalization does not shrink. Read from the vocabulary on first use."""
        if self._longest is None:
            self._longest = max(1, max((len(t.encode("utf-8")) for t in self._hf.get_vocab()), default=1))
        return self._longest

    def at_least_tokens(self, text: str) -> int:
        """A lower bound on the tokens of `text`, without tokenizing it (`longest_token_bytes`)."""
        return -(-len(text.encode("utf-8")) // self.longest_token_bytes)

    # -- text ---------------------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        """A completion prompt's ids, with the special tokens the tokenizer adds by default."""
        return list(self._hf(text, add_special_tokens=True)["input_ids"])

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """Text of `ids`. Special tokens (an eos, <|im_start|>) are left out by default, as
        OpenAI-compatible servers do; ordinary added tokens such as <think> are kept."""
        return self._hf.decode(
            list(ids),
            skip_special_tokens=skip_special_tokens,
            clean_up_tokenization_spaces=False,
        )

    # -- chat ---------------------------------------------------------------------------------

    def render_chat(self, messages: Sequence[Any]) -> list[int]:
        """The ids of `messages` through the chat template, ending with the generation prompt.

        `messages` are `ChatMessage` records or mappings with "role" and "content" (a
        string). When the template refuses them and a system message is among them, the
        system text goes to the top of the first user message instead (see
        `merge_system`) and the render is tried once more; that is logged once per process.
        Raises ChatTemplateError when there is no template or the template still refuses.
        """
        return list(self._hf(self.render_chat_text(messages), add_special_tokens=False)["input_ids"])

    def render_chat_text(self, messages: Sequence[Any]) -> str:
        """`render_chat` before tokenizing: the prompt as the template writes it."""
        if not self.has_chat_template:
            raise ChatTemplateError("this model has no chat template")
        conversation = [_as_dict(m) for m in messages]
        has_system = any(m["role"] == "system" for m in conversation)
        if has_system and self._merge_system:
            return self._render(merge_system(conversation))
        try:
            return self._render(conversation)
        except Exception as first:  # jinja2's TemplateError, or whatever the template trips on
            if not has_system:
                raise ChatTemplateError(f"the chat template refused these messages: {first}") from first
            try:
                text = self._render(merge_system(conversation))
            except Exception as second:
                raise ChatTemplateError(
                    f"the chat template refused these messages: {second}"
                ) from second
        self._merge_system = True
        _warn_system_fallback_once()
        return text

    def _render(self, conversation: list[dict[str, str]]) -> str:
        return self._hf.apply_chat_template(
            conversation, tokenize=False, add_generation_prompt=True
        )


def merge_system(conversation: Sequence[Mapping[str, str]]) -> list[dict[str, str]]:
    """The conversation with its system messages folded into the first user message.

    The system texts (joined by a blank line when there are several) go at the top of the
    first user message, followed by a blank line and the user's text: the layout chat
    templates that fold a system prompt themselves use (Gemma's, Mistral's). Without a user
    message the system text becomes one, where the first system message stood.
    """
    system = "\n\n".join(m["content"] for m in conversation if m["role"] == "system")
    rest = [dict(m) for m in conversation if m["role"] != "system"]
    for m in rest:
        if m["role"] == "user":
            m["content"] = f"{system}\n\n{m['content']}" if m["content"] else system
            return rest
    first = next(i for i, m in enumerate(conversation) if m["role"] == "system")
    before = sum(1 for m in conversation[:first] if m["role"] != "system")
    rest.insert(before, {"role": "user", "content": system})
    return rest


def _as_dict(message: Any) -> dict[str, str]:
    if isinstance(message, Mapping):
        return {"role": message["role"], "content": message["content"]}
    return {"role": message.role, "content": message.content}


def _warn_system_fallback_once() -> None:
    global _warned_system_fallback
    if not _warned_system_fallback:
        _warned_system_fallback = True
        log.warning(
            "the chat template refuses system messages; their text goes at the top of the "
            "first user message instead (said once)"
        )


def _config_eos_ids(directory: Path) -> set[int]:
    """The eos ids of generation_config.json, or of config.json when it is absent."""
    for name in ("generation_config.json", "config.json"):
        file = directory / name
        if file.is_file():
            try:
                eos = json.loads(file.read_text(encoding="utf-8")).get("eos_token_id")
            except (OSError, ValueError, AttributeError):
                return set()
            if isinstance(eos, int):
                return {eos}
            if isinstance(eos, list):
                return {i for i in eos if isinstance(i, int)}
            return set()
    return set()
