"""The decider reading as a /v1/systemone `Reading` (caldrix/systemone/reading.py, branch
systemone): the route's shared parsing and shape checks, then this package's limits, prompts and
probabilities.

Made once when the model loads (`DeciderReading.load(model_dir, tokenizer, vocab_size)`, None
when the directory holds no decider_config.json); the route's `reading_for` picks it over the
zero-shot reading. The counts (1 to 64 questions, 2 to max_options options, 2 to 10 levels) are
checked by the route's validation through `limits`, with the decider's prefix; the rest here.

Every probe is a whole prompt whose first `shared` ids are the state's (Probe.shared): the route
has the first probe keep the model's state there and the later ones start from it
(Submission.lease), and counts what was actually read.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs

from caldrix.decider import limits as dlimits
from caldrix.decider import reading as dreading
from caldrix.decider.plan import Decider, plan_request
from caldrix.routes.errors import ApiError
from caldrix.systemone.reading import NotFinite, Plan, Probe
from caldrix.systemone.request import Limits, Question, SystemOneRequest


def question_fields(q: Question) -> dict[str, Any]:
    """A validated question as caldrix.decider takes it: type, instructions, criteria."""
    if q.kind == "choice":
        criteria: Any = {o.name: o.text for o in q.options}
    elif q.kind == "score":
        criteria = [o.text for o in q.options]
    else:  # an absent description and a null one are the same to a decider
        criteria = {o.name: o.text for o in q.options if o.given}
    return {"type": q.kind, "instructions": q.instructions, "criteria": criteria}


@attrs.define(eq=False)
class DeciderReading:
    decider: Decider
    limits: Limits = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        cfg = self.decider.config
        self.limits = Limits(
            questions=(dlimits.MIN_QUESTIONS, dlimits.MAX_QUESTIONS),
            choice=(dlimits.MIN_OPTIONS, cfg.max_options),
            score=(dlimits.MIN_LEVELS, dlimits.MAX_LEVELS),
            prefix=dlimits.PREFIX,
        )

    @classmethod
    def load(cls, model_dir: str | Path, tokenizer: Any, vocab_size: int) -> DeciderReading | None:
        """None for a model that is not a decider; raises DeciderConfigError or LabelError."""
        decider = Decider.load(model_dir, tokenizer, vocab_size)
        return None if decider is None else cls(decider)

    def check_model(self) -> None:
        pass  # the labels were checked at load; a decider needs no chat template

    def check_question(self, q: Question) -> None:
        refusal = dlimits.check_questions({q.name: question_fields(q)}, self.decider.config.max_options)
        if refusal is not None:
            raise ApiError.invalid(refusal.message, refusal.param)

    def plan(self, req: SystemOneRequest, context: int) -> list[Plan]:
        questions = {q.name: question_fields(q) for q in req.questions}
        got = plan_request(self.decider, req.state, questions, context)
        if isinstance(got, dlimits.Refusal):
            raise ApiError(400, got.message, got.param, code=got.code)
        plans = []
        for q, qp in zip(req.questions, got.questions):
            probes = []
            for i in range(qp.first_row, qp.first_row + qp.rows):
                ids = got.prompt(i)
                probes.append(Probe(ids=ids, read_ids=got.rows[i].read_ids, counted=len(ids),
                                    shared=len(got.state_ids)))
            plans.append(Plan(q, tuple(probes)))
        return plans

    def probabilities(self, plan: Plan, reads: Sequence[tuple[float, ...]]) -> tuple[float, ...]:
        """Over the question's options in the route's order; a noul as (yes, no)."""
        q = plan.question
        isolated = q.kind == "score" and self.decider.config.isolated_levels
        name = q.name
        options = tuple(o.name for o in q.options)
        question = dreading.QuestionPlan(name, q.kind, options, 0, len(reads), isolated)
        rows = [dreading.label_probabilities(lg, self.decider.config.temperature) for lg in reads]
        try:
            a = dreading.answer(question, rows)
        except dreading.NonFiniteReading:
            raise NotFinite from None
        if isinstance(a, dreading.NoulAnswer):
            return (a.noul, rows[0][0])
        if isinstance(a, dreading.ChoiceAnswer):
            return tuple(p for _, p in a.probabilities)
        return a.probabilities
