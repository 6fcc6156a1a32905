"""`caldrix run`: one generation through the same scheduler and engine as the server."""

from __future__ import annotations

import secrets
import sys

import attrs
import trio

from caldrix.config import ServeConfig
from caldrix.generate import EngineFailed, GenRequest, pieces, submit
from caldrix.request_queue import RequestQueue


def run_once(cfg: ServeConfig, prompt: str, *, chat: bool, max_tokens: int | None, stops: tuple[str, ...], ignore_eos: bool) -> int:
    from caldrix.runtime import load_runtime
    from caldrix.sched.threads import StepThread

    with StepThread("caldrix load") as loader:  # its OpenMP team ends with it (sched/threads.py)
        rt = loader.call(load_runtime, cfg)
    for note in rt.notes:  # what serve says among its start-up lines (auto's fallbacks among them)
        print(f"caldrix: note: {note}", file=sys.stderr)
    tok = rt.tokenizer
    if chat:
        if not tok.has_chat_template:
            print("caldrix: this model has no chat template; run without --chat", file=sys.stderr)
            return 2
        ids = tuple(tok.render_chat([{"role": "user", "content": prompt}]))
    else:
        ids = tuple(tok.encode(prompt))
    if not ids:
        print("caldrix: the prompt is empty", file=sys.stderr)
        return 2
    room = rt.context - len(ids)
    if room < 1:
        print(f"caldrix: the prompt is {len(ids)} tokens; the context holds {rt.context}", file=sys.stderr)
        return 2
    seed = cfg.seed if cfg.seed is not None else secrets.randbits(63)
    req = GenRequest(
        request_id="run-1",
        prompt_ids=ids,
        max_tokens=min(max_tokens or room, room),
        sampling=attrs.evolve(cfg.sampling, seed=seed),
        stop_token_ids=frozenset() if ignore_eos else tok.eos_token_ids,
        stops=stops,
    )

    async def main() -> int:
        queue, rx = RequestQueue.open(1)
        async with trio.open_nursery() as nursery:
            await nursery.start(rt.scheduler.run, rx)
            async with queue.tx:
                events = submit(queue, req)
                spec = None
                try:
                    async for piece in pieces(events, tok, stops, prompt_ids=ids):
                        sys.stdout.write(piece.text)
                        sys.stdout.flush()
                        spec = piece.speculative or spec
                except EngineFailed as exc:
                    print(f"\ncaldrix: engine failure: {exc}", file=sys.stderr)
                    return 1
        sys.stdout.write("\n")
        if spec is not None:
            print(f"caldrix: speculative: {spec[1]} of {spec[0]} guesses kept", file=sys.stderr)
        return 0

    return trio.run(main)
