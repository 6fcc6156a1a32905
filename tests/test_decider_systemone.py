"""The decider reading through /v1/systemone's request parsing (caldrix.systemone, branch
systemone): a raw body, parsed keeping number lexemes and validated with the decider's limits,
gives the prompts decider-ai 1.10.0 builds from the same body parsed by Python's json, and the
refusals the spec words. Skipped where caldrix.systemone is not in the tree."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("caldrix.systemone.reading")
pytest.importorskip("decider.systemone")
from decider import prompt_fast, systemone  # noqa: E402

from caldrix.decider import reading  # noqa: E402
from caldrix.decider.config import DeciderConfig  # noqa: E402
from caldrix.decider.plan import Decider, plan_request  # noqa: E402
from caldrix.decider.systemone import DeciderReading  # noqa: E402
from caldrix.routes.errors import ApiError  # noqa: E402
from caldrix.systemone import jsonlex  # noqa: E402
from caldrix.systemone import reading as zs_reading  # noqa: E402
from caldrix.systemone.request import parse_body, parse_request  # noqa: E402

BODY = {
    "model": "decider",
    "state": {"ticket": {"text": "charged twice\n", "amount": 12.50}, "log": list(range(9)), "ratio": 1e-05},
    "questions": {
        "team": {"type": "choice", "instructions": "Which team?", "criteria": {"billing": None, "shipping": {"k": [1.50]}}},
        "urgency": {"type": "score", "instructions": "How urgent?", "criteria": ["0: low", {"v": 2.0}, "2: high"]},
        "angry": {"type": "noul", "criteria": {"true": "angry"}},
    },
}
RAW = json.dumps(BODY).replace("12.5", "12.50").replace("[1.5]", "[1.50]").replace("1e-05", "0.00001").encode()


@pytest.fixture(scope="module", params=[False, True], ids=["levels together", "isolated levels"])
def decider_reading(request, qwen35_tokenizer):
    cfg = DeciderConfig(path=Path("decider_config.json"), temperature=1.3, isolated_levels=request.param, max_options=40)
    return DeciderReading(Decider.from_config(cfg, qwen35_tokenizer, 248320))


def parsed(reading_, raw=RAW):
    req = parse_request(parse_body(raw), "decider", reading_.limits)
    for q in req.questions:
        reading_.check_question(q)
    return req


def test_the_probes_are_the_packages_prompts(decider_reading, qwen35_tokenizer):
    plans = decider_reading.plan(parsed(decider_reading), 1 << 20)
    ref = json.loads(RAW)
    rqs = {k: systemone.render_question(v) for k, v in ref["questions"].items()}
    flat, _ = systemone.plan_rows(rqs, decider_reading.decider.config.isolated_levels)
    items, _ = prompt_fast.build_rows(qwen35_tokenizer, systemone.render_state(ref["state"]),
                                      [[(r["question"], list(r["options"]))] for r in flat], max_ctx_tokens=1 << 30)
    probes = [p for plan in plans for p in plan.probes]
    assert [list(p.ids) for p in probes] == [it["ids"] for it in items]
    assert [p.counted for p in probes] == [len(it["ids"]) for it in items]
    assert [len(plan.probes) for plan in plans] == [1, 3 if decider_reading.decider.config.isolated_levels else 1, 1]


def test_probabilities_in_the_routes_order(decider_reading):
    req = parsed(decider_reading)
    plans = decider_reading.plan(req, 1 << 20)
    gen = torch.Generator().manual_seed(7)
    reads = [[tuple((torch.randn(len(p.read_ids), generator=gen) * 3).tolist()) for p in plan.probes] for plan in plans]
    questions = {q.name: {"type": q.kind, "instructions": q.instructions,
                          "criteria": ({o.name: o.text for o in q.options} if q.kind == "choice" else
                                       [o.text for o in q.options] if q.kind == "score" else
                                       {o.name: o.text for o in q.options if o.given})} for q in req.questions}
    prompts = plan_request(decider_reading.decider, req.state, questions, 1 << 20)
    want = reading.answers(prompts, [r for rs in reads for r in rs], decider_reading.decider.config.temperature)
    for plan, rs, a in zip(plans, reads, want):
        p = decider_reading.probabilities(plan, rs)
        if plan.question.kind == "noul":
            assert p[0] == a.noul and p[0] + p[1] == pytest.approx(1, abs=1e-6)
        elif plan.question.kind == "choice":
            assert p == tuple(x for _, x in a.probabilities)
        else:
            assert p == a.probabilities


def test_levels_with_no_mass_answer_as_the_package_does(decider_reading):
    """Isolated levels whose yes probabilities all underflow to 0: the package counts the vector
    as uniform for the confidence (0 here), not as all mass on the first level (1)."""
    req = parsed(decider_reading)
    plan = decider_reading.plan(req, 1 << 20)[1]
    assert plan.question.kind == "score"
    # a level's own row reads (no, yes), so its yes is exp(-200 / 1.3) = 0 in float32
    reads = [tuple([0.0] + [-200.0] * (len(p.read_ids) - 1)) for p in plan.probes]
    p = decider_reading.probabilities(plan, reads)
    got = zs_reading.answer(plan.question, p, jsonlex.echo)
    assert got["confidence"] == pytest.approx(systemone.score_confidence(list(p)), abs=1e-6)
    if decider_reading.decider.config.isolated_levels:
        assert not any(p) and got["confidence"] == 0.0 and got["score"] == 0.0


@pytest.mark.parametrize(
    "question, message, param",
    [
        ({"type": "choice", "criteria": {"a": None, "b": None}},
         'this model is a decider: instructions are required on a choice question and may not be null or ""',
         "questions.q.instructions"),
        ({"type": "score", "instructions": None, "criteria": ["a", "b"]},
         'this model is a decider: instructions are required on a score question and may not be null or ""',
         "questions.q.instructions"),
        ({"type": "noul", "criteria": {"true": None}},
         "this model is a decider: a noul question without instructions needs criteria describing true or false",
         "questions.q.criteria"),
        ({"type": "choice", "instructions": "x", "criteria": {f"o{i}": None for i in range(41)}},
         "this model is a decider: a choice question takes 2 to 40 options, got 41", "questions.q.criteria"),
        ({"type": "score", "instructions": "x", "criteria": ["a"]},
         "this model is a decider: a score question takes 2 to 10 levels, got 1", "questions.q.criteria"),
    ],
)
def test_refusals_through_the_routes_validation(decider_reading, question, message, param):
    raw = json.dumps({"model": "decider", "state": "s", "questions": {"q": question}}).encode()
    with pytest.raises(ApiError) as e:
        parsed(decider_reading, raw)
    assert (e.value.status, e.value.body()["error"]["message"], e.value.body()["error"]["param"]) == (400, message, param)


def test_the_state_cap_through_plan(qwen35_tokenizer):
    cfg = DeciderConfig(path=Path("decider_config.json"), temperature=1.0, max_state_tokens=5)
    r = DeciderReading(Decider.from_config(cfg, qwen35_tokenizer, 248320))
    raw = json.dumps({"model": "decider", "state": "one two three", "questions": {"q": {"type": "noul", "instructions": "?"}}})
    with pytest.raises(ApiError) as e:
        r.plan(parsed(r, raw.encode()), 1 << 20)
    assert e.value.body()["error"] == {
        "code": None, "param": "state", "type": "invalid_request_error",
        "message": 'the state is 6 tokens with its "Context:" line, and this decider reads at most 5 (max_state_tokens)',
    }
