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


@st.composite
def _bodies(draw):
    body = {"model": draw(st.sampled_from(["m", "m", "other", 1]))}
    for name in draw(st.lists(st.sampled_from(_NAMES), max_size=6, unique=True)):
        body[name] = draw(_value)
    if draw(st.booleans()):
        body["prompt"] = draw(st.one_of(st.text(max_size=3), st.lists(st.integers(-2, 101), max_size=3),
                                        st.lists(st.lists(st.integers(0, 120), max_size=2), max_size=2)))
    if draw(st.booleans()):
        body["messages"] = draw(st.lists(_message, max_size=3))
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
