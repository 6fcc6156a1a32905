"""Request bodies of /v1/completions and /v1/chat/completions, parsed into typed records.

Pure and synchronous: bytes in, frozen attrs records out, or an `ApiError` naming the first
problem found. The rules are http-api.md's; where the page leaves a choice open the choice is
stated next to the code and in docs/http.md.

Checks run in a fixed order, so a body with several problems always names the same one: the
model, the field the endpoint refuses (prompt on chat, messages on completions), the
not-implemented fields, the chat template, then the prompt or messages, then the generation
options, then the sampling knobs.

Why one file of about 600 lines: the two endpoints share every rule but the prompt, and that
fixed order of checks is the contract; split across files it would be read out of order. What is
declaration rather than rule (the fields, their limits and neutral values, the template
variables the server keeps to itself) lives in routes/fields.py, which openapi.py reads too, and
the JSON reading itself (duplicate keys, surrogates, integers past Python's digit limit) in
routes/strictjson.py.
"""

from __future__ import annotations

import json
import math
import secrets
from typing import Any

import attrs

from caldrix.protocol import SamplingParams
from caldrix.routes import strictjson
from caldrix.routes.errors import ApiError, clip
from caldrix.routes.fields import (  # the declarations this validator and openapi.py share
    IMAGE_PLACEHOLDER,
    MAX_MESSAGES,
    MAX_STOP_BYTES,
    MAX_STOPS,
    NOT_IMPLEMENTED,
    OFF_ONLY_STREAM_OPTIONS,
    PEER_FEATURES,
    RESERVED_TEMPLATE_KWARGS,
    ROLES,
    SEED_LIMIT,
    ModelLimits,
)

__all__ = ["ModelLimits", "parse_body", "parse_chat", "parse_completion", "reply_budget"]

NO_CHAT_TEMPLATE = "this model has no chat template; use /v1/completions"


@attrs.frozen
class ChatMessage:
    """One message, ready for the chat template.

    `role` is system, user or assistant ("developer" arrives as system). `content` is the
    message's text: a string content as sent, or its text parts joined with a newline.
    """

    role: str
    content: str
    # An assistant turn's reasoning (reasoning_content, or vLLM's newer name reasoning): the
    # template writes it where it keeps reasoning (Qwen3's <think> block), as vLLM passes it.
    reasoning: str | None = None


@attrs.frozen(kw_only=True)
class GenerationRequest:
    """What both generating endpoints share.

    `max_tokens` is None when the request set no cap (generation runs until the end of the
    sequence or the context is full); `reply_budget` turns it into a concrete cap.
    `sampling.seed` is always concrete; `seeded` says whether it came from the request or the
    server's --seed (True) or was drawn fresh for this request (False). Speculative decoding
    needs the difference: a seeded sampled request runs without it.
    `include_usage` is stream_options.include_usage, only ever True on a streamed request.
    """

    model: str
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    sampling: SamplingParams = SamplingParams()
    seeded: bool = False
    ignore_eos: bool = False
    return_token_ids: bool = False
    stream: bool = False
    include_usage: bool = False
    user: str | None = None


@attrs.frozen(kw_only=True)
class CompletionRequest(GenerationRequest):
    """A validated /v1/completions body: `prompt` is text, or token ids already range-checked."""

    prompt: str | tuple[int, ...]


@attrs.frozen(kw_only=True)
class ChatRequest(GenerationRequest):
    """A validated /v1/chat/completions body: 1 to 256 messages, text only."""

    messages: tuple[ChatMessage, ...]
    # chat_template_kwargs: extra variables for the chat template (Qwen3's enable_thinking), as
    # vLLM passes them; pairs in the order sent.
    template_kwargs: tuple[tuple[str, Any], ...] = ()


# ---------------------------------------------------------------------------------------------
# The body


def parse_body(raw: bytes) -> dict[str, Any]:
    """The request body as a dict, or a 400 naming what is wrong with it.

    The body must be UTF-8 JSON whose top level is an object. A duplicate key at any depth is
    a 400 whose param is the key's path ("messages[0].role"): two values for one field are a
    client bug, and picking one would hide it. NaN, Infinity and unpaired UTF-16 surrogates
    are refused (none is JSON text the tokenizer could take). Integers are read exactly, at
    any size, so an out-of-range seed is refused by its field's rule, not as bad JSON.
    """
    if not raw.strip():
        raise ApiError.invalid("the request body is empty; send a JSON object")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ApiError.invalid(f"the request body is not UTF-8: {e.reason} at byte {e.start}")
    try:
        body = strictjson.loads(text, parse_int=strictjson.bounded_int)
    except strictjson.DuplicateKey as e:
        raise ApiError.invalid(f'duplicate key "{e.key}" in the request body', e.path)
    except RecursionError:  # past MAX_NESTING, or past what the parser can go
        raise ApiError.invalid(strictjson.TOO_DEEP)
    except ValueError as e:  # JSONDecodeError, a constant, an integer past Python's digit limit
        raise ApiError.invalid(f"the request body is not valid JSON: {e}")
    if not isinstance(body, dict):
        raise ApiError.invalid(f"the request body must be a JSON object, got {_kind(body)}")
    if strictjson.lone_surrogate(text, body):
        raise ApiError.invalid("the request body holds an unpaired UTF-16 surrogate escape")
    return body


# ---------------------------------------------------------------------------------------------
# The endpoints


def parse_completion(
    body: dict[str, Any],
    ctx: ModelLimits,
    defaults: SamplingParams,
    *,
    default_seed: int | None = None,
) -> CompletionRequest:
    """A /v1/completions body as a `CompletionRequest`, or the first refusal as an ApiError.

    `defaults` are the server's sampling flags; a knob absent or null in the body inherits
    them. `defaults.seed` is not read: a SamplingParams always holds a concrete seed, so the
    server's --seed arrives as `default_seed`, None when the server has none (each request
    without a seed then draws fresh entropy).
    """
    model = _model(body, ctx)
    if body.get("messages") is not None:
        raise ApiError.invalid(
            "messages is refused here; send prompt, or use /v1/chat/completions", "messages"
        )
    _refuse_not_implemented(body)
    prompt = _prompt(body.get("prompt"), ctx)
    return CompletionRequest(model=model, prompt=prompt, **_generation(body, defaults, default_seed))


def parse_chat(
    body: dict[str, Any],
    ctx: ModelLimits,
    defaults: SamplingParams,
    *,
    default_seed: int | None = None,
) -> ChatRequest:
    """A /v1/chat/completions body as a `ChatRequest`, or the first refusal as an ApiError.

    Defaults and seeds as for `parse_completion`. A model without a chat template refuses
    every chat request at param "messages".
    """
    model = _model(body, ctx)
    if body.get("prompt") is not None:
        raise ApiError.invalid("prompt is refused here; send messages", "prompt")
    _refuse_not_implemented(body)
    if not ctx.has_chat_template:
        raise ApiError.invalid(NO_CHAT_TEMPLATE, "messages")
    messages = _messages(body.get("messages"), ctx)
    return ChatRequest(model=model, messages=messages, template_kwargs=_template_kwargs(body),
                       **_generation(body, defaults, default_seed))


def _template_kwargs(body: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
    raw = body.get("chat_template_kwargs")
    if raw is None:
        return ()
    if not isinstance(raw, dict):
        raise ApiError.invalid(f"must be an object, got {_kind(raw)}", "chat_template_kwargs")
    for key in raw:
        if not key.isidentifier():
            raise ApiError.invalid(f'"{clip(key)}" is not a name a template can read',
                                   f"chat_template_kwargs.{clip(key)}")
        if key in RESERVED_TEMPLATE_KWARGS:
            raise ApiError.invalid(
                f'"{clip(key)}" cannot be set here: the server gives the template its messages and '
                "generation prompt", f"chat_template_kwargs.{clip(key)}")
    return tuple(raw.items())


def reply_budget(prompt_len: int, max_tokens: int | None, ctx: ModelLimits, param: str) -> int:
    """The reply cap for a prompt of `prompt_len` tokens, or a 400 at `param` when none fits.

    The prompt must leave at least one row of the context for the reply. `max_tokens` larger
    than the rows left is capped, not refused (http-api.md: without a cap generation runs
    until the context is full, and a cap beyond it means the same). `param` is "prompt" on
    /v1/completions and "messages" on chat.
    """
    room = ctx.context - prompt_len
    if room < 1:
        raise ApiError.past_context(
            f"the prompt is {prompt_len} tokens and the context holds {ctx.context}; "
            "that leaves no room for a reply",
            param,
        )
    return room if max_tokens is None else min(max_tokens, room)


# ---------------------------------------------------------------------------------------------
# Fields


def _model(body: dict[str, Any], ctx: ModelLimits) -> str:
    model = body.get("model")
    if model is None:
        raise ApiError.invalid(f'model is required; this server serves "{ctx.served_name}"', "model")
    if not isinstance(model, str):
        raise ApiError.invalid(f"must be a string, got {_kind(model)}", "model")
    if model != ctx.served_name:
        raise ApiError.invalid(
            f'model "{clip(model)}" is not served here; this server serves "{ctx.served_name}"',
            "model",
        )
    return model


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _refuse_not_implemented(body: dict[str, Any]) -> None:
    for field in NOT_IMPLEMENTED + PEER_FEATURES:
        value = body.get(field.name)
        if value is not None and not field.is_neutral(value):
            raise ApiError.invalid(
                f"{field.name} is not supported by this server; only {field.shown} is accepted", field.name
            )


def _prompt(raw: Any, ctx: ModelLimits) -> str | tuple[int, ...]:
    if raw is None:
        raise ApiError.invalid("prompt is required: a string or an array of token ids", "prompt")
    where = "prompt"
    # A batch of one ("prompt": ["text"] or [[1, 2]]) is its single prompt: LangChain and
    # older clients always send a list. A longer batch would need one choice per prompt.
    if isinstance(raw, list) and raw and all(isinstance(p, (str, list)) for p in raw):
        if len(raw) > 1:
            raise ApiError.invalid(
                f"prompt holds {len(raw)} prompts; this server takes one prompt a request",
                "prompt",
            )
        raw, where = raw[0], "prompt[0]"
    if isinstance(raw, str):
        if not raw:
            raise ApiError.invalid("prompt is empty", "prompt")
        return raw
    if not isinstance(raw, list):
        raise ApiError.invalid(
            f"must be a string or an array of token ids, got {_kind(raw)}", "prompt"
        )
    if not raw:
        raise ApiError.invalid("prompt is empty", "prompt")
    for i, tid in enumerate(raw):
        if not isinstance(tid, int) or isinstance(tid, bool):
            raise ApiError.invalid(
                f"{where}[{i}] must be a token id (an integer), got {_kind(tid)}", "prompt"
            )
        if not 0 <= tid < ctx.vocab_size:
            raise ApiError.invalid(
                f"{where}[{i}] is token id {_show(tid)}, outside the vocabulary "
                f"(0 to {ctx.vocab_size - 1})",
                "prompt",
            )
    return tuple(raw)


def _messages(raw: Any, ctx: ModelLimits) -> tuple[ChatMessage, ...]:
    if raw is None:
        raise ApiError.invalid("messages is required", "messages")
    if not isinstance(raw, list):
        raise ApiError.invalid(f"must be an array of messages, got {_kind(raw)}", "messages")
    if not 1 <= len(raw) <= MAX_MESSAGES:
        raise ApiError.invalid(
            f"messages must hold 1 to {MAX_MESSAGES} messages, got {len(raw)}", "messages"
        )
    if ctx.has_vision:  # the image count first, before any part is read (caldrix/vision/messages.py)
        from caldrix.vision.messages import request_image_refusal

        _raise_refusal(request_image_refusal(raw))
    return tuple(_message(m, f"messages[{i}]", ctx) for i, m in enumerate(raw))


def _message(m: Any, path: str, ctx: ModelLimits) -> ChatMessage:
    if not isinstance(m, dict):
        raise ApiError.invalid(f"a message must be an object, got {_kind(m)}", path)
    role = m.get("role")
    if role is None:
        raise ApiError.invalid("role is required", f"{path}.role")
    if not isinstance(role, str):
        raise ApiError.invalid(f"must be a string, got {_kind(role)}", f"{path}.role")
    if role in ("tool", "function"):
        raise ApiError.invalid(
            f"{role} messages are not supported: this server has no tools", f"{path}.role"
        )
    if role not in ROLES:
        raise ApiError.invalid(
            f'must be system, user, assistant or developer, got "{clip(role)}"', f"{path}.role"
        )
    if m.get("tool_calls") not in (None, []):
        raise ApiError.invalid("tool calls are not supported: this server has no tools", f"{path}.tool_calls")
    cpath = f"{path}.content"
    if "content" not in m:
        raise ApiError.invalid("content is required", cpath)
    content = m["content"]
    if isinstance(content, str):
        _no_placeholder(content, cpath)
        text = content
    elif isinstance(content, list) and ctx.has_vision:  # parts stay parts, in order
        from caldrix.vision.messages import vision_message

        return _raise_refusal(vision_message(ROLES[role], content, cpath, lambda p, at: _text_part(p, at, ctx)))
    elif isinstance(content, list):
        text = "\n".join(_text_part(p, f"{cpath}[{j}]", ctx) for j, p in enumerate(content))
    else:
        raise ApiError.invalid(
            f"must be a string or an array of content parts, got {_kind(content)}", cpath
        )
    return ChatMessage(role=ROLES[role], content=text, reasoning=_reasoning(m, path))


def _reasoning(m: dict[str, Any], path: str) -> str | None:
    for key in ("reasoning_content", "reasoning"):
        value = m.get(key)
        if value is not None and not isinstance(value, str):
            raise ApiError.invalid(f"must be a string, got {_kind(value)}", f"{path}.{key}")
    found = m.get("reasoning_content")
    return found if found is not None else m.get("reasoning")


def _text_part(part: Any, path: str, ctx: ModelLimits) -> str:
    """One content part's text; any part that is not a well-formed text part is a 400."""
    if not isinstance(part, dict):
        raise ApiError.invalid(f"a content part must be an object, got {_kind(part)}", path)
    kind = part.get("type")
    if kind == "text":
        text = part.get("text")
        if not isinstance(text, str):
            raise ApiError.invalid(f'a text part needs "text" as a string, got {_kind(text)}', path)
        _no_placeholder(text, path)
        return text
    if kind == "image_url":
        if not ctx.has_vision:
            raise ApiError.invalid("this model takes text only", path)
        raise AssertionError("image parts of a vision model are read by caldrix/vision/messages.py")
    if kind is None:
        raise ApiError.invalid('a content part needs a "type"', path)
    if not isinstance(kind, str):
        raise ApiError.invalid(f'a content part\'s "type" must be a string, got {_kind(kind)}', path)
    raise ApiError.invalid(f'content part type "{clip(kind)}" is not supported; use "text"', path)


def _raise_refusal(got: Any) -> Any:
    """A vision record as it is, or its refusal (caldrix/vision's ImageRefusal) as a 400."""
    from caldrix.vision.images import ImageRefusal

    if isinstance(got, ImageRefusal):
        raise ApiError.invalid(got.message, got.param)
    return got


def _no_placeholder(text: str, path: str) -> None:
    # The vision template's image token would be read as an image with no pixels behind it.
    # On a text model no image can match it either, so the count is always off.
    count = text.count(IMAGE_PLACEHOLDER)
    if count:
        raise ApiError.invalid(
            f'image placeholder count: the text holds {count} "{IMAGE_PLACEHOLDER}" '
            "and no image stands behind it; the placeholder may not be typed into text",
            path,
        )


def _generation(
    body: dict[str, Any], defaults: SamplingParams, default_seed: int | None
) -> dict[str, Any]:
    """The GenerationRequest fields, as keyword arguments, checked in the order written."""
    fields: dict[str, Any] = dict(
        max_tokens=_max_tokens(body),
        stop=_stop(body.get("stop")),
        stream=_flag(body, "stream"),
        ignore_eos=_flag(body, "ignore_eos"),
        return_token_ids=_flag(body, "return_token_ids"),
    )
    fields["include_usage"] = _include_usage(body.get("stream_options"), fields["stream"])
    fields["user"] = _user(body.get("user"))
    fields["sampling"], fields["seeded"] = _sampling(body, defaults, default_seed)
    return fields


def _max_tokens(body: dict[str, Any]) -> int | None:
    caps = {}
    for name in ("max_tokens", "max_completion_tokens"):
        value = _integer(body, name)
        if value is not None and value < 1:
            raise ApiError.invalid(f"must be an integer >= 1, got {_show(value)}", name)
        caps[name] = value
    a, b = caps["max_tokens"], caps["max_completion_tokens"]
    # OpenAI renamed the field; both are read. Two different caps are a client bug.
    if a is not None and b is not None and a != b:
        raise ApiError.invalid(
            f"max_tokens ({_show(a)}) and max_completion_tokens ({_show(b)}) disagree; send one",
            "max_completion_tokens",
        )
    return a if a is not None else b


def _stop(raw: Any) -> tuple[str, ...]:
    if raw is None:
        return ()
    if isinstance(raw, str):
        stops, names = [raw], ["stop"]
    elif isinstance(raw, list):
        # An empty list is no stop strings, as null is: the neutral value, like tools: [].
        if len(raw) > MAX_STOPS:
            raise ApiError.invalid(f"stop takes at most {MAX_STOPS} strings, got {len(raw)}", "stop")
        stops, names = raw, [f"stop[{i}]" for i in range(len(raw))]
    else:
        raise ApiError.invalid(f"must be a string or an array of strings, got {_kind(raw)}", "stop")
    for s, name in zip(stops, names):
        if not isinstance(s, str):
            raise ApiError.invalid(f"{name} must be a string, got {_kind(s)}", "stop")
        n = len(s.encode("utf-8", "surrogatepass"))
        if not 1 <= n <= MAX_STOP_BYTES:
            raise ApiError.invalid(
                f"{name} is {n} bytes in UTF-8; a stop string must be 1 to {MAX_STOP_BYTES} bytes",
                "stop",
            )
    return tuple(stops)


def _include_usage(raw: Any, stream: bool) -> bool:
    if raw is None:
        return False
    # As OpenAI does: stream_options on a request that does not stream is a client mistake.
    if not stream:
        raise ApiError.invalid("stream_options is only allowed when stream is true", "stream_options")
    if not isinstance(raw, dict):
        raise ApiError.invalid(f"must be an object, got {_kind(raw)}", "stream_options")
    for key in raw:
        if key in OFF_ONLY_STREAM_OPTIONS:
            if _flag(raw, key, param=f"stream_options.{key}"):
                raise ApiError.invalid(f"stream_options.{key} is not implemented: only false is accepted",
                                       f"stream_options.{key}")
        elif key != "include_usage":
            raise ApiError.invalid(
                f'unknown field "{clip(key)}" in stream_options; only include_usage is accepted',
                f"stream_options.{key}",
            )
    return _flag(raw, "include_usage", param="stream_options.include_usage")



def _user(raw: Any) -> str | None:
    if raw is not None and not isinstance(raw, str):
        raise ApiError.invalid(f"must be a string, got {_kind(raw)}", "user")
    return raw


def _sampling(
    body: dict[str, Any], defaults: SamplingParams, default_seed: int | None
) -> tuple[SamplingParams, bool]:
    """The six knobs of http-api.md "Sampling" over `defaults`, and whether the seed was given."""
    changes: dict[str, Any] = {}

    temperature = _number(body, "temperature")
    if temperature is not None:
        if not (math.isfinite(temperature) and temperature >= 0):
            raise ApiError.invalid(
                f"must be a finite number >= 0, got {_show(body['temperature'])}", "temperature"
            )
        changes["temperature"] = temperature

    top_k = _integer(body, "top_k")
    if top_k is not None:
        if top_k < -1:
            raise ApiError.invalid(
                f"must be an integer >= 0 (0 or -1 keeps every token), got {_show(top_k)}", "top_k"
            )
        changes["top_k"] = max(top_k, 0)

    top_p = _number(body, "top_p")
    if top_p is not None:
        if not 0 < top_p <= 1:
            raise ApiError.invalid(f"must be 0 < p <= 1, got {_show(body['top_p'])}", "top_p")
        changes["top_p"] = top_p

    min_p = _number(body, "min_p")
    if min_p is not None:
        if not 0 <= min_p <= 1:
            raise ApiError.invalid(f"must be 0 <= p <= 1, got {_show(body['min_p'])}", "min_p")
        changes["min_p"] = min_p

    penalty = _number(body, "repetition_penalty")
    if penalty is not None:
        if not (math.isfinite(penalty) and penalty > 0):
            raise ApiError.invalid(
                f"must be a finite number > 0, got {_show(body['repetition_penalty'])}",
                "repetition_penalty",
            )
        changes["repetition_penalty"] = penalty

    # null inherits the server's --seed like every other knob; -1 asks for fresh entropy
    # even on a server that has one.
    seed = _integer(body, "seed")
    if seed is not None and not -1 <= seed < SEED_LIMIT:
        raise ApiError.invalid(
            f"must be a non-negative integer below 2**64 (-1 draws a fresh seed), got {_show(seed)}",
            "seed",
        )
    if seed is None:
        seed = -1 if default_seed is None else default_seed
    seeded = seed >= 0
    changes["seed"] = seed if seeded else secrets.randbits(63)

    return attrs.evolve(defaults, **changes), seeded


# ---------------------------------------------------------------------------------------------
# Typed reads: absent and null read as None; a JSON boolean is never a number.


def _number(body: dict[str, Any], name: str) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if not _is_number(value):
        raise ApiError.invalid(f"must be a number, got {_kind(value)}", name)
    try:
        return float(value)
    except OverflowError:  # an integer literal too big for a double
        return math.inf if value > 0 else -math.inf


def _integer(body: dict[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        got = f"number {_show(value)}" if isinstance(value, float) else _kind(value)
        raise ApiError.invalid(f"must be an integer, got {got}", name)
    return value


def _flag(body: dict[str, Any], name: str, *, param: str | None = None) -> bool:
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ApiError.invalid(f"must be a boolean, got {_kind(value)}", param or name)
    return value


_kind = strictjson.kind


def _show(value: Any) -> str:
    """A parsed scalar as the request spelled it, near enough: 2 stays 2, 2.0 stays 2.0."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        if abs(value) >= strictjson.HUGE:  # read from a literal past Python's digit limit (bounded_int)
            return f"{'a negative' if value < 0 else 'an'} integer of more than {strictjson.INT_DIGITS} digits"
        return clip(str(value))
    if isinstance(value, float):
        return repr(value)  # shortest round-trip; inf for a literal past a double's range
    if isinstance(value, str):
        return json.dumps(clip(value), ensure_ascii=False)
    return _kind(value)
