"""The decider's answers against decider-ai 1.10.0's formulas, and every decider refusal's wording.

The package's answer code (decider.systemone.assemble, decider.temperature.scaled_softmax) is run
on the same random label logits, with its rounding switched off: caldrix never rounds.
"""

from __future__ import annotations

import math
from pathlib import Path

import attrs
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from caldrix.decider import limits, reading
from caldrix.decider.config import DeciderConfig
from caldrix.decider.limits import Refusal
from caldrix.decider.plan import Decider, DeciderPrompts, QuestionPlan, plan_request

pytest.importorskip("decider.systemone")
from decider import systemone, temperature  # noqa: E402  (the package's own formulas)

PREFIX = "this model is a decider: "


@pytest.fixture(scope="module")
def make_decider(qwen35_tokenizer):
    def make(**settings) -> Decider:
        cfg = DeciderConfig(path=Path("decider_config.json"), **{"temperature": 1.0, **settings})
        return Decider.from_config(cfg, qwen35_tokenizer, 248320)

    return make


@pytest.fixture(scope="module")
def deciders(make_decider):
    return {iso: make_decider(isolated_levels=iso, temperature=1.37) for iso in (False, True)}


@st.composite
def request_questions(draw):
    qs = {}
    for k in range(draw(st.integers(1, 5))):
        kind = draw(st.sampled_from(["choice", "score", "noul"]))
        n = draw(st.integers(2, 14 if kind == "choice" else 10))
        if kind == "choice":
            qs[f"q{k}"] = {"type": "choice", "instructions": "pick", "criteria": {f"o{i}": None for i in range(n)}}
        elif kind == "score":
            qs[f"q{k}"] = {"type": "score", "instructions": "rate", "criteria": [f"level {i}" for i in range(n)]}
        else:
            qs[f"q{k}"] = {"type": "noul", "instructions": "yes?"}
    return qs


@settings(max_examples=150, deadline=None)
@given(questions=request_questions(), isolated=st.booleans(), seed=st.integers(0, 2**31), scale=st.sampled_from([0.1, 3.0, 30.0]))
def test_answers_equal_the_packages_formulas(deciders, monkeypatch_module, questions, isolated, seed, scale):
    decider = deciders[isolated]
    prompts = plan_request(decider, "state", questions, 1 << 20)
    assert isinstance(prompts, DeciderPrompts)
    gen = torch.Generator().manual_seed(seed)
    logits = [torch.randn(len(r.read_ids), generator=gen) * scale for r in prompts.rows]
    ours = reading.answers(prompts, logits, decider.config.temperature)

    # the package: scaled_softmax per row (float32), then assemble without its rounding
    rqs = {k: systemone.render_question(v) for k, v in questions.items()}
    _, index = systemone.plan_rows(rqs, isolated)
    probs = [temperature.scaled_softmax(lg.float()[None], decider.config.temperature)[0] for lg in logits]
    for lg, p in zip(logits, probs):
        assert reading.label_probabilities(lg, decider.config.temperature) == p.tolist()  # bit for bit
    ref = systemone.assemble(rqs, index, probs)
    assert [a.name for a in ours] == list(questions)
    for a in ours:
        want = ref[a.name]
        if isinstance(a, reading.NoulAnswer):
            assert a.noul == pytest.approx(want["noul"], abs=1e-5)
        elif isinstance(a, reading.ChoiceAnswer):
            assert a.choice == want["choice"]
            assert dict(a.probabilities) == pytest.approx(want["probabilities"], abs=1e-5)
            assert a.confidence == pytest.approx(want["confidence"], abs=1e-5)
        else:
            assert a.score == pytest.approx(want["score"], abs=1e-5)
            assert a.probabilities == pytest.approx([want["probabilities"][str(i)] for i in range(len(a.probabilities))], abs=1e-5)
            assert a.confidence == pytest.approx(want["confidence"], abs=1e-5)


@pytest.fixture(scope="module")
def monkeypatch_module():
    """decider.systemone with round() a no-op, for the module's tests."""
    mp = pytest.MonkeyPatch()
    mp.setattr(systemone, "round", lambda x, nd=None: x, raising=False)
    yield mp
    mp.undo()


def test_formulas_by_hand():
    assert reading.choice_confidence([1.0]) == 1.0
    assert reading.choice_confidence([0.5, 0.5]) == 0.0
    assert reading.choice_confidence([0.25, 0.75]) == 0.5
    assert reading.score_confidence([0.0, 1.0, 0.0]) == 1.0
    assert reading.score_confidence([1 / 3] * 3) == pytest.approx(1 - (2 / 3) / (2 / 3))
    assert reading.combine_levels([0.2, 0.6]) == pytest.approx([0.25, 0.75])
    assert reading.combine_levels([0.0, 0.0]) == [0.0, 0.0]  # as the package: no NaN
    assert systemone.combine_isolated([0.0, 0.0])[0] == [0.0, 0.0]
    # an exact tie takes the first option
    got = reading.answer(QuestionPlan("q", "choice", ("a", "b", "c"), 0, 1, False), [[0.2, 0.4, 0.4]])
    assert got.choice == "b" and got.probabilities == (("a", 0.2), ("b", 0.4), ("c", 0.4))


def test_a_probability_that_is_not_finite_is_an_error():
    q = QuestionPlan("q", "noul", ("false", "true"), 0, 1, False)
    with pytest.raises(reading.NonFiniteReading, match="question q: a probability is not a finite number"):
        reading.answer(q, [reading.label_probabilities([float("nan"), 0.0], 1.0)])
    assert math.isclose(reading.answer(q, [reading.label_probabilities([0.0, 0.0], 1.0)]).noul, 0.5)


# ---------------------------------------------------------------------------------------------
# Refusals


def choice(n, instructions="pick"):
    q = {"type": "choice", "criteria": {f"o{i}": None for i in range(n)}}
    if instructions is not ...:
        q["instructions"] = instructions
    return q


@pytest.mark.parametrize(
    "questions, refusal",
    [
        ({}, Refusal(f"{PREFIX}questions must hold 1 to 64 questions, got 0", "questions")),
        ({f"q{i}": choice(2) for i in range(65)}, Refusal(f"{PREFIX}questions must hold 1 to 64 questions, got 65", "questions")),
        ({"a": choice(2), "b": choice(1)}, Refusal(f"{PREFIX}a choice question takes 2 to 40 options, got 1", "questions.b.criteria")),
        ({"b": choice(41)}, Refusal(f"{PREFIX}a choice question takes 2 to 40 options, got 41", "questions.b.criteria")),
        ({"s": {"type": "score", "instructions": "x", "criteria": ["a"]}},
         Refusal(f"{PREFIX}a score question takes 2 to 10 levels, got 1", "questions.s.criteria")),
        ({"s": {"type": "score", "instructions": "x", "criteria": list("abcdefghijk")}},
         Refusal(f"{PREFIX}a score question takes 2 to 10 levels, got 11", "questions.s.criteria")),
        ({"c": choice(3, None)}, Refusal(f'{PREFIX}instructions are required on a choice question and may not be null or ""', "questions.c.instructions")),
        ({"c": choice(3, "")}, Refusal(f'{PREFIX}instructions are required on a choice question and may not be null or ""', "questions.c.instructions")),
        ({"c": choice(3, ...)}, Refusal(f'{PREFIX}instructions are required on a choice question and may not be null or ""', "questions.c.instructions")),
        ({"s": {"type": "score", "criteria": ["a", "b"]}},
         Refusal(f'{PREFIX}instructions are required on a score question and may not be null or ""', "questions.s.instructions")),
        ({"n": {"type": "noul"}}, Refusal(f"{PREFIX}a noul question without instructions needs criteria describing true or false", "questions.n.criteria")),
        ({"n": {"type": "noul", "instructions": None, "criteria": None}},
         Refusal(f"{PREFIX}a noul question without instructions needs criteria describing true or false", "questions.n.criteria")),
        ({"n": {"type": "noul", "instructions": "", "criteria": {"true": "", "false": None}}},
         Refusal(f"{PREFIX}a noul question without instructions needs criteria describing true or false", "questions.n.criteria")),
    ],
)
def test_the_four_decider_refusals(make_decider, questions, refusal):
    decider = make_decider(max_options=40)
    assert limits.check_questions(questions, 40) == refusal
    assert plan_request(decider, "s", questions, 1 << 20) == refusal


def test_what_the_decider_limits_accept(make_decider):
    decider = make_decider(max_options=40)
    ok = {"a": choice(40), "s": {"type": "score", "instructions": {"k": 1}, "criteria": list("abcdefghij")},
          "n": {"type": "noul", "criteria": {"false": "calm"}}, "m": {"type": "noul", "instructions": 0}}
    assert isinstance(plan_request(decider, "s", {**ok, **{f"x{i}": choice(2) for i in range(60)}}, 1 << 20), DeciderPrompts)


def test_the_state_cap_names_both_counts(make_decider, qwen35_tokenizer):
    decider = make_decider(max_state_tokens=12)
    q = {"q": choice(2)}
    fits = "one two three four five six seven eight nine"  # 3 + 9 tokens
    assert len(qwen35_tokenizer.encode("Context:\n" + fits, add_special_tokens=False)) == 12
    assert isinstance(plan_request(decider, fits, q, 1 << 20), DeciderPrompts)
    assert plan_request(decider, fits + " ten", q, 1 << 20) == Refusal(
        'the state is 13 tokens with its "Context:" line, and this decider reads at most 12 (max_state_tokens)', "state"
    )
    # an object state counts as its JSON, _index included
    got = plan_request(decider, {"k": list(range(8))}, q, 1 << 20)
    assert isinstance(got, Refusal) and got.param == "state" and got.message.startswith("the state is ")


def test_a_state_too_long_even_at_the_longest_token_is_refused_before_tokenizing(make_decider):
    decider = make_decider(max_state_tokens=100)
    calls = []
    counting = attrs.evolve(decider, encode=lambda s: calls.append(s) or decider.encode(s))
    text = "x" * (100 * 128)  # with "Context:\n", 12809 bytes: at least 101 tokens of 128 bytes
    assert plan_request(counting, text, {"q": choice(2)}, 1 << 20) == Refusal(
        'the state is at least 101 tokens with its "Context:" line, and this decider reads at most 100 (max_state_tokens)',
        "state",
    )
    assert calls == []
    # one byte shorter passes the pre-check and is counted exactly
    got = plan_request(counting, "x" * (100 * 128 - 10), {"q": choice(2)}, 1 << 20)
    assert calls and got.message.startswith("the state is ") and "at least" not in got.message


@settings(max_examples=60, deadline=None)
@given(text=st.text(st.characters(codec="utf-8", exclude_categories=("Cs", "Mn", "Mc", "Me")), max_size=300))
def test_the_pre_check_is_a_lower_bound(deciders, text):
    d = deciders[False]
    assert limits.state_lower_bound(text, d.longest_token_bytes) <= len(d.encode("Context:\n" + text))


def test_every_prompt_leaves_room_for_the_read_step(deciders):
    d = deciders[False]
    q = {"a": choice(2), "b": {"type": "noul", "instructions": "Is this a much longer question than the other one?"}}
    built = plan_request(d, "s", q, 1 << 20)
    longest = max(len(built.prompt(i)) for i in range(2))
    assert isinstance(plan_request(d, "s", q, longest + 1), DeciderPrompts)
    assert plan_request(d, "s", q, longest) == Refusal(
        f"the prompt of question b is {longest} tokens and the context holds {longest}; that leaves no room for the read step",
        "questions.b", "context_length_exceeded",
    )
    iso = deciders[True]
    s = {"s": {"type": "score", "instructions": "rate", "criteria": ["low", "a rather long description of the top level"]}}
    built = plan_request(iso, "s", s, 1 << 20)
    n = len(built.prompt(1))
    assert plan_request(iso, "s", s, n) == Refusal(
        f"the prompt of level 1 of question s is {n} tokens and the context holds {n}; that leaves no room for the read step",
        "questions.s", "context_length_exceeded",
    )


def test_all_prompts_together_at_most_64_contexts(deciders):
    iso = deciders[True]
    q = {f"s{i}": {"type": "score", "instructions": "rate", "criteria": [f"level {j}" for j in range(10)]} for i in range(7)}
    built = plan_request(iso, "a state", q, 1 << 20)
    total = built.whole_tokens()
    longest = max(len(built.prompt(i)) for i in range(len(built.rows)))
    context = -(-total // 64)  # the smallest context that holds them all
    assert context > longest
    assert isinstance(plan_request(iso, "a state", q, context), DeciderPrompts)
    assert plan_request(iso, "a state", q, context - 1) == Refusal(
        f"the prompts of this request are {total} tokens together, and at most 64 times the context "
        f"({64 * (context - 1)}) are read for one request",
        "questions",
    )
