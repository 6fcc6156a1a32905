"""A request's prompts for a decider, checked and built in the order they are paid for.

At load, `Decider.load(model_dir, tokenizer, vocab_size)` reads decider_config.json and the
tokenizer's label table once. Per request, `plan_request(decider, state, questions, context)` checks the
decider limits, renders and tokenizes the state once, builds each question's ids, checks the
prompt lengths, and returns the `DeciderPrompts` the engine reads (or the first Refusal).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import attrs

from caldrix.decider import config as dconfig
from caldrix.decider import limits, prompt


@attrs.frozen
class Decider:
    """What a decider model needs at request time, made once at load."""

    config: dconfig.DeciderConfig
    labels: prompt.Labels
    longest_token_bytes: int  # for the state pre-check (limits.check_state_text)
    encode: Callable[[str], list[int]] = attrs.field(eq=False, repr=False)

    @classmethod
    def load(cls, model_dir: str | Path, tokenizer: Any, vocab_size: int | None = None) -> Decider | None:
        """The decider of a model directory, or None when it holds no decider_config.json.

        `tokenizer` is the model's own (a caldrix Tokenizer or a transformers tokenizer) and
        `vocab_size` the model's embedding rows. Raises DeciderConfigError for a config that
        cannot be served and prompt.LabelError for a tokenizer without 255 one-token labels."""
        path = dconfig.find(model_dir)
        if path is None:
            return None
        return cls.from_config(dconfig.load(path), tokenizer, vocab_size)

    @classmethod
    def from_config(cls, cfg: dconfig.DeciderConfig, tokenizer: Any, vocab_size: int | None = None) -> Decider:
        encode = prompt.encoder(tokenizer)
        return cls(
            config=cfg,
            labels=prompt.label_table(encode, vocab_size),
            longest_token_bytes=prompt.longest_token_bytes(tokenizer),
            encode=encode,
        )


@attrs.frozen
class Row:
    """One prompt after the state: a question, or one level of a score question."""

    question: str  # the question's name
    level: int | None  # the level a row of an isolated score question asks about
    ids: tuple[int, ...]  # the question piece; the prompt is state_ids + ids
    read_ids: tuple[int, ...]  # the label ids whose logits are read at the last token


@attrs.frozen
class QuestionPlan:
    """How one question's answer comes out of its rows."""

    name: str
    type: str  # "choice", "score" or "noul"
    options: tuple[str, ...]  # choice: the option names; score: "0".."n-1"; noul: ("false", "true")
    first_row: int
    rows: int  # more than 1 only for a score question asked one level at a time
    isolated: bool


@attrs.frozen
class DeciderPrompts:
    """Every prompt of a request: the state's ids once, then each row's question ids."""

    state_ids: tuple[int, ...]
    rows: tuple[Row, ...]
    questions: tuple[QuestionPlan, ...]

    def prompt(self, i: int) -> tuple[int, ...]:
        """Row i's whole prompt, as decider's package builds it."""
        return self.state_ids + self.rows[i].ids

    def whole_tokens(self) -> int:
        """Input tokens when every prompt is read whole."""
        return len(self.rows) * len(self.state_ids) + sum(len(r.ids) for r in self.rows)

    def reused_tokens(self) -> int:
        """Input tokens when the state is read once and each row's question after it."""
        return len(self.state_ids) + sum(len(r.ids) for r in self.rows)


def plan_request(
    decider: Decider, state: Any, questions: Mapping[str, Any], context: int
) -> DeciderPrompts | limits.Refusal:
    """Check and build a request's prompts: the decider's question limits, the state cap (on
    the text, then on the ids), then every prompt's length under `context` (the compiled
    context). `state` is a string, object or array; `questions` as limits.check_questions takes
    them, in request order."""
    cfg = decider.config
    refusal = limits.check_questions(questions, cfg.max_options)
    if refusal is not None:
        return refusal
    text = prompt.state_text(state)
    refusal = limits.check_state_text(text, cfg.max_state_tokens, decider.longest_token_bytes)
    if refusal is not None:
        return refusal
    state_ids = tuple(prompt.state_ids(decider.encode, text))
    refusal = limits.check_state_tokens(len(state_ids), cfg.max_state_tokens)
    if refusal is not None:
        return refusal
    rows: list[Row] = []
    plans: list[QuestionPlan] = []
    for name, q in questions.items():
        kind = prompt.field(q, "type")
        isolated = kind == "score" and cfg.isolated_levels
        asked = prompt.isolated_levels(q) if isolated else (prompt.render(q),)
        first = len(rows)
        for level, text_q in enumerate(asked):
            rows.append(
                Row(
                    question=name,
                    level=level if isolated else None,
                    ids=tuple(prompt.question_ids(decider.encode, decider.labels, text_q)),
                    read_ids=decider.labels.ids[: len(text_q.options)],
                )
            )
        if kind == "choice":
            options = tuple(prompt.field(q, "criteria"))
        elif kind == "score":
            options = tuple(str(i) for i in range(len(prompt.field(q, "criteria"))))
        else:
            options = ("false", "true")
        plans.append(QuestionPlan(name, kind, options, first, len(rows) - first, isolated))
    lengths = [limits.PromptLength(r.question, r.level, len(state_ids) + len(r.ids)) for r in rows]
    refusal = limits.check_prompts(lengths, context)
    if refusal is not None:
        return refusal
    return DeciderPrompts(state_ids=state_ids, rows=tuple(rows), questions=tuple(plans))
