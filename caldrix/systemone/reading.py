"""How an answer is read: the records both readings share, the answer maths, and the zero-shot
reading.

A reading turns a validated request into `Plan`s (one per question, each a list of `Probe`s:
read-only prompts and the label ids whose logits to read) and turns each plan's logits back into
probabilities over the question's options. Everything else (parsing, validation, the queue, the
response) is the route's and does not depend on the reading. The decider reading (issue 27)
plugs in as another `Reading`: its own prompt builder, labels, temperature, limits, and
several probes per question for isolated levels, combined in its `probabilities`.
"""

from __future__ import annotations

import math
from typing import Any, Protocol, Sequence

import attrs
import torch

from caldrix.routes.errors import ApiError
from caldrix.systemone import prompt as zs_prompt
from caldrix.systemone.request import Limits, Question, SystemOneRequest

LETTERS = tuple(chr(ord("A") + i) for i in range(26))
YES_NO = ("Yes", "No")
NO_CHAT_TEMPLATE = "the model has no chat template; /v1/systemone needs one"


@attrs.frozen
class Probe:
    """One read-only request to the scheduler: the prompt's ids, the ids whose next-token logits
    come back, and the tokens it adds to usage.input_tokens."""

    ids: tuple[int, ...]
    read_ids: tuple[int, ...]
    counted: int
    text: str = ""  # the rendered prompt, for the route's debug log (--log-level debug)
    # The first `shared` ids are the same in every probe of the request (the decider's state):
    # the route may have them read once (Submission.lease). 0: nothing shared.
    shared: int = 0


@attrs.frozen
class Plan:
    question: Question
    probes: tuple[Probe, ...]


class NotFinite(Exception):
    """A reading gave a probability that is not a finite number: the route answers 500."""


class Reading(Protocol):
    """What the route needs from a reading. All calls are synchronous; `plan` may tokenize."""

    limits: Limits

    def check_model(self) -> None:
        """Refuse (400, param null) when this model cannot be read this way."""

    def check_question(self, q: Question) -> None:
        """Reading-specific refusals about one question (after the shared shape checks)."""

    def plan(self, req: SystemOneRequest, context: int) -> list[Plan]:
        """Every question's probes, in order. Refuses a label the vocabulary lacks (param null)
        and a prompt that does not fit `context` rows (param: the question's path)."""

    def probabilities(self, plan: Plan, reads: Sequence[tuple[float, ...]]) -> tuple[float, ...]:
        """The question's probabilities over its options, in option order (noul: yes, no), from
        each probe's read logits. Raises NotFinite."""


# --- the answer maths (both readings) ---------------------------------------------------------


def softmax32(logits: Sequence[float], temperature: float = 1.0) -> tuple[float, ...]:
    """A float32 softmax of `logits` (divided by `temperature`), each probability as a float.
    Raises NotFinite when any probability is not a finite number."""
    t = torch.tensor(list(logits), dtype=torch.float32)
    if temperature != 1.0:
        t = t / temperature
    p = torch.softmax(t, dim=0).tolist()
    if not all(math.isfinite(x) for x in p):
        raise NotFinite
    return tuple(p)


def first_best(p: Sequence[float]) -> int:
    """The index of the largest probability; an exact tie takes the first."""
    best = 0
    for i, x in enumerate(p):
        if x > p[best]:
            best = i
    return best


def choice_confidence(p: Sequence[float]) -> float:
    n = len(p)
    if n == 1:
        return 1.0
    return max(0.0, (p[first_best(p)] - 1 / n) / (1 - 1 / n))


def expected_level(p: Sequence[float]) -> float:
    total = 0.0
    for i, x in enumerate(p):
        total += i * x
    return total


def score_confidence(p: Sequence[float]) -> float:
    """clip01(1 - sum_i p_i |i - k| / D), k the most likely level, D = mean_i |i - (n-1)/2|.
    A vector with no mass counts as uniform, as in decider's package: the decider's isolated
    levels give one when every level's yes underflows to 0 (a softmax never does)."""
    n = len(p)
    if n == 1:
        return 1.0
    if not any(p):
        p = [1.0 / n] * n
    k = first_best(p)
    spread = 0.0
    for i, x in enumerate(p):
        spread += x * abs(i - k)
    d = sum(abs(i - (n - 1) / 2) for i in range(n)) / n
    return min(1.0, max(0.0, 1 - spread / d))


def answer(q: Question, p: Sequence[float], echo) -> dict[str, Any]:
    """The answer object of http-api.md for question q with option probabilities p. `echo`
    turns a level into what the legend sends (jsonlex.echo: numbers keep their lexemes)."""
    if q.kind == "choice":
        return {"type": "choice", "choice": q.options[first_best(p)].name,
                "probabilities": {o.name: x for o, x in zip(q.options, p)},
                "confidence": choice_confidence(p)}
    if q.kind == "score":
        return {"type": "score", "score": expected_level(p),
                "legend": {o.name: echo(o.text) for o in q.options},
                "probabilities": {o.name: x for o, x in zip(q.options, p)},
                "confidence": score_confidence(p)}
    return {"type": "noul", "noul": p[0]}


# --- the zero-shot reading --------------------------------------------------------------------


@attrs.define(eq=False)
class ZeroShot:
    """Any chat model, read zero-shot: one prompt per question through the chat template
    (prompt.py), labels A-Z or Yes/No, a plain float32 softmax over the label logits."""

    tokenizer: Any  # caldrix.tokenizer.Tokenizer
    vocab_size: int  # the model's rows: a label id must be below it
    parts: bool = False  # the template reads content parts only (a vision model: prompt.render)
    limits: Limits = Limits()
    _label_ids: dict[str, int | None] = attrs.field(factory=dict, init=False)

    def check_model(self) -> None:
        if not self.tokenizer.has_chat_template:
            raise ApiError.invalid(NO_CHAT_TEMPLATE, None)

    def check_question(self, q: Question) -> None:
        pass

    def labels(self, q: Question) -> tuple[str, ...]:
        return YES_NO if q.kind == "noul" else LETTERS[: len(q.options)]

    def label_ids(self, labels: Sequence[str]) -> tuple[int, ...]:
        """Each label's one token, or a 400 (param null) naming the first label that has no
        token of its own: it encodes to several tokens, to an id past the model's rows, or to
        the same token as an earlier label."""
        out: list[int] = []
        for label in labels:
            if label not in self._label_ids:
                ids = self.tokenizer.hf(label, add_special_tokens=False)["input_ids"]
                ok = len(ids) == 1 and 0 <= ids[0] < self.vocab_size
                self._label_ids[label] = ids[0] if ok else None
            got = self._label_ids[label]
            if got is None or got in out:
                raise ApiError.invalid(f'the label "{label}" is not one token of its own in this model\'s '
                                       "vocabulary", None)
            out.append(got)
        return tuple(out)

    def plan(self, req: SystemOneRequest, context: int) -> list[Plan]:
        hf = self.tokenizer.hf
        read = [self.label_ids(self.labels(q)) for q in req.questions]
        texts = [zs_prompt.render(hf, zs_prompt.user_message(req.state, q, self.labels(q)), self.parts)
                 for q in req.questions]
        # Before tokenizing anything: a prompt whose bytes need more tokens than the context
        # holds, even at the vocabulary's longest token each, cannot fit.
        for q, text in zip(req.questions, texts):
            at_least = self.tokenizer.at_least_tokens(text)
            if at_least >= context:
                raise ApiError.past_context(f"the prompt of this question is at least {at_least} tokens and the "
                                            f"context holds {context}; that leaves no room for the read", q.path)
        plans = []
        for q, text, ids in zip(req.questions, texts, read):
            prompt_ids = zs_prompt.encode(hf, text)
            if len(prompt_ids) >= context:
                raise ApiError.past_context(f"the prompt of this question is {len(prompt_ids)} tokens and the "
                                            f"context holds {context}; that leaves no room for the read", q.path)
            plans.append(Plan(q, (Probe(prompt_ids, ids, len(prompt_ids), text),)))
        return plans

    def probabilities(self, plan: Plan, reads: Sequence[tuple[float, ...]]) -> tuple[float, ...]:
        (logits,) = reads
        return softmax32(logits)

