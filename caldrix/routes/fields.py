"""The request fields of the generating endpoints, declared once: names, limits and JSON Schema.

Both the validator (routes/schemas.py) and the OpenAPI document (routes/openapi.py) read these
declarations, so the document cannot name a field the validator does not read, or a limit it
does not apply. Each `Field` carries the JSON Schema of the values the validator accepts for it
(absent is always accepted unless the field is in `required`); where a rule cannot be written in
JSON Schema (a stop string's limit is in UTF-8 bytes, a prompt must fit the context) the schema
is the looser bound and the validator the exact one, so every body the validator accepts is valid
against the schema, never the other way round.
"""

from __future__ import annotations

import sys
from typing import Any, Callable

import attrs

MAX_MESSAGES = 256
MAX_STOPS = 4
MAX_STOP_BYTES = 256
IMAGE_PLACEHOLDER = "<image>"
SEED_LIMIT = 1 << 64  # seeds are 64-bit; torch's generator takes any of them
ROLES = {"system": "system", "user": "user", "assistant": "assistant", "developer": "system"}
FLOAT_MAX = sys.float_info.max  # "finite": a literal past a double's range reads as infinity


@attrs.frozen
class ModelLimits:
    """What validation needs to know about the loaded model.

    `vocab_size` is the model's (its embedding rows), which may exceed the tokenizer's
    length; a prompt of token ids is checked against it. `context` is the rows per sequence.
    `has_vision`: the model takes image parts (an idefics3 server); elsewhere they are refused.
    """

    served_name: str
    vocab_size: int
    context: int
    has_chat_template: bool
    has_vision: bool = False


Schema = Callable[[ModelLimits], dict[str, Any]]


@attrs.frozen
class Field:
    """One body field: its name, the JSON Schema of the values accepted, a line of doc."""

    name: str
    schema: Schema
    doc: str


def _const(schema: dict[str, Any]) -> Schema:
    return lambda ctx: schema


def _nullable(*types: str) -> list[str]:
    return [*types, "null"]


# http-api.md "Not implemented": accepted only absent, null or at a neutral value. `neutral` are
# the JSON values accepted (compared as JSON compares: a boolean is not a number), `shown` is how
# the refusal's message names them.
@attrs.frozen
class NotImplementedField:
    name: str
    neutral: tuple[Any, ...]
    shown: str

    def is_neutral(self, value: Any) -> bool:
        return any(json_equal(value, n) for n in self.neutral)


NOT_IMPLEMENTED: tuple[NotImplementedField, ...] = (
    NotImplementedField("n", (1,), "1"),
    NotImplementedField("presence_penalty", (0,), "0"),
    NotImplementedField("frequency_penalty", (0,), "0"),
    NotImplementedField("top_logprobs", (0,), "0"),
    NotImplementedField("best_of", (1,), "1"),
    NotImplementedField("logprobs", (False, 0), "false or 0"),
    NotImplementedField("logit_bias", ({},), "{}"),
    NotImplementedField("tools", ([],), "[]"),
    NotImplementedField("tool_choice", ("none",), '"none"'),
    NotImplementedField("response_format", ({"type": "text"},), '{"type": "text"}'),
)


# Feature fields of OpenAI's, vLLM's and llama-server's requests that http-api.md does not name.
# The spec accepts a field it does not name, but refuses "any other sampling or feature field":
# a field that changes the reply is one, and sent at a value that would change it, is refused as
# those above are, never ignored; at its off value (what this server does anyway) it is accepted.
# A setting that only tunes another one (llama-server's dry_base, xtc_threshold, mirostat_tau,
# repeat_last_n; vLLM's guided_decoding_backend) is not listed: it changes nothing while the one
# it tunes is off, which it is wherever a request gets past this list, and llama-server's own
# web page sends them all at their defaults.
PEER_FEATURES: tuple[NotImplementedField, ...] = (
    # OpenAI
    NotImplementedField("echo", (False,), "false"),
    NotImplementedField("suffix", ("",), '""'),
    NotImplementedField("functions", ([],), "[]"),
    NotImplementedField("function_call", ("none",), '"none"'),
    NotImplementedField("modalities", (["text"],), '["text"]'),
    NotImplementedField("audio", (), "null"),
    # vLLM
    NotImplementedField("stop_token_ids", ([],), "[]"),
    NotImplementedField("include_stop_str_in_output", (False,), "false"),
    NotImplementedField("min_tokens", (0,), "0"),
    NotImplementedField("skip_special_tokens", (True,), "true"),
    NotImplementedField("spaces_between_special_tokens", (True,), "true"),
    NotImplementedField("use_beam_search", (False,), "false"),
    NotImplementedField("length_penalty", (1,), "1"),
    NotImplementedField("typical_p", (1,), "1"),
    NotImplementedField("prompt_logprobs", (), "null"),
    NotImplementedField("allowed_token_ids", (), "null"),
    NotImplementedField("bad_words", ([],), "[]"),
    NotImplementedField("guided_json", (), "null"),
    NotImplementedField("guided_regex", (), "null"),
    NotImplementedField("guided_choice", (), "null"),
    NotImplementedField("guided_grammar", (), "null"),
    NotImplementedField("structured_outputs", (), "null"),
    NotImplementedField("add_generation_prompt", (True,), "true"),
    NotImplementedField("continue_final_message", (False,), "false"),
    NotImplementedField("chat_template", (), "null"),
    NotImplementedField("documents", ([],), "[]"),
    # llama-server
    NotImplementedField("grammar", ("",), '""'),
    NotImplementedField("json_schema", ({},), "{}"),
    NotImplementedField("mirostat", (0,), "0"),
    NotImplementedField("tfs_z", (1,), "1"),
    NotImplementedField("n_probs", (0,), "0"),
    NotImplementedField("dry_multiplier", (0,), "0"),
    NotImplementedField("xtc_probability", (0,), "0"),
    NotImplementedField("repeat_penalty", (1,), "1 (the field here is repetition_penalty)"),
    NotImplementedField("n_predict", (-1,), "-1 (the field here is max_tokens)"),
    NotImplementedField("dynatemp_range", (0,), "0"),
    NotImplementedField("top_n_sigma", (-1,), "-1"),
    NotImplementedField("min_keep", (0,), "0"),
    NotImplementedField("t_max_predict_ms", (0,), "0"),
    NotImplementedField("n_keep", (0,), "0"),
    NotImplementedField("n_indent", (0,), "0"),
    NotImplementedField("lora", ([],), "[]"),
    NotImplementedField("return_tokens", (False,), "false (the field here is return_token_ids)"),
    NotImplementedField("timings_per_token", (False,), "false"),
    NotImplementedField("post_sampling_probs", (False,), "false"),
    NotImplementedField("response_fields", (), "null"),
    # vLLM, again
    NotImplementedField("truncate_prompt_tokens", (), "null"),
    NotImplementedField("return_tokens_as_token_ids", (False,), "false"),
    NotImplementedField("logits_processors", (), "null"),
    # Hugging Face's generate() and TGI
    NotImplementedField("max_new_tokens", (), "null (the field here is max_tokens)"),
    NotImplementedField("epsilon_cutoff", (0,), "0"),
    NotImplementedField("eta_cutoff", (0,), "0"),
    # OpenAI, again
    NotImplementedField("web_search_options", (), "null"),
)


# stream_options a client may send at their off value (what this server sends anyway): OpenAI's
# include_obfuscation (the openai packages' types carry it) and vLLM's continuous_usage_stats
# (usage on every chunk).
OFF_ONLY_STREAM_OPTIONS = ("include_obfuscation", "continuous_usage_stats")

# Variables the server itself gives the chat template (or apply_chat_template's own parameters):
# a chat_template_kwargs key among them is refused rather than let it replace the messages or
# the generation prompt.
RESERVED_TEMPLATE_KWARGS = frozenset({
    "messages", "conversation", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
    "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs", "bos_token", "eos_token",
    "raise_exception", "strftime_now",
})


def json_equal(a: Any, b: Any) -> bool:
    """Equality as JSON Schema's `enum` sees it: 1 == 1.0, but true is not 1."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(json_equal(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(json_equal(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


# --- schemas of the values ---------------------------------------------------------------------

_STOP_STRING = {"type": "string", "minLength": 1, "maxLength": MAX_STOP_BYTES,
                "description": f"1 to {MAX_STOP_BYTES} bytes in UTF-8"}


def _token(ctx: ModelLimits) -> dict[str, Any]:
    return {"type": "integer", "minimum": 0, "maximum": ctx.vocab_size - 1}


def _prompt(ctx: ModelLimits) -> dict[str, Any]:
    ids = {"type": "array", "minItems": 1, "items": _token(ctx)}
    return {"anyOf": [
        {"type": "string", "minLength": 1},
        ids,
        # A batch of one is its single prompt; a longer batch is refused.
        {"type": "array", "minItems": 1, "maxItems": 1, "items": {"type": "string", "minLength": 1}},
        {"type": "array", "minItems": 1, "maxItems": 1, "items": ids},
    ]}


_NO_PLACEHOLDER = {"not": {"pattern": IMAGE_PLACEHOLDER}}


def _messages(ctx: ModelLimits) -> dict[str, Any]:
    text_part = {"type": "object", "required": ["type", "text"],
                 "properties": {"type": {"const": "text"}, "text": {"type": "string", **_NO_PLACEHOLDER}}}
    part = text_part
    if ctx.has_vision:  # vision.md: the URL's rules (data URL types, signatures, sizes) are the validator's
        from caldrix.vision.images import DETAILS

        image_part = {"type": "object", "required": ["type", "image_url"], "properties": {
            "type": {"const": "image_url"},
            "image_url": {"type": "object", "required": ["url"],
                          "properties": {"url": {"type": "string", "minLength": 1},
                                         "detail": {"enum": [None, *DETAILS]}}}}}
        part = {"anyOf": [text_part, image_part]}
    content = {"anyOf": [{"type": "string", **_NO_PLACEHOLDER}, {"type": "array", "items": part}]}
    message = {"type": "object", "required": ["role", "content"],
               "properties": {"role": {"enum": list(ROLES)}, "content": content,
                              "reasoning_content": {"type": _nullable("string")},
                              "reasoning": {"type": _nullable("string")},
                              "tool_calls": {"anyOf": [{"type": "null"}, {"type": "array", "maxItems": 0}]}}}
    return {"type": "array", "minItems": 1, "maxItems": MAX_MESSAGES, "items": message}


# --- the fields --------------------------------------------------------------------------------

MODEL = Field("model", lambda ctx: {"type": "string", "enum": [ctx.served_name]},
              "the name this server answers to; any other is a 400")

GENERATION: tuple[Field, ...] = (
    MODEL,
    Field("max_tokens", _const({"type": _nullable("integer"), "minimum": 1}),
          "the reply's cap; beyond the context's room it is capped, not refused"),
    Field("max_completion_tokens", _const({"type": _nullable("integer"), "minimum": 1}),
          "another name for max_tokens; both with different values is a 400"),
    Field("stop", _const({"anyOf": [{"type": "null"}, _STOP_STRING,
                                    {"type": "array", "maxItems": MAX_STOPS, "items": _STOP_STRING}]}),
          f"a string or up to {MAX_STOPS}, each 1 to {MAX_STOP_BYTES} bytes"),
    Field("stream", _const({"type": _nullable("boolean")}), "send server-sent events"),
    Field("stream_options", _const({"type": _nullable("object"), "additionalProperties": False,
                                    "properties": {"include_usage": {"type": _nullable("boolean")},
                                                   **{k: {"enum": [False, None]} for k in OFF_ONLY_STREAM_OPTIONS}}}),
          'only with "stream": true'),
    Field("ignore_eos", _const({"type": _nullable("boolean")}), "treat end of sequence as an ordinary token"),
    Field("return_token_ids", _const({"type": _nullable("boolean")}), "add each generated token's id"),
    Field("user", _const({"type": _nullable("string")}), "accepted and ignored"),
    Field("temperature", _const({"type": _nullable("number"), "minimum": 0, "maximum": FLOAT_MAX}),
          "a finite number >= 0; 0 is greedy"),
    Field("top_k", _const({"type": _nullable("integer"), "minimum": -1}),
          "an integer >= 0; 0 or -1 keeps every token"),
    Field("top_p", _const({"type": _nullable("number"), "exclusiveMinimum": 0, "maximum": 1}), "0 < top_p <= 1"),
    Field("min_p", _const({"type": _nullable("number"), "minimum": 0, "maximum": 1}), "0 <= min_p <= 1"),
    Field("repetition_penalty", _const({"type": _nullable("number"), "exclusiveMinimum": 0, "maximum": FLOAT_MAX}),
          "a finite number > 0; 1 is off"),
    Field("seed", _const({"type": _nullable("integer"), "minimum": -1, "maximum": SEED_LIMIT - 1}),
          "an integer below 2**64; -1 or null draws a fresh seed"),
    *(Field(f.name, (lambda f: lambda ctx: {"enum": [*f.neutral, None]})(f),
            f"not implemented: only {f.shown} is accepted") for f in NOT_IMPLEMENTED + PEER_FEATURES),
)

COMPLETION: tuple[Field, ...] = (
    Field("prompt", _prompt, "a string or an array of token ids (or a batch of one of either)"),
    Field("messages", _const({"type": "null"}), "refused here: send prompt"),
    *GENERATION,
)

CHAT: tuple[Field, ...] = (
    Field("messages", _messages, f"1 to {MAX_MESSAGES} messages"),
    Field("prompt", _const({"type": "null"}), "refused here: send messages"),
    Field("chat_template_kwargs", _const({"type": _nullable("object")}),
          "extra variables for the chat template, such as Qwen3's enable_thinking"),
    *GENERATION,
)


def body_schema(fields: tuple[Field, ...], required: tuple[str, ...], ctx: ModelLimits) -> dict[str, Any]:
    """The JSON Schema of a request body. Unknown fields are accepted (http-api.md: "any field
    this page does not name" is), so additionalProperties stays open."""
    return {
        "type": "object",
        "required": list(required),
        "properties": {f.name: {**f.schema(ctx), "description": f.doc} for f in fields},
    }
