"""POST /v1/completions and POST /v1/chat/completions, streamed or not.

Flow: read the body (413 over the limit) -> validate into a typed request (400) -> tokenize (off
the event loop when long: prompt_ids.py) and check the context (400) -> submit to the scheduler
(429 when the queue is full, 503 when the engine has stopped) -> turn token events into text,
JSON or SSE.
"""

from __future__ import annotations

import itertools
import logging
import time

import trio
from quart import Blueprint, Response, current_app

from caldrix.routes.responses import json_response
from caldrix.generate import EngineFailed, EngineStopped, GenRequest, QueueFull, pieces, submit
from caldrix.protocol import FinishReason
from caldrix.routes import backoff, sse
from caldrix.routes.debug import refuse, tracked
from caldrix.routes.errors import ApiError
from caldrix.routes.prompt_ids import LIMITER_KEY, build, check_fits, check_in_vocab, parsed
from caldrix.routes.schemas import ModelLimits, parse_body, parse_chat, parse_completion, reply_budget
from caldrix.tokenizer import ChatTemplateError

log = logging.getLogger("caldrix")
bp = Blueprint("completions", __name__)
_ids = itertools.count(1)


def _state():
    return current_app.extensions["caldrix"]


def _prompt_threads() -> trio.CapacityLimiter:
    return current_app.extensions[LIMITER_KEY]


def _vision():
    """The server's VisionServing (caldrix/vision/serving.py), or None on a text model."""
    return current_app.extensions.get("caldrix.vision")


def limits(rt) -> ModelLimits:
    return ModelLimits(
        served_name=rt.served_name,
        vocab_size=rt.vocab_size,
        context=rt.context,
        has_chat_template=rt.tokenizer.has_chat_template,
        has_vision=_vision() is not None,
    )


def _completion(raw: bytes, ctx: ModelLimits, sampling, seed):
    return parse_completion(parse_body(raw), ctx, sampling, default_seed=seed)


def _chat(raw: bytes, ctx: ModelLimits, sampling, seed):
    return parse_chat(parse_body(raw), ctx, sampling, default_seed=seed)


@bp.post("/v1/completions")
async def completions():
    rt, _ = _state()
    req = await parsed(_completion, limits(rt), rt.cfg.sampling, rt.cfg.seed)
    if isinstance(req.prompt, tuple):
        ids = req.prompt
    else:
        check_fits(rt.tokenizer, (req.prompt,), rt.context, "prompt")
        ids = tuple(await build(_prompt_threads(), len(req.prompt), rt.tokenizer.encode, req.prompt))
    return await _generate("cmpl", "text_completion", req, ids, "prompt")


@bp.post("/v1/chat/completions")
async def chat_completions():
    rt, _ = _state()
    req = await parsed(_chat, limits(rt), rt.cfg.sampling, rt.cfg.seed)
    texts = [m.content for m in req.messages]
    check_fits(rt.tokenizer, texts, rt.context, "messages")
    size = sum(map(len, texts))
    if _vision() is not None:
        return await _vision_chat(rt, req, size)
    try:
        ids = tuple(await build(_prompt_threads(), size, rt.tokenizer.render_chat, req.messages, dict(req.template_kwargs)))
    except ChatTemplateError as exc:
        raise ApiError.invalid(str(exc), "messages") from None
    return await _generate("chatcmpl", "chat.completion", req, ids, "messages")


async def _vision_chat(rt, req, size: int):
    """A chat request on a vision model: the prompt planned from the images' headers, the
    context checked, and only then the images decoded and embedded (in the decode limiter)."""
    from caldrix.vision.limiter import DecodeQueueFull
    from caldrix.vision.prompt import plan_prompt
    from caldrix.vision.serving import ImageFailed, embed_request, slot_threads

    vs = _vision()
    hf = rt.tokenizer.hf
    kwargs = dict(req.template_kwargs)
    render = lambda conv: hf.apply_chat_template(conv, tokenize=False, add_generation_prompt=True, **kwargs)  # noqa: E731
    encode = lambda text: hf.encode(text, add_special_tokens=False)  # noqa: E731
    try:
        plan = await build(_prompt_threads(), size, plan_prompt, render, encode, req.messages, vs.tokens, vs.settings)
    except ValueError as exc:  # the template's <image> count against the images
        raise ApiError.invalid(str(exc), "messages") from None
    except Exception as exc:  # jinja2's TemplateError, or whatever the template trips on
        raise ApiError.invalid(f"the chat template refused these messages: {exc}", "messages") from None
    ids = plan.prompt.ids
    if not plan.images:
        return await _generate("chatcmpl", "chat.completion", req, ids, "messages")
    if not ids:
        raise ApiError.invalid("the prompt is empty", "messages")
    reply_budget(len(ids), req.max_tokens, limits(rt), "messages")  # before any image is decoded
    check_in_vocab(ids, rt.vocab_size, rt.tokenizer, "messages")
    if rt.scheduler.failed:
        raise ApiError.engine_unavailable()
    try:
        spans = await embed_request(vs, plan, rt.engine.embed_images, rt.engine.put_embeddings,
                                    lambda: slot_threads(rt.scheduler.statistics().running, rt.engine.max_threads))
    except DecodeQueueFull as full:
        wait = backoff.estimate(full.held, full.waiting, full.slots)
        raise ApiError.image_queue_full(backoff.headers(wait)) from None
    except ImageFailed as exc:
        raise ApiError.invalid(str(exc), exc.param) from None
    return await _generate("chatcmpl", "chat.completion", req, ids, "messages", embeds=spans)


async def _generate(prefix: str, obj: str, req, ids: tuple[int, ...], prompt_param: str, *, embeds: tuple = ()):
    """`embeds`: an image request's embedding spans, whose rows the engine holds already; such a
    request reuses no held rows, leaves none, and is never captured by the replay ring."""
    rt, queue = _state()
    try:
        if not ids:
            raise ApiError.invalid("the prompt is empty", prompt_param)
        check_in_vocab(ids, rt.vocab_size, rt.tokenizer, prompt_param)
        max_tokens = reply_budget(len(ids), req.max_tokens, limits(rt), prompt_param)
        if rt.scheduler.failed:
            raise ApiError.engine_unavailable()
    except ApiError:
        _drop(rt, embeds)
        raise
    rid = f"{prefix}-{next(_ids)}"
    gen = GenRequest(
        request_id=rid,
        prompt_ids=ids,
        max_tokens=max_tokens,
        sampling=req.sampling,
        stop_token_ids=frozenset() if req.ignore_eos else rt.tokenizer.eos_token_ids,
        stops=req.stop,
        reuse_prefix=not embeds,
        embeds=embeds,
    )
    try:
        rx = submit(queue, gen)
    except QueueFull:
        _drop(rt, embeds)  # never handed over: the scheduler will not drop them
        refuse(rid, gen, 429, stream=req.stream)
        wait = backoff.retry_after_s(rt.telemetry.records(), queue.waiting(), rt.cfg.max_batch)
        raise ApiError.queue_full(backoff.headers(wait)) from None
    except EngineStopped:
        _drop(rt, embeds)
        refuse(rid, gen, 503, stream=req.stream)
        raise ApiError.engine_unavailable() from None
    chat = obj == "chat.completion"
    head = {"id": rid, "created": int(time.time()), "model": rt.served_name}
    stream = tracked(rid, pieces(rx, rt.tokenizer, req.stop, prompt_ids=ids), rx, stream=req.stream)
    if req.stream:
        return Response(_sse(stream, head, chat, req, len(ids)), mimetype="text/event-stream",
                        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    text, tokens, finish, spec = [], [], None, None
    try:
        async for piece in stream:
            text.append(piece.text)
            tokens.extend(piece.token_ids)
            finish = piece.finish
            spec = piece.speculative or spec
    except EngineFailed as exc:
        raise ApiError.engine_failed(str(exc)) from None
    except EngineStopped as exc:
        raise ApiError(503, str(exc)) from None
    finally:
        await stream.aclose()
    choice = {"finish_reason": finish.value, "index": 0}
    if chat:
        choice["message"] = {"content": "".join(text), "role": "assistant"}
    else:
        choice["text"] = "".join(text)
    if req.return_token_ids:
        choice["token_ids"] = tokens
    return json_response({**head, "choices": [choice], "object": obj, "usage": _usage(len(ids), len(tokens), spec)})


def _drop(rt, embeds: tuple) -> None:
    if embeds:
        rt.engine.drop_embeddings({e.key for e in embeds})


def _usage(prompt: int, completion: int, spec: tuple[int, int] | None = None) -> dict:
    usage = {"completion_tokens": completion, "prompt_tokens": prompt, "total_tokens": prompt + completion}
    if spec is not None:  # http-api.md: a request that speculated
        usage["speculative"] = {"accepted": spec[1], "proposed": spec[0]}
    return usage


async def _sse(stream, head: dict, chat: bool, req, prompt_tokens: int):
    """SSE body. Leaving early (client gone) closes `stream`, whose close ends the generation."""
    obj = "chat.completion.chunk" if chat else "text_completion"
    count = 0
    pending: list[int] = []
    spec = None
    # The first chat delta says whose it is, as OpenAI, vLLM and llama-server say it: the openai
    # packages' stream helpers build the final message from the deltas and refuse one without a
    # role. Carried by the first chunk sent, with its text (or alone, with the finish).
    role = {"role": "assistant"}

    def chunk(text: str | None, finish: FinishReason | None) -> bytes:
        nonlocal role
        choice: dict = {"finish_reason": finish.value if finish else None, "index": 0}
        if chat:
            delta = dict(role)
            if text is not None or role:  # an empty reply's only delta says content "", as its message does
                delta["content"] = text or ""
            choice["delta"] = delta
            role = {}
        else:
            choice["text"] = text or ""
        if req.return_token_ids:
            choice["token_ids"] = list(pending)
            pending.clear()
        return sse.event({**head, "choices": [choice], "object": obj})

    try:
        async for piece in stream:
            count += len(piece.token_ids)
            pending.extend(piece.token_ids)
            spec = piece.speculative or spec
            if piece.text:
                yield chunk(piece.text, None)
            if piece.finish is not None:
                yield chunk(None, piece.finish)
        if req.include_usage:
            yield sse.event({**head, "choices": [], "object": obj, "usage": _usage(prompt_tokens, count, spec)})
        yield sse.DONE
    except EngineFailed as exc:
        # The 200 is already sent: the failure arrives as an event carrying the error object.
        yield sse.event(ApiError.engine_failed(str(exc)).body())
        yield sse.DONE
    except EngineStopped as exc:
        yield sse.event(ApiError(503, str(exc)).body())
        yield sse.DONE
    finally:
        await stream.aclose()
