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
import sys
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
        # The context is the server's to check (--context), after tokenizing: transformers'
        # warning that a text is longer than the tokenizer's own limit ("... will result in
        # indexing errors") would otherwise reach the log for a prompt that is then refused.
        hf.model_max_length = sys.maxsize
        eos = set(eos_token_ids)
        if hf.eos_token_id is not None:
            eos.add(hf.eos_token_id)
        self.eos_token_ids: frozenset[int] = frozenset(eos)
        # Whether the template refuses a system message at the top of a conversation (Gemma's):
        # probed once, on first need, with a plain [system, user] pair (`refuses_system`).
        self._refuses_system: bool | None = None
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

    def render_chat(self, messages: Sequence[Any], template_kwargs: Mapping[str, Any] | None = None) -> list[int]:
        """The ids of `messages` through the chat template, ending with the generation prompt.

        `messages` are `ChatMessage` records or mappings with "role" and "content" (a
        string), and "reasoning_content" where an earlier assistant turn carries its reasoning.
        `template_kwargs` are extra variables for the template (a request's
        chat_template_kwargs, such as Qwen3's enable_thinking). When the template refuses every
        system message (`refuses_system`), the system text goes to the top of the first user
        message instead (see `merge_system`); that is logged once per process.
        Raises ChatTemplateError when there is no template or the template refuses the messages.
        """
        return list(self._hf(self.render_chat_text(messages, template_kwargs), add_special_tokens=False)["input_ids"])

    def render_chat_text(self, messages: Sequence[Any], template_kwargs: Mapping[str, Any] | None = None) -> str:
        """`render_chat` before tokenizing: the prompt as the template writes it."""
        if not self.has_chat_template:
            raise ChatTemplateError("this model has no chat template")
        conversation = [_as_dict(m) for m in messages]
        if any(m["role"] == "system" for m in conversation) and self.refuses_system:
            conversation = merge_system(conversation)
            _warn_system_fallback_once()
        try:
            return self._render(conversation, template_kwargs or {})
        except Exception as exc:  # jinja2's TemplateError, or whatever the template trips on
            raise ChatTemplateError(f"the chat template refused these messages: {exc}") from exc

    @property
    def refuses_system(self) -> bool:
        """Whether the template refuses a system message even in its plain place, first and
        followed by a user message. Only then are system messages merged: a template that
        refuses one elsewhere (Qwen3.5's "System message must be at the beginning") refuses
        that request, as transformers and vLLM do, and renders every other as written."""
        if self._refuses_system is None:
            try:
                self._render([{"role": "system", "content": "s"}, {"role": "user", "content": "u"}], {})
                self._refuses_system = False
            except Exception:
                self._refuses_system = True
        return self._refuses_system

    def _render(self, conversation: list[dict[str, str]], template_kwargs: Mapping[str, Any]) -> str:
        return self._hf.apply_chat_template(
            conversation, tokenize=False, add_generation_prompt=True, **template_kwargs
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
    """The message as the template reads it: role and content, and reasoning_content when an
    assistant turn carries one (Qwen3's template writes it into that turn's <think> block)."""
    if isinstance(message, Mapping):
        out = {"role": message["role"], "content": message["content"]}
        reasoning = message.get("reasoning_content")
    else:
        out = {"role": message.role, "content": message.content}
        reasoning = getattr(message, "reasoning", None)
    if reasoning is not None:
        out["reasoning_content"] = reasoning
    return out


def _warn_system_fallback_once() -> None:
    global _warned_system_fallback
    if not _warned_system_fallback:
        _warned_system_fallback = True
        log.warning(
            "the chat template refuses system messages; their text goes at the top of the "
            "first user message instead (said once)"
        )


def _config_eos_ids(directory: Path) -> set[int]:
    """The eos ids of generation_config.json, or of config.json when it is absent: its top
    level, else a composite's text_config (idefics3, qwen3_5), as transformers' generate()
    builds its generation config from a model config."""
    for name in ("generation_config.json", "config.json"):
        file = directory / name
        if file.is_file():
            try:
                raw = json.loads(file.read_text(encoding="utf-8"))
                eos = raw.get("eos_token_id")
                if eos is None and name == "config.json" and isinstance(raw.get("text_config"), dict):
                    eos = raw["text_config"].get("eos_token_id")
            except (OSError, ValueError, AttributeError):
                return set()
            if isinstance(eos, int):
                return {eos}
            if isinstance(eos, list):
                return {i for i in eos if isinstance(i, int)}
            return set()
    return set()
