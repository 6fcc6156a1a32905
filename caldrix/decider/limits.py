"""The decider's refusals, each worded as http-api.md "The decider reading" has them.

Pure functions: each returns None when the request passes, or a Refusal (message, param) that
the route answers as a 400 invalid_request_error. They run in the order a request is paid for:
`check_questions` on the parsed request, `check_state_text` on the state's text before it is
tokenized, `check_state_tokens` on the state's ids, `check_prompts` on every prompt's length
before anything is read. The route checks the request's shape first (unknown fields, types,
"type": "box", the model name), as for the zero-shot reading, but not the zero-shot counts: a
decider takes up to max_options options and 2 to 10 levels instead.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from caldrix.decider.prompt import field

PREFIX = "this model is a decider: "
MIN_QUESTIONS, MAX_QUESTIONS = 1, 64
MIN_OPTIONS = 2
MIN_LEVELS, MAX_LEVELS = 2, 10
PROMPTS_PER_CONTEXT = 64  # all the prompts of one request together, in compiled contexts


@attrs.frozen
class Refusal:
    """A 400: the message and the field it names (None for the request as a whole)."""

    message: str
    param: str | None
    code: str | None = None  # "context_length_exceeded" for a prompt past the context, as OpenAI's


def _missing(value: Any) -> bool:
    return value is None or (isinstance(value, str) and value == "")


def check_questions(questions: Mapping[str, Any], max_options: int) -> Refusal | None:
    """The four refusals that start "this model is a decider: ", the first that applies.

    `questions` maps names to questions (mappings, or records with attributes of the same
    names) whose shape the route has checked: "type" one of choice, score, noul; "criteria" a
    mapping (choice), a sequence (score), or a mapping with "true" and "false" keys, null or
    absent (noul); "instructions" absent or any JSON value."""
    n = len(questions)
    if not MIN_QUESTIONS <= n <= MAX_QUESTIONS:
        return Refusal(f"{PREFIX}questions must hold {MIN_QUESTIONS} to {MAX_QUESTIONS} questions, got {n}", "questions")
    for name, q in questions.items():
        kind = field(q, "type")
        where = f"questions.{name}"
        if kind in ("choice", "score") and _missing(field(q, "instructions")):
            return Refusal(
                f'{PREFIX}instructions are required on a {kind} question and may not be null or ""',
                f"{where}.instructions",
            )
        criteria = field(q, "criteria")
        if kind == "choice":
            count = len(criteria) if criteria is not None else 0
            if not MIN_OPTIONS <= count <= max_options:
                return Refusal(
                    f"{PREFIX}a choice question takes {MIN_OPTIONS} to {max_options} options, got {count}",
                    f"{where}.criteria",
                )
        elif kind == "score":
            count = len(criteria) if criteria is not None else 0
            if not MIN_LEVELS <= count <= MAX_LEVELS:
                return Refusal(
                    f"{PREFIX}a score question takes {MIN_LEVELS} to {MAX_LEVELS} levels, got {count}",
                    f"{where}.criteria",
                )
        elif kind == "noul" and _missing(field(q, "instructions")):
            c = criteria if isinstance(criteria, Mapping) else {}
            if _missing(c.get("true")) and _missing(c.get("false")):
                return Refusal(
                    f"{PREFIX}a noul question without instructions needs criteria describing true or false",
                    f"{where}.criteria",
                )
    return None


def _state_cap(count: str, cap: int) -> Refusal:
    return Refusal(
        f'the state is {count} tokens with its "Context:" line, and this decider reads at most '
        f"{cap} (max_state_tokens)",
        "state",
    )


def state_lower_bound(text: str, longest_token_bytes: int) -> int:
    """The fewest tokens "Context:\\n" + text can be, at the vocabulary's longest token each
    (for text the tokenizer's normalization does not shrink)."""
    size = len(("Context:\n" + text).encode("utf-8"))
    return -(-size // longest_token_bytes)


def check_state_text(text: str, max_state_tokens: int, longest_token_bytes: int) -> Refusal | None:
    """Before tokenizing: a state too long for the cap even at the longest token per token."""
    least = state_lower_bound(text, longest_token_bytes)
    if least > max_state_tokens:
        return _state_cap(f"at least {least}", max_state_tokens)
    return None


def check_state_tokens(count: int, max_state_tokens: int) -> Refusal | None:
    """The state cap on the state's ids ("Context:\\n" and the state, one encode): decider's
    package cuts its state at this count, so a state within it is read whole by both."""
    if count > max_state_tokens:
        return _state_cap(str(count), max_state_tokens)
    return None


@attrs.frozen
class PromptLength:
    """One prompt's length and what to call it in a refusal."""

    question: str
    level: int | None  # the level of a score question asked one level at a time
    tokens: int  # the whole prompt: the state's ids and the question's


def check_prompts(prompts: Sequence[PromptLength], context: int) -> Refusal | None:
    """Every prompt leaves the read step room under the compiled context (at most context - 1
    tokens, as a chat prompt must leave one row for its reply), and all the prompts of the
    request together, counted whole, are at most 64 times the context."""
    for p in prompts:
        if p.tokens >= context:
            what = f"question {p.question}" if p.level is None else f"level {p.level} of question {p.question}"
            return Refusal(
                f"the prompt of {what} is {p.tokens} tokens and the context holds {context}; "
                "that leaves no room for the read step",
                f"questions.{p.question}",
                "context_length_exceeded",
            )
    total = sum(p.tokens for p in prompts)
    most = PROMPTS_PER_CONTEXT * context
    if total > most:
        return Refusal(
            f"the prompts of this request are {total} tokens together, and at most "
            f"{PROMPTS_PER_CONTEXT} times the context ({most}) are read for one request",
            "questions",
        )
    return None
