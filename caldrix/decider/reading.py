"""A decider's answers from the logits read at each row's last token.

Per row: the logits of the row's labels (DeciderPrompts.rows[i].read_ids), in float32, divided by
the config's temperature, softmaxed over those labels alone, as decider's package computes them
(float32 throughout, the temperature a Python float). Per question: a choice, a score or a noul
with the formulas of the zero-shot reading (http-api.md), never rounded. A score question asked
one level at a time gets level i's probability as its yes probability over the sum of all the
levels' yes probabilities (0 for every level when no level has any, as in decider's package).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import attrs
import torch

from caldrix.decider.plan import DeciderPrompts, QuestionPlan


class NonFiniteReading(ValueError):
    """A probability came out as NaN or infinite: the route answers 500."""


@attrs.frozen
class ChoiceAnswer:
    name: str
    choice: str
    probabilities: tuple[tuple[str, float], ...]  # by option name, in the request's order
    confidence: float


@attrs.frozen
class ScoreAnswer:
    name: str
    score: float  # the expected level, sum of i * p_i
    probabilities: tuple[float, ...]  # by level index
    confidence: float


@attrs.frozen
class NoulAnswer:
    name: str
    noul: float  # the probability of yes


Answer = ChoiceAnswer | ScoreAnswer | NoulAnswer


def label_probabilities(logits: Sequence[float] | torch.Tensor, temperature: float) -> list[float]:
    """softmax(logits / temperature) over the labels, in float32."""
    lg = torch.as_tensor(logits).to(torch.float32)
    return torch.softmax(lg / temperature, -1).tolist()


def _first_max(p: Sequence[float]) -> int:
    return max(range(len(p)), key=p.__getitem__)  # an exact tie takes the first


def _uniform_if_empty(p: Sequence[float]) -> list[float]:
    total = sum(p)
    return [1.0 / len(p)] * len(p) if total == 0 else [x / total for x in p]


def choice_confidence(p: Sequence[float]) -> float:
    """max(0, (p_best - 1/n) / (1 - 1/n)), 1 with one option.

    Written as decider's package computes it, (n * p_max - 1) / (n - 1) on the normalized
    vector, so the digits match that package's to the last bit; systemone/reading.py keeps the
    spec's order of operations, whose example answer it reproduces exactly. The two differ in
    the last bits only."""
    n = len(p)
    if n <= 1:
        return 1.0
    return min(1.0, max(0.0, (n * max(p) - 1) / (n - 1)))


def score_confidence(p: Sequence[float]) -> float:
    """1 - (sum of p_i * |i - k|) / D, floored at 0, where k is the most likely level and D the
    mean distance of the levels from the middle of the scale; 1 with one level. A vector with no
    mass counts as uniform."""
    n = len(p)
    if n <= 1:
        return 1.0
    q = _uniform_if_empty(p)
    k = _first_max(q)
    spread = sum(x * abs(i - k) for i, x in enumerate(q))
    middle = sum(abs(i - (n - 1) / 2) for i in range(n)) / n
    return min(1.0, max(0.0, 1.0 - spread / middle))


def combine_levels(yes: Sequence[float]) -> list[float]:
    """Isolated levels: p_i = yes_i / sum(yes), all 0 when the sum is 0."""
    total = sum(yes)
    return [x / total for x in yes] if total else [0.0] * len(yes)


def answer(question: QuestionPlan, row_probs: Sequence[Sequence[float]]) -> Answer:
    """One question's answer from its rows' label probabilities."""
    if question.isolated:
        p = combine_levels([float(r[1]) for r in row_probs])
    else:
        p = [float(x) for x in row_probs[0]]
    if not all(math.isfinite(x) for x in p):
        raise NonFiniteReading(f"question {question.name}: a probability is not a finite number")
    if question.type == "noul":
        return NoulAnswer(question.name, p[1])
    if question.type == "choice":
        best = _first_max(p)
        return ChoiceAnswer(
            question.name, question.options[best], tuple(zip(question.options, p)), choice_confidence(p)
        )
    return ScoreAnswer(question.name, sum(i * x for i, x in enumerate(p)), tuple(p), score_confidence(p))


def answers(prompts: DeciderPrompts, row_logits: Sequence[Sequence[float] | torch.Tensor], temperature: float) -> tuple[Answer, ...]:
    """Every question's answer, in request order. `row_logits[i]` are row i's label logits, in
    the order of prompts.rows[i].read_ids. Raises NonFiniteReading."""
    if len(row_logits) != len(prompts.rows):
        raise ValueError(f"{len(row_logits)} logit rows for {len(prompts.rows)} prompts")
    probs = []
    for i, lg in enumerate(row_logits):
        p = label_probabilities(lg, temperature)
        if len(p) != len(prompts.rows[i].read_ids):
            raise ValueError(f"row {i}: {len(p)} logits for {len(prompts.rows[i].read_ids)} labels")
        probs.append(p)
    return tuple(
        answer(q, probs[q.first_row : q.first_row + q.rows]) for q in prompts.questions
    )
