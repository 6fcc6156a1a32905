"""The OpenAPI document against the validator it is generated beside (no server needed).

- The fields the validator reads, recorded while it parses a body that sets every field, are
  exactly the document's properties, per endpoint and inside messages.
- Property: any body the validator accepts is valid against the document's schema, so the
  document never forbids what the server takes (a field's limit in the validator but not in the
  document, or a stricter document, fails here).
"""

from __future__ import annotations

import json

import jsonschema_rs
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from caldrix.protocol import SamplingParams
from caldrix.routes import openapi
from caldrix.routes.errors import ApiError
from caldrix.routes.fields import CHAT, COMPLETION, NOT_IMPLEMENTED
from caldrix.routes.schemas import ModelLimits, parse_chat, parse_completion

CTX = ModelLimits(served_name="m", vocab_size=100, context=64, has_chat_template=True)
DOC = openapi.document(CTX)


class Recorder(dict):
    """A dict that remembers which keys were read."""

    def __init__(self, *a, reads: set[str], **kw) -> None:
        super().__init__(*a, **kw)
        self.reads = reads

    def get(self, key, default=None):
        self.reads.add(key)
        return super().get(key, default)

    def __getitem__(self, key):
        self.reads.add(key)
        return super().__getitem__(key)

    def __contains__(self, key):
        self.reads.add(key)
        return super().__contains__(key)


def _schema(path: str) -> dict:
    return DOC["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]


def _validator(path: str):
    return jsonschema_rs.Draft202012Validator(_schema(path))


FULL = {  # every field at an accepted, non-null value where it has one
    "model": "m", "max_tokens": 4, "max_completion_tokens": 4, "stop": ["x"], "stream": True,
    "stream_options": {"include_usage": True}, "ignore_eos": False, "return_token_ids": True,
    "user": "u", "temperature": 0.5, "top_k": 3, "top_p": 0.9, "min_p": 0.1, "repetition_penalty": 1.1,
    "seed": 7, **{f.name: f.neutral[0] for f in NOT_IMPLEMENTED},
}


def test_document_shape():
    assert DOC["openapi"] == "3.1.0"
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/models", "/healthz", "/health", "/metrics",
                 "/debug/requests", "/debug/trace", "/openapi.json"):
        assert path in DOC["paths"], path
    post = DOC["paths"]["/v1/completions"]["post"]
    assert set(post["responses"]) == {"200", "400", "413", "429", "500", "503"}
    assert "Retry-After" in post["responses"]["429"]["headers"]
    assert json.loads(json.dumps(DOC)) == DOC  # plain JSON


@pytest.mark.parametrize("path,parse,extra,fields", [
    ("/v1/completions", parse_completion, {"prompt": "hi", "messages": None}, COMPLETION),
    ("/v1/chat/completions", parse_chat,
     {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}], "prompt": None}, CHAT),
])
def test_fields_read_are_the_documented_ones(path, parse, extra, fields):
    reads: set[str] = set()
    nested: set[str] = set()
    body = {**FULL, **extra}
    if "messages" in extra and extra["messages"]:
        body["messages"] = [Recorder({**m, "content": [Recorder(p, reads=nested) for p in m["content"]]},
                                     reads=nested) for m in extra["messages"]]
    parse(Recorder(body, reads=reads), CTX, SamplingParams())
    props = set(_schema(path)["properties"])
    assert reads == props, (sorted(reads - props), sorted(props - reads))
    assert {f.name for f in fields} == props
    if path == "/v1/chat/completions":
        msg = _schema(path)["properties"]["messages"]["items"]
        part = msg["properties"]["content"]["anyOf"][1]["items"]
        assert nested == set(msg["properties"]) | set(part["properties"])
    assert _validator(path).is_valid(json.loads(json.dumps({**FULL, **extra})))


_NAMES = sorted({f.name for f in COMPLETION} | {f.name for f in CHAT})
_scalar = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 3), st.integers(), st.floats(allow_nan=False),
    st.sampled_from(["", "m", "x", "none", "text", "<image>", "é" * 129, "user", "tool"]),
)
_value = st.recursive(_scalar, lambda inner: st.one_of(
    st.lists(inner, max_size=5),
    st.dictionaries(st.sampled_from(["type", "text", "role", "content", "include_usage", "x"]), inner, max_size=3),
), max_leaves=8)
_message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "developer", "assistant", "tool", 1]),
                                  "content": st.one_of(st.text(max_size=5), _value)})


# Values at and just past each field's limits, so accepted bodies are common and the limits meet
# the document from both sides.
_EDGES: dict[str, list] = {
    "max_tokens": [1, 0, 10**30, -1, 1.0], "max_completion_tokens": [1, 0, 7, 2.5],
    "stop": [[], ["a"] * 4, ["a"] * 5, "é" * 128, "é" * 129, "x" * 256, "x" * 257, [""], "", [1]],
    "stream": [True, False, 0, "true"], "ignore_eos": [True, 1], "return_token_ids": [False, "no"],
    "stream_options": [{"include_usage": True}, {}, {"include_usage": 1}, {"x": True}, []],
    "user": ["u", 3], "temperature": [0, 0.0, 2, -1e-9, 1e308, 10**400, "1"],
    "top_k": [-1, 0, 5, -2, 1.5], "top_p": [1, 1e-9, 0, 1.0000001, True], "min_p": [0, 1, -0.1, 1.1],
    "repetition_penalty": [1e-9, 0, -1, 3], "seed": [-1, 0, 2**64 - 1, 2**64, -2, 1.0],
    "n": [1, 1.0, 2, True], "presence_penalty": [0, 0.0, 0.5], "frequency_penalty": [0, -0.1],
    "top_logprobs": [0, 1], "best_of": [1, 2], "logprobs": [False, 0, True, 1],
    "logit_bias": [{}, {"1": 2}], "tools": [[], [{}]], "tool_choice": ["none", "auto"],
    "response_format": [{"type": "text"}, {"type": "json_object"}, {"type": "text", "x": 1}],
    "prompt": ["hi", "", [1, 99], [100], [-1], [["a"]], ["a"], ["a", "b"], [[1, 2]], [[]], [True], []],
    "messages": [[{"role": "user", "content": "hi"}], [], [{"role": "tool", "content": "x"}],
                 [{"role": "developer", "content": [{"type": "text", "text": "a"}]}],
                 [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
                 [{"role": "user", "content": "<image>"}], [{"role": "user"}], [{"role": "user", "content": None}],
                 [{"role": "user", "content": "x"}] * 256, [{"role": "user", "content": "x"}] * 257],
}


_VALID: dict[str, list] = {  # accepted values, at the limits where a field has them
    "max_tokens": [1, 10**30], "max_completion_tokens": [1], "stop": [[], ["a"] * 4, "é" * 128, "x" * 256],
    "stream": [True, False], "ignore_eos": [True], "return_token_ids": [False, True], "user": ["u"],
    "temperature": [0, 1e308], "top_k": [-1, 0, 5], "top_p": [1, 1e-9], "min_p": [0, 1],
    "repetition_penalty": [1e-9, 3], "seed": [-1, 0, 2**64 - 1], "n": [1, 1.0], "presence_penalty": [0.0],
    "frequency_penalty": [0], "top_logprobs": [0], "best_of": [1], "logprobs": [False, 0], "logit_bias": [{}],
    "tools": [[]], "tool_choice": ["none"], "response_format": [{"type": "text"}],
    "prompt": ["hi", [1, 99], ["a"], [[1, 2]]],
    "messages": [[{"role": "user", "content": "hi"}], [{"role": "user", "content": "x"}] * 256,
                 [{"role": "developer", "content": [{"type": "text", "text": "a"}]}]],
}


@st.composite
def _bodies(draw):
    """Mostly bodies one value away from accepted: each field takes an accepted value four times
    in five, else a value at or past its limit, null, or arbitrary JSON."""
    def value(name):
        if name in _VALID and draw(st.integers(0, 4)):
            return draw(st.sampled_from(_VALID[name]))
        return draw(st.one_of(st.sampled_from(_EDGES.get(name, [None])), st.none(), _value))

    body = {"model": draw(st.sampled_from(["m"] * 8 + ["other", 1]))}
    for name in draw(st.lists(st.sampled_from(_NAMES), max_size=5, unique=True)):
        body[name] = value(name)
    if "stream_options" in body and body["stream_options"] is not None and draw(st.booleans()):
        body["stream"] = True
    for name in ("prompt", "messages"):
        if draw(st.booleans()):
            body[name] = value(name)
    return body


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_bodies())
def test_accepted_bodies_are_valid_against_the_document(body):
    for path, parse in (("/v1/completions", parse_completion), ("/v1/chat/completions", parse_chat)):
        try:
            parse(json.loads(json.dumps(body)), CTX, SamplingParams())
        except ApiError as e:
            assert e.status == 400
            continue
        errors = [str(e) for e in _validator(path).iter_errors(body)]
        assert not errors, (path, errors)


# --- POST /v1/systemone ----------------------------------------------------------------------------

from caldrix.systemone.request import NOUL_KEYS, QUESTION_FIELDS, TOP_FIELDS, Limits, parse_body, parse_request  # noqa: E402


def test_systemone_documents_exactly_the_fields_its_validator_reads():
    schema = _schema("/v1/systemone")
    assert set(schema["properties"]) == set(TOP_FIELDS) and schema["additionalProperties"] is False
    kinds = schema["properties"]["questions"]["additionalProperties"]["oneOf"]
    assert {k["properties"]["type"]["const"] for k in kinds} == {"choice", "score", "noul"}  # never "box"
    for k in kinds:
        assert set(k["properties"]) == set(QUESTION_FIELDS) and k["additionalProperties"] is False
    noul = next(k for k in kinds if k["properties"]["type"]["const"] == "noul")
    assert set(noul["properties"]["criteria"]["anyOf"][1]["properties"]) == set(NOUL_KEYS)
    post = DOC["paths"]["/v1/systemone"]["post"]
    assert set(post["responses"]) == {"200", "400", "413", "429", "500", "503"}


_so_value = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-10**30, 10**30), st.floats(allow_nan=False, allow_infinity=False),
              st.text(max_size=4)),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=3), inner, max_size=3)),
    max_leaves=6)
_so_text = st.one_of(st.text(max_size=4), st.lists(_so_value, max_size=2), st.dictionaries(st.text(max_size=3), _so_value, max_size=2))
_so_text_or_null = st.one_of(st.none(), _so_text)
# Mostly well-formed questions (so the validator accepts many bodies), with room for every
# refusal: out-of-range counts, wrong types, unknown and refused fields.
_so_question = st.one_of(
    st.fixed_dictionaries({"type": st.just("choice"), "criteria": st.dictionaries(
        st.text(min_size=1, max_size=3), _so_text_or_null, min_size=0, max_size=28)},
        optional={"instructions": _so_text_or_null}),
    st.fixed_dictionaries({"type": st.just("score"), "criteria": st.lists(_so_text, min_size=0, max_size=28)},
                          optional={"instructions": _so_text_or_null}),
    st.fixed_dictionaries({"type": st.just("noul")}, optional={
        "instructions": _so_text_or_null,
        "criteria": st.one_of(st.none(), st.fixed_dictionaries({}, optional={"true": _so_text_or_null,
                                                                             "false": _so_text_or_null}), _so_value)}),
    st.fixed_dictionaries({"type": st.sampled_from(["choice", "score", "noul", "box", "x", 1])},
                          optional={"instructions": _so_value, "criteria": _so_value, "extra": _so_value}),
)
def _with_extra(body: dict, extra: str | None, value) -> dict:
    return {**body, extra: value} if extra else body


_so_body = st.builds(
    _with_extra,
    st.fixed_dictionaries(
        {"model": st.sampled_from(["m", "m", "m", "other"]), "state": st.one_of(_so_text, _so_text, _so_value),
         "questions": st.one_of(
             *[st.dictionaries(st.text(min_size=1, max_size=3), _so_question, min_size=1, max_size=5)] * 4,
             st.dictionaries(st.text(min_size=1, max_size=3), _so_question, min_size=60, max_size=70),
             _so_value)}),
    st.sampled_from([None] * 8 + ["assets", "images", "chat_template_kwargs", "x"]),
    _so_value)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=_so_body)
def test_systemone_bodies_it_accepts_are_valid_against_the_document(body):
    """The validator (systemone/request.py) and the document agree on every body the validator
    takes; one it refuses may still pass the schema (duplicate keys, context, labels)."""
    raw = json.dumps(body).encode()
    try:
        parse_request(parse_body(raw), "m", Limits())
    except ApiError:
        return
    assert jsonschema_rs.Draft202012Validator(_schema("/v1/systemone")).is_valid(json.loads(raw)), body


# --- image parts on a vision server ---------------------------------------------------------------

def _png(side: int = 8) -> str:
    import base64
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (side, side), (200, 30, 30)).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


@pytest.mark.parametrize("detail", [None, "auto", "high", "low"])
def test_a_vision_servers_document_takes_the_image_parts_its_validator_takes(detail):
    vision = ModelLimits(served_name="m", vocab_size=100, context=64, has_chat_template=True, has_vision=True)
    image = {"url": _png(), **({"detail": detail} if detail is not None else {})}
    body = {"model": "m", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": image}, {"type": "text", "text": "what is this?"}]}]}
    parse_chat(body, vision, SamplingParams())  # accepted: no ApiError
    schema = openapi.document(vision)["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]
    assert jsonschema_rs.Draft202012Validator(schema["application/json"]["schema"]).is_valid(body)
    # A text model refuses the part, and its document forbids it.
    with pytest.raises(ApiError, match="this model takes text only"):
        parse_chat(body, CTX, SamplingParams())
    assert not _validator("/v1/chat/completions").is_valid(body)
    # A detail the validator refuses is outside the document too.
    bad = json.loads(json.dumps(body))
    bad["messages"][0]["content"][0]["image_url"]["detail"] = "medium"
    with pytest.raises(ApiError, match="detail must be auto, high or low"):
        parse_chat(bad, vision, SamplingParams())
    assert not jsonschema_rs.Draft202012Validator(schema["application/json"]["schema"]).is_valid(bad)
