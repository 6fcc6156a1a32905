"""The engine's two start-up probes: measurements, on the engine's own model and state, of what
its kernels do on this machine, which decide how the engine may be driven: whether prompt
chunks may run beside decode steps, and at which default chunk size (`lanes`), and whether a
verify pass computes its rows as decode steps do (`verify_differs`).

Both write slot 0 only, before the scheduler has admitted anything; Engine.check_lanes and
Engine.check_verify call them, keep the answers and empty the slot's token mirror after. They
use the engine's public parts (model, state, dtype, device, max_threads, decode_hidden,
decode_logits, threads_for).
"""

from __future__ import annotations

import torch

from caldrix.batch import MAX_DRAFT_TOKENS, Run
from caldrix.kernels.packed import split_calls
from caldrix.models.base import Attend

# --prefill-chunk's default: PREFILL_CHUNK_LANES where prompt chunks run beside decode steps
# (Engine.overlap_lanes, probed at that size), else PREFILL_CHUNK. Beside decode steps a longer
# chunk costs the running streams nothing, and prompts go faster: measured on the 2-core AMX
# Xeon, 128 against 512, the 4-bit SmolLM2 through bench/serve.py (512-token TTFT 383 / 285 ms,
# the newcomer beside four streams 777 / 547 ms, those streams' ITL p99 47.9 / 46.7 ms); the
# dense bfloat16 SmolLM2's prompt pass, 512 tokens 235 / 199 ms and 1000 tokens 524 / 470 ms;
# SmolVLM's 877-token text pass 478 / 418 ms, its matmuls 128 rows a call either way
# (packed.CALL_ROWS; a step packs short prompts up to PREFILL_CHUNK tokens all the same:
# runtime.load_runtime). Between decode steps a chunk would stall them four times as long, so
# those engines keep 128.
PREFILL_CHUNK, PREFILL_CHUNK_LANES = 128, 512

# threads_differ probes a prefill chunk of the size `lanes` asks for and an uneven tail.
LANE_PROBE_TAIL = 37
LONG_CHUNK = "prefill chunk"  # names the `chunk`-token chunk in threads_differ's answer (only that one)


def lanes(engine) -> tuple[str | None, int]:
    """(None, the default chunk size) where the engine's steps give the same bits on one thread
    as on `max_threads`, else (why not, PREFILL_CHUNK). Whether a matmul splits its sums by
    thread count is a property of the kernel torch picks for the dtype, shape and CPU (bfloat16
    and the 4-bit kernels keep them whole at the calls the engine makes; float32 dense did on one
    development machine and not on another), so it is measured: threads_differ at a
    PREFILL_CHUNK_LANES-row chunk, then, where only that chunk differed, at PREFILL_CHUNK rows.
    The decoder matmuls' CALL_ROWS pieces stay on only where the lanes overlap: they serve the
    lanes alone (packed.split_calls)."""
    chunk = PREFILL_CHUNK
    if engine.device != "cpu":
        why = "a GPU runs one step at a time"
    elif engine.max_threads < 2:
        why = "one thread: nothing to overlap"
    elif engine.dtype not in (torch.bfloat16, torch.float32):
        why = f"{engine.dtype} is not probed"
    else:
        split_calls(engine.model, True)
        for chunk in (PREFILL_CHUNK_LANES, PREFILL_CHUNK):
            why = threads_differ(engine, chunk)
            if why is None or LONG_CHUNK not in why:
                break
    split_calls(engine.model, why is None)
    return why, chunk if why is None else PREFILL_CHUNK


def threads_differ(engine, chunk: int) -> str | None:
    """Whether the engine's steps give other bits on one thread than on `max_threads`: None if
    they do not, else which step differs and by how much.

    The probe prefills a `chunk`-token chunk and a short one into slot 0, then decodes one row
    after them, on one thread and on all, and compares hidden states and logits bit for bit."""
    n1 = min(chunk, engine.context // 2)
    n2 = min(LANE_PROBE_TAIL, engine.context - n1 - 1)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, engine.vocab_size, (n1 + n2 + 1,), generator=g)
    names = (f"a {n1}-token {LONG_CHUNK}", f"a {n2}-token tail chunk", "a decode step", "a decode step's logits")
    got: dict[int, tuple[torch.Tensor, ...]] = {}
    saved = torch.get_num_threads()
    try:
        for threads in (1, engine.max_threads):
            torch.set_num_threads(threads)
            h1 = engine.model(ids[:n1], Attend("prefill", (0,), torch.arange(n1), torch.arange(n1)), engine.state)
            rows = torch.arange(n1, n1 + n2)
            h2 = engine.model(ids[n1:n1 + n2], Attend("prefill", (0,), rows, rows), engine.state)
            step = [Run(0, n1 + n2, (int(ids[-1]),), (0,))]
            # the hidden rows, then the logits as a decode step makes them (the whole scripted
            # pass where there is one). The second pass computes the same row again: from the
            # state before the first, restored (for attention rows, in place: a no-op).
            before = engine.state.snapshot(0, n1 + n2)
            hidden = engine.decode_hidden(step)
            engine.state.restore(before, 0)
            # Only the probe's own row: padding rows (a padded dense step) carry nothing, and
            # a recurrent model's padding row runs over whatever its scratch slot last held.
            got[threads] = (h1, h2, hidden[:1], engine.decode_logits(step)[0][:1])
    finally:
        torch.set_num_threads(saved)
    for name, one, many in zip(names, got[1], got[engine.max_threads]):
        if not torch.equal(one, many):
            return (f"{name} on 1 thread differs from {engine.max_threads} threads (max difference "
                    f"{(one.float() - many.float()).abs().max().item():.3g})")
    return None


def verify_differs(engine) -> str | None:
    """Whether a speculative verify pass computes any of its rows otherwise than a one-row
    decode step at that position: None if not, else which row and by how much.

    Measured, not assumed: whether a k-row matmul sums each row as a 1-row one does is a
    property of the kernel torch picks for this dtype, device and CPU (on the development
    machine bf16 dense and 4-bit do, float32 dense does not). The probe decodes nine rows one
    step at a time, then recomputes them as one verify pass, at every thread count a decode step
    may get (one, besides the engine's, only where the lanes overlap), and compares the logits
    bit for bit."""
    g = torch.Generator().manual_seed(0)
    vocab = engine.vocab_size
    ids = torch.randint(0, vocab, (6 + 1 + MAX_DRAFT_TOKENS,), generator=g).tolist()
    prompt, rows = ids[:6], ids[6:]
    start = len(prompt)
    saved = torch.get_num_threads()
    why = None
    try:
        torch.set_num_threads(engine.threads_for(0))
        at = torch.arange(start, device=engine.device)
        engine.model(torch.tensor(prompt, device=engine.device), Attend("prefill", (0,), at, at), engine.state)
        one = torch.cat([engine.decode_logits([Run(0, start + i, (t,), (0,))])[0] for i, t in enumerate(rows)])
        # The thread counts a decode step gets: the engine's, and one where the lanes overlap.
        for threads in sorted({engine.threads_for(0)} | ({1} if engine.overlap_lanes else set())):
            torch.set_num_threads(threads)
            run = Run(0, start, tuple(rows), tuple(range(len(rows))), verify=True)
            many = engine.decode_logits([run])[0]
            if not torch.equal(one, many):
                bad = int((one != many).any(dim=-1).nonzero()[0])
                why = (f"a verify pass of {len(rows)} rows on {threads} thread(s) computes row {bad} differently "
                       f"from a one-row step (max logit difference {(one - many).abs().max().item():.3g}), "
                       f"so its picks could differ from plain decoding")
                break
    finally:
        torch.set_num_threads(saved)
    return why
