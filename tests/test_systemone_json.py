"""/v1/systemone's JSON (caldrix/systemone/jsonlex.py) against the standard json module, by
property tests, and the answer maths against http-api.md's example. No model, no server."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from caldrix.systemone import jsonlex
from caldrix.systemone.jsonlex import Number
from caldrix.systemone.reading import answer, choice_confidence, expected_level, score_confidence
from caldrix.systemone.request import Option, Question

# JSON number text as a writer could spell it: any sign, leading digits, fraction, exponent.
number_text = st.builds(
    lambda sign, whole, frac, exp: sign + whole + frac + exp,
    st.sampled_from(["", "-"]),
    st.one_of(st.just("0"), st.from_regex(r"[1-9][0-9]{0,30}", fullmatch=True)),
    st.one_of(st.just(""), st.from_regex(r"\.[0-9]{1,20}", fullmatch=True)),
    st.one_of(st.just(""), st.from_regex(r"[eE][+-]?[0-9]{1,3}", fullmatch=True)),
)
scalars = st.one_of(st.none(), st.booleans(), st.text(max_size=8), st.integers(), st.floats(allow_nan=False,
                                                                                             allow_infinity=False))
documents = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                           st.dictionaries(st.text(max_size=4), inner, max_size=4)),
                         max_leaves=20)


def spellings(value) -> st.SearchStrategy[str]:
    """JSON text of `value`, spaced or compact."""
    return st.sampled_from([json.dumps(value), json.dumps(value, separators=(",", ":")),
                            json.dumps(value, indent=1, ensure_ascii=False)])


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_same_values_as_the_standard_module(data):
    doc = data.draw(documents)
    text = data.draw(spellings(doc))
    got = jsonlex.loads(text)
    assert jsonlex.plain(got) == json.loads(text)
    # Keys in the order received.
    if isinstance(doc, dict):
        assert list(got) == list(json.loads(text))


@settings(max_examples=300, deadline=None)
@given(number_text)
def test_a_number_keeps_its_lexeme(lexeme):
    got = jsonlex.loads(f'{{"a": [{lexeme}]}}')
    assert got == {"a": [Number(lexeme)]}
    if any(c in lexeme for c in ".eE"):
        assert got["a"][0].value() == json.loads(lexeme)
    else:
        assert got["a"][0].value() == int(lexeme)


@settings(max_examples=300, deadline=None)
@given(number_text)
def test_the_canonical_number(lexeme):
    if not any(c in lexeme for c in ".eE"):
        assert jsonlex.canonical_number(lexeme) == str(int(lexeme))  # exact, at any size
        return
    x = float(lexeme)
    if not math.isfinite(x):
        with pytest.raises(jsonlex.NumberRange):
            jsonlex.canonical_number(lexeme)
        return
    out = jsonlex.canonical_number(lexeme)
    assert float(out) == x and math.copysign(1, float(out)) == math.copysign(1, x)  # reads back the same
    mantissa, _, exp = out.partition("e")
    assert "." in out or "e" in out  # a whole number keeps its fraction
    e10 = int(f"{x:e}".split("e")[1]) if x else 0
    if -4 <= e10 <= 15:
        assert not exp and "." in mantissa
    else:
        assert exp[0] in "+-" and len(exp) >= 3  # a signed exponent of at least two digits
    # The shortest: no decimal with fewer significant digits reads back to x.
    digits = len(mantissa.lstrip("-").replace(".", "").strip("0")) or 1
    if digits > 1:
        assert float(f"{x:.{digits - 2}e}") != x


@pytest.mark.parametrize(("lexeme", "canonical"), [
    ("0.00001", "1e-05"), ("1e16", "1e+16"), ("1e15", "1000000000000000.0"), ("2.0", "2.0"), ("2E0", "2.0"),
    ("1.50", "1.5"), ("0.0001", "0.0001"), ("123456789012345678901234567890", "123456789012345678901234567890"),
    ("-0", "0"), ("-0.0", "-0.0"), ("1e-5", "1e-05"), ("12345678.9e-3", "12345.6789"),
])
def test_canonical_examples(lexeme, canonical):
    assert jsonlex.canonical_number(lexeme) == canonical


@settings(max_examples=300, deadline=None)
@given(documents)
def test_compact_is_the_standard_compact_form(doc):
    # Python writes a float as the shortest round-trip repr, which is the canonical form, so on
    # text the standard module wrote, compact must give what it gives with no spaces.
    text = jsonlex.compact(jsonlex.loads(json.dumps(doc)))
    assert text == json.dumps(doc, separators=(",", ":"), ensure_ascii=False)
    assert json.loads(text) == doc


def test_compact_writes_canonical_numbers_in_order():
    doc = jsonlex.loads('{"b": 1.50, "a": [1E2, 0.00001, 123456789012345678901234567890, -0], "c": {"x": "é"}}')
    assert jsonlex.compact(doc) == '{"b":1.5,"a":[100.0,1e-05,123456789012345678901234567890,0],"c":{"x":"é"}}'


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_duplicates_are_found_with_their_path(data):
    doc = data.draw(st.dictionaries(st.text(alphabet="abc", min_size=1, max_size=2), scalars, min_size=1,
                                    max_size=4))
    key = data.draw(st.sampled_from(sorted(doc)))
    inner = json.dumps(doc)[:-1] + f", {json.dumps(key)}: 1}}"
    text = f'{{"questions": {{"q": [0, {inner}]}}}}'
    # The standard module takes the last value; this parser refuses and names the path.
    json.loads(text)
    with pytest.raises(jsonlex.DuplicateKey) as err:
        jsonlex.loads(text)
    assert err.value.path == f"questions.q[1].{key}" and err.value.key == key


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet='{}[]",:0123456789.eE+-truefalsn \\u', max_size=20))
def test_same_errors_class_as_the_standard_module(text):
    try:
        want = json.loads(text)
    except json.JSONDecodeError:
        with pytest.raises(json.JSONDecodeError):
            jsonlex.loads(text)
        return
    except (ValueError, RecursionError):
        assume(False)
    try:
        got = jsonlex.loads(text)
    except jsonlex.DuplicateKey:
        assert _has_duplicate(text)
        return
    except ValueError:  # an unpaired surrogate: refused here, taken by the standard module
        assert any(0xD800 <= ord(c) <= 0xDFFF for c in json.dumps(want, ensure_ascii=False))
        return
    assert jsonlex.plain(got) == want


def _has_duplicate(text: str) -> bool:
    found = []

    def hook(pairs):
        if len({k for k, _ in pairs}) != len(pairs):
            found.append(True)
        return dict(pairs)

    json.loads(text, object_pairs_hook=hook)
    return bool(found)


def test_nan_and_infinity_are_refused():
    for text in ("NaN", "[Infinity]", '{"a": -Infinity}'):
        json.loads(text)
        with pytest.raises(ValueError):
            jsonlex.loads(text)


def test_echo_keeps_the_request_digits():
    import orjson

    level = jsonlex.loads('{"min": 1.50, "eps": 1e-05, "n": 123456789012345678901234567890}')
    assert orjson.dumps(jsonlex.echo(level)) == b'{"min":1.50,"eps":1e-05,"n":123456789012345678901234567890}'


# --- the answer maths against http-api.md's example ---------------------------------------------


def test_the_spec_example_numbers():
    choice = [0.9976708292961121, 0.0021615091245621443, 0.00016766643966548145]
    assert choice_confidence(choice) == 0.9965062439441681
    score = [0.9140376448631287, 0.06223498284816742, 0.023727400228381157]
    assert expected_level(score) == 0.10968978330492973
    assert score_confidence(score) == 0.8354653250426054
    q = Question("urgency", "score", "questions.urgency", "How urgent is the message?", True,
                 tuple(Option(str(i), t) for i, t in enumerate(["not urgent", "somewhat urgent", "very urgent"])))
    assert answer(q, score, jsonlex.echo) == {
        "type": "score", "score": 0.10968978330492973,
        "legend": {"0": "not urgent", "1": "somewhat urgent", "2": "very urgent"},
        "probabilities": {"0": 0.9140376448631287, "1": 0.06223498284816742, "2": 0.023727400228381157},
        "confidence": 0.8354653250426054}


def test_ties_take_the_first_and_one_option_is_certain():
    q = Question("t", "choice", "questions.t", None, False, (Option("x", None), Option("y", None)))
    assert answer(q, [0.5, 0.5], jsonlex.echo)["choice"] == "x"
    assert choice_confidence([0.5, 0.5]) == 0.0
    assert choice_confidence([1.0]) == 1.0 and score_confidence([1.0]) == 1.0
    assert score_confidence([0.5, 0.0, 0.5]) == 0.0  # clipped at 0
    assert score_confidence([0.0, 1.0, 0.0]) == 1.0


@settings(max_examples=30, deadline=None)
@given(depth=st.integers(100, 1500), leaf=st.sampled_from(['1.50', '"\\ud83d\\ude00"', '{"n": 2e5}']))
def test_a_state_nested_past_the_bound_is_the_nesting_400(depth, leaf):
    """/v1/systemone's parser keeps routes/strictjson.py's bound: the state's levels up to
    MAX_NESTING are read (and written back by compact, a recursive walk), one more is a 400."""
    from caldrix.routes.errors import ApiError
    from caldrix.routes.strictjson import MAX_NESTING, TOO_DEEP
    from caldrix.systemone.request import parse_body

    raw = '{"model": "m", "state": ' + "[" * depth + leaf + "]" * depth + "}"
    levels = 1 + depth + leaf.startswith("{")
    if levels <= MAX_NESTING:
        state = parse_body(raw.encode())["state"]
        assert json.loads(jsonlex.compact(state)) == json.loads(raw)["state"]
    else:
        with pytest.raises(ApiError) as e:
            parse_body(raw.encode())
        assert (e.value.status, e.value.message, e.value.param) == (400, TOO_DEEP, None)
