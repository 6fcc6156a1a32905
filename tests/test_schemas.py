"""Request validation against http-api.md: every refusal's status and param, and the records.

Pure: no server, no tokenizer. Each refusal is checked by status, param and (where the spec
words it) message.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from caldrix.protocol import SamplingParams
from caldrix.routes.errors import ApiError
from caldrix.routes.schemas import (
    NO_CHAT_TEMPLATE,
    ChatMessage,
    ChatRequest,
    CompletionRequest,
    ModelLimits,
    parse_body,
    parse_chat,
    parse_completion,
    reply_budget,
)

CTX = ModelLimits(served_name="Qwen/Qwen3-0.6B", vocab_size=1000, context=64, has_chat_template=True)
GREEDY = SamplingParams()
USER_HI = [{"role": "user", "content": "hi"}]


def chat(defaults: SamplingParams = GREEDY, ctx: ModelLimits = CTX, **fields) -> ChatRequest:
    body = {"model": ctx.served_name, "messages": USER_HI, **fields}
    return parse_chat(body, ctx, defaults)


def completion(defaults: SamplingParams = GREEDY, **fields) -> CompletionRequest:
    body = {"model": CTX.served_name, "prompt": "The capital of France is", **fields}
    return parse_completion(body, CTX, defaults)


def refusal(call, *args, **kwargs) -> ApiError:
    with pytest.raises(ApiError) as info:
        call(*args, **kwargs)
    return info.value


def both(**fields) -> list[ApiError]:
    """The refusal of the same fields on both endpoints."""
    return [refusal(chat, **fields), refusal(completion, **fields)]


# --- errors -----------------------------------------------------------------------------------


def test_error_body_has_the_openai_shape():
    e = ApiError(400, "must be 0 < p <= 1, got 2", "top_p")
    assert e.body() == {
        "error": {
            "message": "must be 0 < p <= 1, got 2",
            "type": "invalid_request_error",
            "param": "top_p",
            "code": None,
        }
    }


@pytest.mark.parametrize(
    "status, kind",
    [(400, "invalid_request_error"), (413, "invalid_request_error"), (429, "rate_limit_error"),
     (500, "server_error"), (503, "service_unavailable_error"), (502, "server_error")],
)
def test_error_type_follows_status(status, kind):
    assert ApiError(status, "x").type == kind


def test_spec_worded_errors():
    assert ApiError.queue_full().status == 429
    assert ApiError.queue_full().message == "the request queue is full"
    assert ApiError.image_queue_full().message == "the image decode queue is full"
    assert ApiError.engine_unavailable().status == 503
    assert ApiError.body_too_large(4 << 20).status == 413
    assert "4 MiB" in ApiError.body_too_large(4 << 20).message
    assert ApiError(400, "x", type="custom", code="c").body()["error"]["code"] == "c"


# --- the body ---------------------------------------------------------------------------------


def test_parse_body_reads_an_object():
    assert parse_body(b'{"model": "m", "n": null}') == {"model": "m", "n": None}


@pytest.mark.parametrize(
    "raw, needle",
    [
        (b"", "empty"),
        (b"   ", "empty"),
        (b'{"model": ', "not valid JSON"),
        (b'{"a": 1} x', "not valid JSON"),
        (b'{"a": NaN}', "not valid JSON"),
        (b'{"a": Infinity}', "not valid JSON"),
        (b'{"a": "\xff"}', "not UTF-8"),
        (b"[1, 2]", "must be a JSON object, got array"),
        (b'"text"', "must be a JSON object, got string"),
        (b"null", "must be a JSON object, got null"),
        (b'{"a": "\\ud800"}', "surrogate"),
        (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
    ],
)
def test_parse_body_refuses_what_is_not_a_json_object(raw, needle):
    e = refusal(parse_body, raw)
    assert e.status == 400 and e.param is None
    assert needle in e.message


def nested(depth: int, kinds: str, leaf: bytes) -> bytes:
    """A body whose `metadata` nests `depth` levels below the top object (so the deepest
    container is at level depth + 1), each level an array ("[") or an object ("{") by `kinds`,
    cycled, around `leaf`."""
    opens = [b"[" if kinds[i % len(kinds)] == "[" else b'{"k":' for i in range(depth)]
    closes = [b"]" if o == b"[" else b"}" for o in reversed(opens)]
    return b'{"model":"m","metadata":' + b"".join(opens) + leaf + b"".join(closes) + b"}"


@settings(max_examples=60, deadline=None)
@given(depth=st.integers(1, 1200), kinds=st.sampled_from(["[", "{", "[{", "{["]),
       leaf=st.sampled_from([b"1", b'"x"', b'"\\ud83d\\ude00"', b"[]", b"{}"]))
def test_nesting_past_the_bound_is_a_400_at_any_depth(depth, kinds, leaf):
    """strictjson.MAX_NESTING levels of arrays and objects are read, one more is the nesting 400,
    whatever the depth and whatever the leaf: never a RecursionError (a body 500 deep holding an
    emoji escape was a 500 when the surrogate check walked it recursively)."""
    from caldrix.routes.strictjson import MAX_NESTING, TOO_DEEP

    levels = depth + 1 + (leaf in (b"[]", b"{}"))
    raw = nested(depth, kinds, leaf)
    if levels <= MAX_NESTING:
        assert parse_body(raw)["model"] == "m"
    else:
        e = refusal(parse_body, raw)
        assert (e.status, e.message, e.param) == (400, TOO_DEEP, None)


def test_nesting_is_checked_before_a_deep_duplicate_is_looked_for():
    from caldrix.routes.strictjson import MAX_NESTING, TOO_DEEP

    dup = b'{"a":1,"a":2}'
    assert refusal(parse_body, nested(MAX_NESTING - 2, "[", dup)).param.startswith("metadata[0]")
    assert refusal(parse_body, nested(900, "{", dup)).message == TOO_DEEP


def test_parse_body_keeps_surrogate_pairs_and_big_integers():
    body = parse_body(b'{"s": "\\ud83d\\ude00", "seed": 18446744073709551616}')
    assert body == {"s": "\U0001F600", "seed": 1 << 64}


@pytest.mark.parametrize(
    "raw, param",
    [
        (b'{"model": "a", "model": "b"}', "model"),
        (b'{"messages": [{"role": "user", "role": "system", "content": "x"}]}', "messages[0].role"),
        (b'{"messages": [{"role": "user", "content": "x"}, {"content": [{"type": "text", "text": "a", "text": "b"}]}]}',
         "messages[1].content[0].text"),
        (b'{"stream_options": {"include_usage": true, "include_usage": false}}',
         "stream_options.include_usage"),
        (b'{"a": {"b": [1, [{"c": 1, "c": 2}]]}}', "a.b[1][0].c"),
    ],
)
def test_parse_body_refuses_duplicate_keys_at_any_depth(raw, param):
    e = refusal(parse_body, raw)
    assert e.status == 400
    assert e.param == param
    assert "duplicate key" in e.message and param.rsplit(".", 1)[-1].split("[")[0] in e.message


def test_the_first_duplicate_in_document_order_is_named():
    e = refusal(parse_body, b'{"x": {"k": 1, "k": 2}, "model": 1, "model": 2}')
    assert e.param == "x.k"


# --- model and endpoint fields ----------------------------------------------------------------


def test_a_good_chat_request():
    r = chat(max_tokens=16)
    assert r.model == "Qwen/Qwen3-0.6B"
    assert r.messages == (ChatMessage("user", "hi"),)
    assert r.max_tokens == 16
    assert (r.stop, r.stream, r.include_usage, r.ignore_eos, r.return_token_ids) == ((), False, False, False, False)
    assert r.sampling.is_greedy


def test_a_good_completion_request():
    r = completion(max_tokens=8)
    assert r.prompt == "The capital of France is"
    assert r.max_tokens == 8
    assert completion(max_tokens=None).max_tokens is None


@pytest.mark.parametrize("model", ["qwen3-0.6b", "", "Qwen/Qwen3-0.6B "])
def test_any_other_model_name_is_a_400(model):
    for e in both(model=model):
        assert (e.status, e.param) == (400, "model")
        assert "Qwen/Qwen3-0.6B" in e.message


def test_model_is_required_and_a_string():
    e = refusal(parse_chat, {"messages": USER_HI}, CTX, GREEDY)
    assert (e.status, e.param) == (400, "model")
    for e in both(model=7):
        assert (e.param, e.message) == ("model", "must be a string, got number")


def test_prompt_is_refused_on_chat():
    e = refusal(chat, prompt="hello")
    assert (e.status, e.param) == (400, "prompt")
    assert "prompt is refused" in e.message
    assert chat(prompt=None).messages  # null is as absent


def test_messages_is_refused_on_completions():
    e = refusal(completion, messages=USER_HI)
    assert (e.status, e.param) == (400, "messages")
    assert completion(messages=None).prompt


def test_unnamed_fields_are_accepted_and_ignored():
    r = chat(seed=3, user="alice", metadata={"a": 1}, store=True, service_tier="auto", parallel_tool_calls=False,
             prediction={"type": "content", "content": "x"}, cache_prompt=True, frobnicate=[1])
    assert r.user == "alice"
    # peers' feature fields at their off values: what this server does anyway
    assert completion(echo=False, suffix="", best_of=None, min_tokens=0, skip_special_tokens=True).prompt


def test_user_must_be_a_string():
    for e in both(user=1):
        assert (e.status, e.param) == (400, "user")


# --- not implemented --------------------------------------------------------------------------

NEUTRAL = [
    ("n", 1), ("presence_penalty", 0), ("presence_penalty", 0.0), ("frequency_penalty", 0),
    ("top_logprobs", 0), ("best_of", 1), ("logprobs", False), ("logprobs", 0), ("logit_bias", {}),
    ("tools", []), ("tool_choice", "none"), ("response_format", {"type": "text"}),
]
NOT_NEUTRAL = [
    ("n", 2), ("n", True), ("n", "1"), ("presence_penalty", 0.5), ("frequency_penalty", -1),
    ("top_logprobs", 2), ("best_of", 2), ("logprobs", True), ("logprobs", 3),
    ("logit_bias", {"5": 10}), ("tools", [{"type": "function", "function": {"name": "f"}}]),
    ("tool_choice", "auto"), ("tool_choice", {"type": "function"}),
    ("response_format", {"type": "json_object"}), ("response_format", {"type": "text", "x": 1}),
]
# Fields of OpenAI's, vLLM's and llama-server's requests that would change the reply: refused
# at any other value than their off one, never ignored (routes/fields.py PEER_FEATURES).
PEER_NOT_NEUTRAL = [
    ("echo", True), ("suffix", " the end"), ("functions", [{"name": "f"}]), ("function_call", "auto"),
    ("modalities", ["text", "audio"]), ("audio", {"voice": "alloy", "format": "wav"}),
    ("stop_token_ids", [2]), ("include_stop_str_in_output", True), ("min_tokens", 5),
    ("skip_special_tokens", False), ("use_beam_search", True), ("typical_p", 0.9), ("prompt_logprobs", 1),
    ("guided_regex", "[a-z]+"), ("guided_json", {"type": "object"}), ("add_generation_prompt", False),
    ("continue_final_message", True), ("chat_template", "{{ messages }}"), ("grammar", "root ::= x"),
    ("mirostat", 2), ("repeat_penalty", 1.1), ("min_tokens", True),
    ("n_predict", 4), ("dynatemp_range", 1.0), ("top_n_sigma", 0.01), ("min_keep", 5),
    ("t_max_predict_ms", 100), ("n_keep", -1), ("n_indent", 2), ("lora", [{"id": 0, "scale": 1}]),
    ("return_tokens", True), ("timings_per_token", True), ("post_sampling_probs", True),
    ("response_fields", ["content"]), ("truncate_prompt_tokens", 10), ("return_tokens_as_token_ids", True),
    ("logits_processors", ["x"]), ("max_new_tokens", 20), ("epsilon_cutoff", 3e-4), ("eta_cutoff", 3e-4),
    ("web_search_options", {"search_context_size": "high"}),
]
# ... and accepted at their off value, or null: what llama-server's web page, vLLM's and HF's
# clients send by default.
PEER_NEUTRAL = [
    ("n_predict", -1), ("dynatemp_range", 0.0), ("top_n_sigma", -1), ("min_keep", 0), ("t_max_predict_ms", 0),
    ("n_keep", 0), ("lora", []), ("return_tokens", False), ("timings_per_token", False),
    ("truncate_prompt_tokens", None), ("max_new_tokens", None), ("web_search_options", None), ("echo", False),
    # settings that only tune one that is off
    ("dry_base", 1.75), ("xtc_threshold", 0.1), ("mirostat_tau", 5.0), ("repeat_last_n", 64),
]


@pytest.mark.parametrize("field, value", PEER_NEUTRAL)
def test_peers_feature_fields_pass_at_their_off_value(field, value):
    chat(**{field: value})
    completion(**{field: value})


@pytest.mark.parametrize("field, value", PEER_NOT_NEUTRAL)
def test_peers_feature_fields_that_would_change_the_reply_are_refused_by_name(field, value):
    for e in both(**{field: value}):
        assert (e.status, e.param) == (400, field)
        assert e.message.startswith(f"{field} is not supported by this server; only ")


@pytest.mark.parametrize("field, value", NEUTRAL)
def test_not_implemented_fields_pass_at_their_neutral_value(field, value):
    chat(**{field: value})
    completion(**{field: value})
    chat(**{field: None})


@pytest.mark.parametrize("field, value", NOT_NEUTRAL)
def test_not_implemented_fields_are_refused_by_name(field, value):
    for e in both(**{field: value}):
        assert (e.status, e.param) == (400, field)
        assert e.message.startswith(f"{field} is not supported by this server; only ")


def test_not_implemented_message_names_the_neutral_value():
    assert refusal(chat, n=2).message == "n is not supported by this server; only 1 is accepted"
    assert refusal(chat, logprobs=True).message.endswith("only false or 0 is accepted")
    assert refusal(chat, tool_choice="auto").message.endswith('only "none" is accepted')


# --- messages ---------------------------------------------------------------------------------


def msgs(*messages) -> ChatRequest:
    return chat(messages=list(messages))


def test_roles_and_developer_as_system():
    r = msgs(
        {"role": "developer", "content": "be brief"},
        {"role": "system", "content": "s"},
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a", "name": "bot"},
        {"role": "user", "content": "q2"},
    )
    assert [m.role for m in r.messages] == ["system", "system", "user", "assistant", "user"]
    assert r.messages[0].content == "be brief"


@pytest.mark.parametrize("count", [0, 257])
def test_messages_hold_1_to_256(count):
    e = refusal(chat, messages=[{"role": "user", "content": "x"}] * count)
    assert (e.status, e.param) == (400, "messages")
    assert str(count) in e.message
    assert len(chat(messages=[{"role": "user", "content": "x"}] * 256).messages) == 256


@pytest.mark.parametrize(
    "messages, param",
    [
        (None, "messages"),
        ({"role": "user", "content": "x"}, "messages"),
        ("hi", "messages"),
        (["hi"], "messages[0]"),
        ([{"content": "x"}], "messages[0].role"),
        ([{"role": 1, "content": "x"}], "messages[0].role"),
        ([{"role": "user", "content": "x"}, {"role": "robot", "content": "x"}], "messages[1].role"),
        ([{"role": "tool", "content": "x", "tool_call_id": "1"}], "messages[0].role"),
        ([{"role": "function", "content": "x"}], "messages[0].role"),
        ([{"role": "user"}], "messages[0].content"),
        ([{"role": "assistant", "content": None}], "messages[0].content"),
        ([{"role": "user", "content": 5}], "messages[0].content"),
        ([{"role": "user", "content": {"type": "text", "text": "x"}}], "messages[0].content"),
    ],
)
def test_malformed_messages_name_the_place(messages, param):
    body = {"model": CTX.served_name}
    if messages is not None:
        body["messages"] = messages
    e = refusal(parse_chat, body, CTX, GREEDY)
    assert (e.status, e.param) == (400, param)


def test_text_parts_are_joined_with_a_newline():
    r = msgs({"role": "user", "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]})
    assert r.messages[0].content == "one\ntwo"
    assert msgs({"role": "user", "content": []}).messages[0].content == ""


@pytest.mark.parametrize(
    "part",
    [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo=", "detail": "low"}},
        {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}},
        {"type": "image_url"},
    ],
)
def test_an_image_part_on_a_text_model_is_refused(part):
    content = [{"type": "text", "text": "what is this?"}, part]
    e = refusal(msgs, {"role": "user", "content": "x"}, {"role": "user", "content": content})
    assert (e.status, e.param, e.message) == (400, "messages[1].content[1]", "this model takes text only")


@pytest.mark.parametrize(
    "part",
    [
        "text",
        {"text": "no type"},
        {"type": 3, "text": "x"},
        {"type": "input_audio", "input_audio": {}},
        {"type": "refusal", "refusal": "no"},
        {"type": "text"},
        {"type": "text", "text": 5},
        {"type": "text", "text": None},
    ],
)
def test_a_malformed_or_foreign_part_is_refused_by_place(part):
    e = refusal(msgs, {"role": "user", "content": [{"type": "text", "text": "ok"}, part]})
    assert (e.status, e.param) == (400, "messages[0].content[1]")


def test_typing_the_image_placeholder_is_refused():
    e = refusal(msgs, {"role": "user", "content": "look: <image>"})
    assert (e.status, e.param) == (400, "messages[0].content")
    assert "image placeholder count" in e.message
    e = refusal(msgs, {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "<image><image>"}]})
    assert (e.status, e.param) == (400, "messages[0].content[1]")
    assert "image placeholder count" in e.message
    assert msgs({"role": "user", "content": "<img> and <image > are text"}).messages


def test_a_model_without_a_chat_template_refuses_chat():
    base = ModelLimits(served_name="m", vocab_size=10, context=8, has_chat_template=False)
    e = refusal(parse_chat, {"model": "m", "messages": USER_HI}, base, GREEDY)
    assert (e.status, e.param, e.message) == (400, "messages", NO_CHAT_TEMPLATE)
    assert parse_completion({"model": "m", "prompt": "x"}, base, GREEDY).prompt == "x"


# --- prompt -----------------------------------------------------------------------------------


def test_prompt_of_token_ids():
    assert completion(prompt=[0, 5, 999]).prompt == (0, 5, 999)


def test_a_batch_of_one_is_its_prompt():
    assert completion(prompt=["hello"]).prompt == "hello"
    assert completion(prompt=[[1, 2]]).prompt == (1, 2)


@pytest.mark.parametrize(
    "prompt",
    ["", [], [""], [[]], [1000], [-1], [1, 2.0], [1, True], [1, "a"], ["a", "b"], [[1], [2]], 5,
     {"text": "x"}, True, [[1, -5]]],
)
def test_bad_prompts_are_refused_at_prompt(prompt):
    e = refusal(completion, prompt=prompt)
    assert (e.status, e.param) == (400, "prompt")


def test_prompt_is_required():
    e = refusal(parse_completion, {"model": CTX.served_name}, CTX, GREEDY)
    assert (e.status, e.param) == (400, "prompt")
    e = refusal(completion, prompt=None)
    assert e.param == "prompt"


def test_out_of_vocabulary_id_names_its_place_and_range():
    e = refusal(completion, prompt=[1, 2, 1000])
    assert "prompt[2]" in e.message and "0 to 999" in e.message


def test_reply_budget_caps_and_refuses():
    assert reply_budget(10, None, CTX, "prompt") == 54
    assert reply_budget(10, 8, CTX, "prompt") == 8
    assert reply_budget(10, 500, CTX, "prompt") == 54
    assert reply_budget(63, None, CTX, "messages") == 1
    e = refusal(reply_budget, 64, 1, CTX, "messages")
    assert (e.status, e.param) == (400, "messages")
    assert "64" in e.message


# --- generation options -----------------------------------------------------------------------


def test_max_tokens_and_max_completion_tokens():
    assert chat(max_completion_tokens=5).max_tokens == 5
    assert chat(max_tokens=5, max_completion_tokens=5).max_tokens == 5
    assert chat(max_tokens=5, max_completion_tokens=None).max_tokens == 5
    assert chat().max_tokens is None
    e = refusal(chat, max_tokens=5, max_completion_tokens=6)
    assert (e.status, e.param) == (400, "max_completion_tokens")


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
@pytest.mark.parametrize("value, message", [
    (0, "must be an integer >= 1, got 0"),
    (-3, "must be an integer >= 1, got -3"),
    (True, "must be an integer, got boolean"),
    (1.5, "must be an integer, got number 1.5"),
    (16.0, "must be an integer, got number 16.0"),
    ("16", "must be an integer, got string"),
])
def test_max_tokens_must_be_an_integer_at_least_1(field, value, message):
    for e in both(**{field: value}):
        assert (e.status, e.param, e.message) == (400, field, message)


def test_stop_forms():
    assert chat(stop="\n").stop == ("\n",)
    assert chat(stop=["a", "bb", "c", "d"]).stop == ("a", "bb", "c", "d")
    assert chat(stop=None).stop == ()
    assert chat(stop=[]).stop == ()
    assert completion(stop="x" * 256).stop == ("x" * 256,)


@pytest.mark.parametrize(
    "stop",
    [
        "",
        [""],
        ["a", "b", "c", "d", "e"],
        "x" * 257,
        "é" * 129,  # 258 bytes in 129 characters
        "😀" * 65,  # 260 bytes in 65 characters
        ["ok", "日" * 86],  # 258 bytes
        [1],
        ["a", None],
        5,
        {"a": 1},
        True,
    ],
)
def test_stop_refusals(stop):
    for e in both(stop=stop):
        assert (e.status, e.param) == (400, "stop")


def test_stop_limit_is_bytes_not_characters():
    assert chat(stop="é" * 128).stop == ("é" * 128,)  # 256 bytes
    assert chat(stop=["😀" * 64]).stop == ("😀" * 64,)  # 256 bytes
    e = refusal(chat, stop=["ok", "😀" * 64 + "a"])
    assert "stop[1] is 257 bytes" in e.message


@pytest.mark.parametrize("field", ["stream", "ignore_eos", "return_token_ids"])
def test_flags_are_booleans(field):
    assert getattr(chat(**{field: True}), field) is True
    assert getattr(chat(**{field: None}), field) is False
    for value, kind in [(1, "number"), ("true", "string"), (0, "number")]:
        for e in both(**{field: value}):
            assert (e.status, e.param, e.message) == (400, field, f"must be a boolean, got {kind}")


def test_stream_options():
    assert chat(stream=True, stream_options={"include_usage": True}).include_usage is True
    assert chat(stream=True, stream_options={"include_usage": False}).include_usage is False
    assert chat(stream=True, stream_options={}).include_usage is False
    assert chat(stream=True, stream_options=None).include_usage is False
    assert chat(stream=False, stream_options=None).include_usage is False
    # the off values of OpenAI's and vLLM's other options: what this server sends anyway
    assert chat(stream=True, stream_options={"include_usage": True, "include_obfuscation": False,
                                             "continuous_usage_stats": None}).include_usage is True


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"stream": False, "stream_options": {"include_usage": True}}, "stream_options"),
        ({"stream": True, "stream_options": True}, "stream_options"),
        ({"stream": True, "stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
        ({"stream": True, "stream_options": {"include_usage": True, "x": 1}}, "stream_options.x"),
        ({"stream": True, "stream_options": {"include_obfuscation": True}}, "stream_options.include_obfuscation"),
        ({"stream": True, "stream_options": {"continuous_usage_stats": True}}, "stream_options.continuous_usage_stats"),
        ({"stream": True, "stream_options": {"include_obfuscation": "no"}}, "stream_options.include_obfuscation"),
    ],
)
def test_stream_options_refusals(fields, param):
    for e in both(**fields):
        assert (e.status, e.param) == (400, param)


# --- sampling ---------------------------------------------------------------------------------


def test_spec_example_top_p_2():
    e = refusal(chat, top_p=2)
    assert e.status == 400
    assert e.body() == {
        "error": {"code": None, "message": "must be 0 < p <= 1, got 2", "param": "top_p",
                  "type": "invalid_request_error"}
    }


def test_knobs_override_the_defaults():
    r = chat(temperature=0.7, top_k=40, top_p=0.9, min_p=0.05, repetition_penalty=1.1, seed=7)
    assert r.sampling == SamplingParams(0.7, 40, 0.9, 0.05, 1.1, 7)
    assert isinstance(r.sampling.temperature, float)
    assert r.seeded


def test_absent_or_null_inherits_the_server_defaults():
    server = SamplingParams(temperature=0.8, top_k=50, top_p=0.95, min_p=0.1, repetition_penalty=1.2)
    for r in (chat(defaults=server), chat(defaults=server, temperature=None, top_k=None, top_p=None,
                                          min_p=None, repetition_penalty=None)):
        s = r.sampling
        assert (s.temperature, s.top_k, s.top_p, s.min_p, s.repetition_penalty) == (0.8, 50, 0.95, 0.1, 1.2)


def test_knobs_compose_with_the_defaults():
    # http-api.md: temperature 0 against --repetition-penalty 1.2 keeps the penalty.
    r = chat(defaults=SamplingParams(repetition_penalty=1.2, temperature=1.0), temperature=0)
    assert (r.sampling.temperature, r.sampling.repetition_penalty) == (0.0, 1.2)
    assert r.sampling.is_greedy


@pytest.mark.parametrize("value, kept", [(0, 0), (-1, 0), (1, 1), (200, 200)])
def test_top_k_zero_and_minus_one_keep_every_token(value, kept):
    assert chat(defaults=SamplingParams(top_k=9), top_k=value).sampling.top_k == kept


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("temperature", -0.1, "must be a finite number >= 0, got -0.1"),
        ("temperature", 1e400, "must be a finite number >= 0, got inf"),
        ("temperature", 10 ** 400, None),
        ("temperature", "0.5", "must be a number, got string"),
        ("temperature", True, "must be a number, got boolean"),
        ("temperature", [1], "must be a number, got array"),
        ("top_k", -2, None),
        ("top_k", 2.5, "must be an integer, got number 2.5"),
        ("top_k", 40.0, "must be an integer, got number 40.0"),
        ("top_k", False, "must be an integer, got boolean"),
        ("top_p", 0, "must be 0 < p <= 1, got 0"),
        ("top_p", 1.5, "must be 0 < p <= 1, got 1.5"),
        ("top_p", -0.5, "must be 0 < p <= 1, got -0.5"),
        ("top_p", True, "must be a number, got boolean"),
        ("top_p", {"p": 1}, "must be a number, got object"),
        ("min_p", -0.01, "must be 0 <= p <= 1, got -0.01"),
        ("min_p", 2, "must be 0 <= p <= 1, got 2"),
        ("min_p", False, "must be a number, got boolean"),
        ("repetition_penalty", 0, "must be a finite number > 0, got 0"),
        ("repetition_penalty", -1.2, "must be a finite number > 0, got -1.2"),
        ("repetition_penalty", 1e999, "must be a finite number > 0, got inf"),
        ("repetition_penalty", "1.1", "must be a number, got string"),
        ("seed", -2, None),
        ("seed", 1 << 64, None),
        ("seed", 1.0, "must be an integer, got number 1.0"),
        ("seed", True, "must be an integer, got boolean"),
        ("seed", "42", "must be an integer, got string"),
    ],
)
def test_knob_refusals_name_the_field(field, value, message):
    for e in both(**{field: value}):
        assert (e.status, e.param) == (400, field)
        if message is not None:
            assert e.message == message


def test_booleans_are_never_numbers_even_through_json():
    body = parse_body(json.dumps({"model": CTX.served_name, "prompt": "x", "temperature": True}).encode())
    e = refusal(parse_completion, body, CTX, GREEDY)
    assert (e.param, e.message) == ("temperature", "must be a number, got boolean")


def test_boundary_values_are_accepted():
    r = chat(temperature=0, top_p=1, min_p=1, repetition_penalty=1e-9, seed=0)
    assert (r.sampling.top_p, r.sampling.min_p, r.sampling.seed) == (1.0, 1.0, 0)
    assert chat(min_p=0, top_p=1e-9, seed=(1 << 64) - 1).sampling.seed == (1 << 64) - 1


def test_an_explicit_seed_is_recorded():
    r = chat(seed=1234)
    assert (r.sampling.seed, r.seeded) == (1234, True)


@pytest.mark.parametrize("fields", [{}, {"seed": None}, {"seed": -1}])
def test_no_seed_draws_a_fresh_one_and_records_it(fields):
    seeds = set()
    for _ in range(4):
        r = chat(**fields)
        assert not r.seeded
        assert 0 <= r.sampling.seed < 1 << 63
        seeds.add(r.sampling.seed)
    assert len(seeds) == 4  # fresh entropy each request


def test_server_seed_is_inherited_and_minus_one_still_draws_fresh():
    body = {"model": CTX.served_name, "messages": USER_HI}
    r = parse_chat(body, CTX, GREEDY, default_seed=42)
    assert (r.sampling.seed, r.seeded) == (42, True)
    r = parse_chat({**body, "seed": None}, CTX, GREEDY, default_seed=42)
    assert (r.sampling.seed, r.seeded) == (42, True)
    r = parse_chat({**body, "seed": 5}, CTX, GREEDY, default_seed=42)
    assert r.sampling.seed == 5
    r = parse_completion({"model": CTX.served_name, "prompt": "x", "seed": -1}, CTX, GREEDY, default_seed=42)
    assert not r.seeded  # a fresh seed, even though the server has one


def test_the_defaults_seed_is_not_read():
    r = chat(defaults=SamplingParams(seed=99))
    assert not r.seeded  # the server's --seed arrives as default_seed, never through defaults


def test_records_are_frozen():
    r = chat()
    with pytest.raises(AttributeError):
        r.model = "x"  # type: ignore[misc]


def test_check_order_is_fixed():
    # Several faults: the model is named first, then the endpoint's refused field, then the
    # not-implemented fields, then messages, then options.
    body = {"model": "nope", "prompt": "x", "n": 2, "messages": [], "top_p": 5}
    assert refusal(parse_chat, body, CTX, GREEDY).param == "model"
    body["model"] = CTX.served_name
    assert refusal(parse_chat, body, CTX, GREEDY).param == "prompt"
    del body["prompt"]
    assert refusal(parse_chat, body, CTX, GREEDY).param == "n"
    del body["n"]
    assert refusal(parse_chat, body, CTX, GREEDY).param == "messages"
    body["messages"] = USER_HI
    body["max_tokens"] = 0
    assert refusal(parse_chat, body, CTX, GREEDY).param == "max_tokens"
    del body["max_tokens"]
    assert refusal(parse_chat, body, CTX, GREEDY).param == "top_p"


@pytest.mark.parametrize("field, literal, param, says", [
    ("seed", "1" + "0" * 5000, "seed", "got an integer of more than 4300 digits"),
    ("seed", "-1" + "0" * 5000, "seed", "got a negative integer of more than 4300 digits"),
    ("top_p", "1" + "0" * 5000, "top_p", "got an integer of more than 4300 digits"),
    ("top_k", "1" + "0" * 5000, None, None),  # read as any k past the vocabulary: keeps every token
    ("max_tokens", "1" + "0" * 5000, None, None),  # capped to the context's room, as any large cap
])
def test_integers_past_pythons_digit_limit_meet_their_fields_rule(field, literal, param, says):
    """docs/http.md: integers are read at any size, so a 5001-digit literal is refused (or taken)
    by its field's rule, not as "not valid JSON" with a hint about sys.set_int_max_str_digits."""
    raw = ('{"model": "%s", "prompt": "hi", "%s": %s}' % (CTX.served_name, field, literal)).encode()
    body = parse_body(raw)
    if param is None:
        req = parse_completion(body, CTX, GREEDY)
        assert field != "top_k" or req.sampling.top_k == 0
        assert field != "max_tokens" or req.max_tokens > CTX.context
        return
    err = refusal(parse_completion, body, CTX, GREEDY)
    assert (err.param, err.message.endswith(says)) == (param, True), err.message
