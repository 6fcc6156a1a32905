"""Shared by the engine tests: drive the real scheduler and engine, and a plain reference."""

from __future__ import annotations

import torch
import trio

from caldrix.protocol import EmbedSpan, FinishReason, SamplingParams, Submission
from caldrix.sched.loop import Scheduler
from caldrix.sched.policy import Policy
from caldrix.sched.slots import SlotTable


def generate(engine, prompts: list[tuple[int, ...]], max_tokens: int, *, together: bool, chunk: int = 16,
             stop: frozenset[int] = frozenset(), sampling: list[SamplingParams] | None = None,
             embeds: list[tuple[EmbedSpan, ...]] | None = None) -> list[list[int]]:
    """Replies through the real scheduler and engine (steps run inline, no thread); greedy
    unless `sampling` gives each prompt its settings; `embeds`, each prompt's input embedding
    spans (the engine holds the rows)."""
    sampling = sampling or [SamplingParams()] * len(prompts)
    embeds = embeds or [()] * len(prompts)

    async def inline(fn, batch):
        await trio.lowlevel.checkpoint()
        return fn(batch)

    async def one_batch(group, params, spans):
        sched = Scheduler(engine, Policy(_slots(engine), chunk=chunk, prefill_budget=chunk), run_step=inline)
        tx, rx = trio.open_memory_channel(len(group))
        streams = []
        for i, (ids, sp, es) in enumerate(zip(group, params, spans)):
            etx, erx = trio.open_memory_channel(max_tokens + 1)
            tx.send_nowait(Submission(f"r{i}", ids, max_tokens, sp, stop, etx, embeds=es))
            streams.append(erx)
        replies = []
        async with trio.open_nursery() as nursery:
            nursery.start_soon(sched.run, rx)
            for erx in streams:
                events = [e async for e in erx]
                assert events[-1].finish in (FinishReason.LENGTH, FinishReason.STOP)
                replies.append([e.token_id for e in events if e.token_id is not None])
            await tx.aclose()
        return replies

    if together:
        return trio.run(one_batch, prompts, sampling, embeds)
    return [trio.run(one_batch, [p], [sp], [es])[0] for p, sp, es in zip(prompts, sampling, embeds)]


def _slots(engine) -> SlotTable:
    """The slot table the server gives this engine: reuse of held rows as its model allows."""
    return SlotTable(engine.max_batch, reuse_rows=getattr(engine, "reuses_rows", True))


def generate_in_turn(engine, prompts: list[tuple[int, ...]], max_tokens: int, *, chunk: int = 128
                     ) -> list[tuple[list[int], int]]:
    """Greedy replies through one scheduler, one prompt after another, so a later prompt can
    reuse rows an earlier one left in its slot: (reply, prefix rows reused) for each."""

    async def inline(fn, batch):
        await trio.lowlevel.checkpoint()
        return fn(batch)

    async def main():
        sched = Scheduler(engine, Policy(_slots(engine), chunk=chunk, prefill_budget=chunk), run_step=inline)
        tx, rx = trio.open_memory_channel(1)
        out = []
        async with trio.open_nursery() as nursery:
            nursery.start_soon(sched.run, rx)
            for i, ids in enumerate(prompts):
                etx, erx = trio.open_memory_channel(max_tokens + 1)
                await tx.send(Submission(f"t{i}", ids, max_tokens, SamplingParams(), frozenset(), etx))
                events = [e async for e in erx]
                out.append(([e.token_id for e in events if e.token_id is not None], events[-1].prefix_rows))
            await tx.aclose()
        return out

    return trio.run(main)


def hf_greedy(model, ids: tuple[int, ...], n: int) -> list[int]:
    """Plain greedy decoding with the transformers model: arg-max n times, no logits processors
    (generate() would suppress EOS under min_new_tokens)."""
    from transformers import DynamicCache

    cache, out, step = DynamicCache(), [], list(ids)
    with torch.inference_mode():
        for _ in range(n):
            logits = model(input_ids=torch.tensor([step]), past_key_values=cache, use_cache=True).logits
            token = int(logits[0, -1].argmax())
            out.append(token)
            step = [token]
    return out


def prefill(model, ids: torch.Tensor, *, slots: int = 1, rows: int = 64, dtype=torch.bfloat16):
    """A model-level prompt pass: `ids` prefilled as one chunk into each of `slots` fresh slots
    of a new KVCache of `rows` rows. Returns ([hidden [T, D] per slot], the cache)."""
    from caldrix.models.base import Attend, KVCache

    model.setup_rope(rows)
    kv = KVCache(model.cfg, slots, rows, dtype, "cpu")
    at = torch.arange(len(ids))
    with torch.inference_mode():
        return [model(ids, Attend("prefill", (s,), at, at), kv) for s in range(slots)], kv
