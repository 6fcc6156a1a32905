"""The serving benchmark's workloads: prompt texts, the streaming HTTP client and the runs over
HTTP (single stream, 8 streams, long prompts, mixed, traces)."""

from __future__ import annotations

import re

from prompts import PROMPTS  # bench/prompts.py, shared by the benchmarks
from servebench.common import median, ms, pct, progress


# -- prompts ----------------------------------------------------------------------------------


class Words:
    """Prompts of an exact token count: words that are one token each with their leading space."""

    def __init__(self, tokenizer_json: Path):
        from tokenizers import Tokenizer

        self.tok = Tokenizer.from_file(str(tokenizer_json))
        vocab = self.tok.get_vocab()
        self.words = sorted(t[1:] for t in vocab if re.fullmatch(r"Ġ[a-z]{3,9}", t))

    def count(self, text: str) -> int:
        return len(self.tok.encode(text, add_special_tokens=False).ids)

    def text(self, seeds: list[tuple[str, int]]) -> str:
        """Words for each (seed, count) in turn, so equal seed runs give equal text prefixes."""
        import random

        out: list[str] = []
        for seed, n in seeds:
            rng = random.Random(seed)
            out.extend(rng.choice(self.words) for _ in range(n))
        return "".join(" " + w for w in out)

    def exact(self, seed: str, n: int) -> str:
        text = self.text([(seed, n)])
        got = self.count(text)
        if got != n:
            raise RuntimeError(f"a {n}-word prompt is {got} tokens")
        return text


def trace_prompt(words: Words, req: dict, block_tokens: int) -> str:
    """A text prompt of the recorded length; block i's words depend on its digest alone."""
    n = int(req["prompt_tokens"])
    seeds: list[tuple[str, int]] = []
    have = 0
    for digest in req.get("blocks") or ():
        take = min(block_tokens, n - have)
        if take <= 0:
            break
        seeds.append((f"{digest}:{take}", take))
        have += take
    if have < n:
        seeds.append((f"{req.get('id')}:{req['arrival']}:rest", n - have))
    return words.text(seeds)


# -- server processes -------------------------------------------------------------------------


# -- the HTTP client --------------------------------------------------------------------------


class Rec:
    """One streamed request: when it was sent, when each token-bearing chunk came."""

    def __init__(self) -> None:
        self.sent = 0.0
        self.chunks: list[float] = []  # arrival times of chunks carrying text or token ids
        self.tokens = 0
        self.ids: list[int] = []  # token ids, where the server sends them
        self.usage: dict | None = None
        self.error: str | None = None
        self.end = 0.0

    @property
    def ttft(self) -> float | None:
        return self.chunks[0] - self.sent if self.chunks else None

    @property
    def e2e(self) -> float:
        return self.end - self.sent

    @property
    def gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.chunks, self.chunks[1:])]


def body_for(srv: Server, prompt: str, max_tokens: int, sampling: dict | None = None) -> dict:
    s = {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}
    s.update({k: v for k, v in (sampling or {}).items() if v is not None})
    body = {"model": srv.model, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "temperature": s["temperature"], "top_p": s["top_p"], "top_k": s["top_k"], "min_p": s["min_p"]}
    if s.get("seed") is not None:
        body["seed"] = s["seed"]
    if srv.kind == "caldrix":
        body.update(ignore_eos=True, repetition_penalty=s["repetition_penalty"],
                    stream_options={"include_usage": True}, return_token_ids=True)
    else:  # llama-cpp-python: its own names; its defaults are top_k 40 and repeat_penalty 1.1
        body.update(min_tokens=max_tokens, repeat_penalty=s["repetition_penalty"])
    return body


async def stream(client, body: dict, rec: Rec | None = None, on_token=None) -> Rec:
    import httpx
    import orjson
    import trio

    rec = rec or Rec()
    rec.sent = trio.current_time()
    try:
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                await resp.aread()
                rec.error = f"HTTP {resp.status_code}: {resp.text[:200]}"
                return rec
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:].strip()
                if data == "[DONE]":
                    break
                now = trio.current_time()
                chunk = orjson.loads(data)
                if "error" in chunk:
                    rec.error = str(chunk["error"])[:200]
                    break
                if chunk.get("usage"):
                    rec.usage = chunk["usage"]
                for choice in chunk.get("choices") or ():
                    ids = choice.get("token_ids")
                    if choice.get("text") or ids:
                        rec.chunks.append(now)
                        rec.tokens += len(ids) if ids is not None else 1
                        rec.ids.extend(ids or ())
                        if on_token is not None:
                            on_token(rec)
    except httpx.HTTPError as exc:
        rec.error = f"{type(exc).__name__}: {exc}"
    rec.end = trio.current_time()
    if rec.usage and rec.usage.get("completion_tokens") is not None:
        rec.tokens = rec.usage["completion_tokens"]
    return rec


def client_for(srv: Server):
    import httpx

    return httpx.AsyncClient(base_url=srv.url, timeout=httpx.Timeout(900.0, connect=10.0),
                             limits=httpx.Limits(max_connections=32, max_keepalive_connections=32))


def check(recs: list[Rec], want: int | None, what: str) -> None:
    for r in recs:
        if r.error:
            raise RuntimeError(f"{what}: {r.error}")
        if want is not None and r.tokens != want:
            raise RuntimeError(f"{what}: got {r.tokens} tokens, asked for {want}")


# -- workloads over HTTP ----------------------------------------------------------------------


class Plan:
    def __init__(self, quick: bool, words: Words, traces: list[Path]):
        self.quick = quick
        self.tokens = 32 if quick else 128
        self.reps = 1 if quick else 3
        self.single_reps = 1 if quick else 5  # the single stream swings most from run to run
        self.words = words
        self.long = [words.exact(f"long-{i}", 512) for i in range(self.reps)]
        self.warm_long = words.exact("warm-up", 512)
        # The mixed workload runs reps rounds, each with a 512-token prompt of its own: a round's
        # p99 is about its second-worst step (each step's gap lands on all four streams at once),
        # so one round alone swung 1.99-3.25 on one engine (docs/performance-history.md).
        self.mixed_long = [words.exact(f"mixed-long-{i}" if i else "mixed-long", 512) for i in range(self.reps)]
        self.traces = traces
        self.trace_limit = 6 if quick else None


def run_http(srv: Server, plan: Plan, out: dict, *, single_only: bool = False) -> dict:
    """Every workload against srv; the numbers go into `out` as they come (kept on a failure)."""
    import trio

    trio.run(_run_http, srv, plan, out, single_only)
    return out


async def _run_http(srv: Server, plan: Plan, out: dict, single_only: bool) -> None:
    import trio

    n = plan.tokens
    async with client_for(srv) as client:
        progress(f"  {srv.kind}: warm-up")
        check([await stream(client, body_for(srv, "Hello there.", 8))], 8, "warm-up")
        check([await stream(client, body_for(srv, plan.warm_long, 4))], 4, "warm-up")

        progress(f"  {srv.kind}: single stream, {plan.single_reps} x {n} tokens")
        recs = []
        for i in range(plan.single_reps):
            recs.append(await stream(client, body_for(srv, PROMPTS[i], n)))
        check(recs, n, "single stream")
        out["single_runs_tok_s"] = [r.tokens / r.e2e for r in recs]
        out["single_tok_s"] = median(out["single_runs_tok_s"])
        out["single_ids"] = [r.ids for r in recs]
        out["single_best_tok_s"] = max(out["single_runs_tok_s"])
        out["single_ttft_ms"] = ms(median([r.ttft for r in recs]))
        gaps = [g for r in recs for g in r.gaps]
        out["single_itl_p50_ms"], out["single_itl_p99_ms"] = ms(pct(gaps, 0.5)), ms(pct(gaps, 0.99))
        spec = [r.usage["speculative"] for r in recs if r.usage and "speculative" in r.usage]
        if spec:
            out["single_spec_proposed"] = sum(s["proposed"] for s in spec)
            out["single_spec_accepted"] = sum(s["accepted"] for s in spec)
        if single_only:
            return

        progress(f"  {srv.kind}: 8 concurrent streams x {n} tokens")
        recs = [Rec() for _ in range(8)]
        t0 = trio.current_time()
        async with trio.open_nursery() as nursery:
            for i in range(8):
                nursery.start_soon(stream, client, body_for(srv, PROMPTS[i], n), recs[i])
        wall = trio.current_time() - t0
        check(recs, n, "8 streams")
        out["conc8_tok_s"] = sum(r.tokens for r in recs) / wall
        ttfts = [r.ttft for r in recs]
        out["conc8_ttft_p50_ms"], out["conc8_ttft_p99_ms"] = ms(pct(ttfts, 0.5)), ms(pct(ttfts, 0.99))
        gaps = [g for r in recs for g in r.gaps]
        out["conc8_itl_p50_ms"], out["conc8_itl_p99_ms"] = ms(pct(gaps, 0.5)), ms(pct(gaps, 0.99))

        progress(f"  {srv.kind}: 512-token prompt, time to first token, {plan.reps} runs")
        recs = []
        for text in plan.long:
            recs.append(await stream(client, body_for(srv, text, 1)))
        check(recs, 1, "512-token prompt")
        out["ttft512_ms"] = ms(median([r.ttft for r in recs]))
        usage = recs[-1].usage
        if usage:
            out["ttft512_prompt_tokens"] = usage.get("prompt_tokens")

        progress(f"  {srv.kind}: 4 streams x {n} tokens, a 512-token prompt arriving half-way, "
                 f"{len(plan.mixed_long)} round(s)")
        gaps, ratios, long_ttfts = [], [], []
        for long_text in plan.mixed_long:
            runners, long_rec = await mixed_round(client, srv, long_text, n)
            round_gaps = [g for r in runners for g in r.gaps]
            gaps += round_gaps
            ratios.append(pct(round_gaps, 0.99) / pct(round_gaps, 0.5))
            long_ttfts.append(long_rec.ttft)
        p50, p99 = pct(gaps, 0.5), pct(gaps, 0.99)  # pooled over the rounds
        out.update(mix_itl_p50_ms=ms(p50), mix_itl_p99_ms=ms(p99), mix_itl_max_ms=ms(max(gaps)),
                   mix_itl_ratio=p99 / p50 if p50 else None, mix_long_ttft_ms=ms(median(long_ttfts)),
                   mix_itl_ratio_rounds=ratios)

        for path in plan.traces:
            name = path.stem
            progress(f"  {srv.kind}: trace {path.name}")
            t = await replay_trace(client, srv, plan, path)
            out.update({f"trace_{name}_{k}": v for k, v in t.items()})


async def mixed_round(client, srv: Server, long_text: str, n: int) -> tuple[list[Rec], Rec]:
    """4 streams of n tokens; when the first has n // 2, long_text (8 tokens out) arrives."""
    import trio

    runners = [Rec() for _ in range(4)]
    half = trio.Event()
    long_rec = Rec()

    def on_token(rec: Rec) -> None:
        if rec is runners[0] and rec.tokens >= n // 2:
            half.set()

    async def late_long() -> None:
        await half.wait()
        await stream(client, body_for(srv, long_text, 8), long_rec)

    async with trio.open_nursery() as nursery:
        for i in range(4):
            nursery.start_soon(stream, client, body_for(srv, PROMPTS[4 + i], n), runners[i], on_token)
        nursery.start_soon(late_long)
    check(runners, n, "mixed: running streams")
    check([long_rec], 8, "mixed: the 512-token prompt")
    return runners, long_rec


async def replay_trace(client, srv: Server, plan: Plan, path: Path) -> dict:
    import trio

    from caldrix.replay import load_trace

    trace = load_trace(path)
    reqs = list(trace.requests[: plan.trace_limit] if plan.trace_limit else trace.requests)
    bodies = [body_for(srv, trace_prompt(plan.words, r, trace.block_tokens), max(1, int(r["completion_tokens"])),
                       r.get("sampling")) for r in reqs]
    recs = [Rec() for _ in reqs]
    t0 = trio.current_time()
    async with trio.open_nursery() as nursery:
        for req, body, rec in zip(reqs, bodies, recs):
            await trio.sleep_until(t0 + float(req["arrival"]))
            nursery.start_soon(stream, client, body, rec)
    wall = trio.current_time() - t0
    for r, b in zip(recs, bodies):
        check([r], b["max_tokens"], f"trace {path.name}")
    ttft = [r.ttft for r in recs]
    e2e = [r.e2e for r in recs]
    return {"requests": len(recs), "tok_s": sum(r.tokens for r in recs) / wall, "wall_s": wall,
            "ttft_p50_ms": ms(pct(ttft, 0.5)), "ttft_p99_ms": ms(pct(ttft, 0.99)),
            "e2e_p50_ms": ms(pct(e2e, 0.5)), "e2e_p99_ms": ms(pct(e2e, 0.99))}


