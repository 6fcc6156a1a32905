"""`caldrix replay TRACE --url URL`: send a trace's workload again and measure it.

A trace (GET /debug/trace, telemetry.py) keeps no text: each request has its arrival offset, its
prompt and reply lengths, its sampling settings and the salted digests of its prompt blocks.
Replay rebuilds a prompt of token ids of the same length in which each block is drawn from a
generator seeded by that block's digest, so two requests that shared a prefix share the same
synthetic prefix, and requests that did not, do not. Each goes to /v1/completions with
ignore_eos and max_tokens set to the recorded reply length, streamed, at its recorded offset
(divided by --speed); --concurrency caps the requests in flight, delaying arrivals past it.

Printed: time to first token and end-to-end latency (p50, p90, p99), per-request decode rate,
and the throughput over the whole replay.
"""

from __future__ import annotations

import logging
import math
import random
import sys
from pathlib import Path
from typing import Iterable

import attrs
import orjson
import trio

DEFAULT_URL = "http://127.0.0.1:8425"
TOKEN_LO = 1000  # synthetic prompt ids stay clear of a vocabulary's special tokens at the start
TOKEN_HI = 32000  # and under the vocabulary size when the trace does not give it


# Bounds of what a trace may ask for, checked when it is read, before any request is sent: a
# hostile or damaged file must not make replay build a 10**12-token prompt or wait for ever.
MAX_TRACE_TOKENS = 2**20  # prompt or reply tokens of one request
MAX_ARRIVAL_S = 7 * 24 * 3600.0  # a week of recorded traffic
MAX_BLOCK_TOKENS = 4096


class TraceError(ValueError):
    """The file is not a caldrix trace."""


def _count(value, at: str, key: str, lo: int, hi: int) -> int:
    """A whole number in [lo, hi] (a float that is whole is taken: JSON writers differ)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (
            isinstance(value, float) and not value.is_integer()):
        raise TraceError(f"{at}: {key} must be a whole number, got {orjson.dumps(value).decode()[:40]}")
    if not lo <= value <= hi:
        shown = int(value) if abs(value) < 1e18 else value  # whole: an integer, unrounded
        raise TraceError(f"{at}: {key} must be {lo} to {hi}, got {shown}")
    return int(value)


def _check_request(line: dict, at: str) -> None:
    arrival = line.get("arrival")
    if isinstance(arrival, bool) or not isinstance(arrival, (int, float)):
        raise TraceError(f"{at}: arrival is missing" if arrival is None else f"{at}: arrival must be a number")
    if not 0 <= arrival <= MAX_ARRIVAL_S:  # NaN fails both
        raise TraceError(f"{at}: arrival must be 0 to {MAX_ARRIVAL_S:.0f} seconds, got {arrival}")
    for key, lo in (("prompt_tokens", 1), ("completion_tokens", 0)):
        if key not in line:
            raise TraceError(f"{at}: {key} is missing")
        _count(line[key], at, key, lo, MAX_TRACE_TOKENS)
    blocks = line.get("blocks")
    if blocks is not None and not (isinstance(blocks, list) and all(isinstance(b, str) for b in blocks)):
        raise TraceError(f"{at}: blocks must be a list of digests (strings)")
    sampling = line.get("sampling")
    if sampling is not None and not isinstance(sampling, dict):
        raise TraceError(f"{at}: sampling must be an object")


def _check_header(header: dict, at: str) -> None:
    from caldrix.telemetry import TRACE_VERSION

    version = header.get("version", TRACE_VERSION)
    if version != TRACE_VERSION or isinstance(version, bool):
        raise TraceError(f"{at}: trace version {orjson.dumps(version).decode()[:20]}; this caldrix reads "
                         f"version {TRACE_VERSION}")
    if "block_tokens" in header:
        _count(header["block_tokens"], at, "block_tokens", 1, MAX_BLOCK_TOKENS)
    if header.get("vocab_size") is not None:
        _count(header["vocab_size"], at, "vocab_size", 2, 2**31)


@attrs.frozen
class Trace:
    header: dict
    requests: tuple[dict, ...]

    @property
    def block_tokens(self) -> int:
        return int(self.header.get("block_tokens", 16))


def load_trace(path: str | Path) -> Trace:
    header: dict = {}
    reqs: list[dict] = []
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                line = orjson.loads(raw)
            except orjson.JSONDecodeError as exc:
                raise TraceError(f"{path}:{n}: not JSON: {exc}") from None
            if not isinstance(line, dict):
                raise TraceError(f"{path}:{n}: a line must be an object")
            if line.get("trace") == "caldrix":
                _check_header(line, f"{path}:{n}")
                header = line
                continue
            _check_request(line, f"{path}:{n}")
            reqs.append(line)
    if not header:  # an empty file, or JSON lines of something else
        raise TraceError(f'{path}: not a caldrix trace: no header line ({{"trace": "caldrix", ...}}, '
                         "as GET /debug/trace exports)")
    reqs.sort(key=lambda r: r["arrival"])
    return Trace(header, tuple(reqs))


def synthetic_prompt(req: dict, block_tokens: int, vocab_size: int | None = None) -> list[int]:
    """Token ids of the recorded prompt length; block i is a function of digest i alone."""
    hi = min(TOKEN_HI, vocab_size) if vocab_size else TOKEN_HI
    lo = TOKEN_LO if hi > 2 * TOKEN_LO else 0  # a small vocabulary (a test model's) is used whole
    n = int(req["prompt_tokens"])
    ids: list[int] = []
    for i, digest in enumerate(req.get("blocks") or ()):
        take = min(block_tokens, n - len(ids))
        if take <= 0:
            break
        rng = random.Random(f"{digest}:{take}")
        ids.extend(rng.randrange(lo, hi) for _ in range(take))
    if len(ids) < n:  # no digests (a trace from elsewhere): an unshared prompt
        rng = random.Random(f"{req.get('id')}:{req['arrival']}:rest")
        ids.extend(rng.randrange(lo, hi) for _ in range(n - len(ids)))
    return ids


def request_body(req: dict, model: str, block_tokens: int, vocab_size: int | None) -> dict:
    body = {
        "model": model,
        "prompt": synthetic_prompt(req, block_tokens, vocab_size),
        # A reply of 0 tokens (end of sequence at once, or refused) is replayed as one token.
        "max_tokens": max(1, int(req["completion_tokens"])),
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
    }
    for key, value in (req.get("sampling") or {}).items():
        if key in ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "seed") and value is not None:
            body[key] = value
    return body


@attrs.frozen
class Result:
    index: int
    status: int  # 0: no answer (connection failed)
    late: float  # seconds the send started after its scheduled arrival
    ttft: float | None
    e2e: float | None
    tokens: int
    error: str | None = None


def percentile(values: list[float], q: float) -> float | None:
    """Linear interpolation between closest ranks, as numpy's default."""
    if not values:
        return None
    xs = sorted(values)
    k = (len(xs) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def base_url(url: str) -> str:
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


async def replay(trace: Trace, url: str = DEFAULT_URL, *, concurrency: int | None = None, speed: float = 1.0,
                 timeout: float = 600.0) -> tuple[list[Result], float]:
    """Send the trace; returns each request's result (in trace order) and the wall time."""
    import httpx

    url = base_url(url)
    n = len(trace.requests)
    limit = concurrency or max(1, n)
    results: list[Result | None] = [None] * n
    limiter = trio.CapacityLimiter(limit)
    vocab = trace.header.get("vocab_size")
    limits = httpx.Limits(max_connections=limit, max_keepalive_connections=limit)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(timeout, connect=10.0), limits=limits) as client:
        models = await client.get("/v1/models")
        models.raise_for_status()
        model = models.json()["data"][0]["id"]
        bodies = [request_body(r, model, trace.block_tokens, vocab) for r in trace.requests]

        async def one(i: int, due: float) -> None:
            async with limiter:
                results[i] = await _send(client, i, bodies[i], due)

        t0 = trio.current_time()
        async with trio.open_nursery() as nursery:
            for i, req in enumerate(trace.requests):
                due = t0 + float(req["arrival"]) / speed
                await trio.sleep_until(due)
                nursery.start_soon(one, i, due)
        wall = trio.current_time() - t0
    return [r for r in results if r is not None], wall


async def _send(client, i: int, body: dict, due: float) -> Result:
    import httpx

    start = trio.current_time()
    late = max(0.0, start - due)
    ttft = None
    tokens = 0
    usage = None
    try:
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                await resp.aread()
                return Result(i, resp.status_code, late, None, None, 0, _error_message(resp.content))
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                chunk = orjson.loads(data)
                if "error" in chunk:
                    return Result(i, 200, late, ttft, trio.current_time() - start, tokens, chunk["error"].get("message"))
                if chunk.get("usage"):
                    usage = chunk["usage"]
                for choice in chunk.get("choices", ()):
                    got = len(choice.get("token_ids") or ())
                    if got and ttft is None:
                        ttft = trio.current_time() - start
                    tokens += got
    except httpx.HTTPError as exc:
        return Result(i, 0, late, ttft, None, tokens, f"{type(exc).__name__}: {exc}")
    if usage is not None:
        tokens = usage.get("completion_tokens", tokens)
    return Result(i, 200, late, ttft, trio.current_time() - start, tokens)


def _error_message(content: bytes) -> str:
    try:
        return orjson.loads(content)["error"]["message"]
    except Exception:
        return content[:200].decode("utf-8", "replace")


def summarize(results: Iterable[Result], wall: float) -> dict:
    results = list(results)
    ok = [r for r in results if r.status == 200 and r.error is None]
    statuses: dict[str, int] = {}
    for r in results:
        statuses[str(r.status)] = statuses.get(str(r.status), 0) + 1
    ttft = [r.ttft for r in ok if r.ttft is not None]
    e2e = [r.e2e for r in ok if r.e2e is not None]
    rate = [(r.tokens - 1) / (r.e2e - r.ttft) for r in ok
            if r.tokens > 1 and r.ttft is not None and r.e2e is not None and r.e2e > r.ttft]
    tokens = sum(r.tokens for r in ok)

    def pct(xs):
        return {f"p{int(q * 100)}": percentile(xs, q) for q in (0.5, 0.9, 0.99)}

    return {
        "requests": len(results),
        "ok": len(ok),
        "statuses": statuses,
        "wall_s": wall,
        "output_tokens": tokens,
        "throughput_tokens_per_s": tokens / wall if wall > 0 else None,
        "throughput_requests_per_s": len(ok) / wall if wall > 0 else None,
        "ttft_s": pct(ttft),
        "e2e_s": pct(e2e),
        "decode_tokens_per_s": pct(rate),
        "max_late_s": max((r.late for r in results), default=0.0),
    }


def format_summary(s: dict, source: str, url: str) -> str:
    def f(v, unit):
        return "-" if v is None else (f"{v * 1000:.1f} ms" if unit == "s" else f"{v:.1f}")

    lines = [
        f"caldrix replay: {s['requests']} requests from {source} against {url}: {s['ok']} ok"
        + "".join(f", {n} x {code}" for code, n in sorted(s["statuses"].items()) if code != "200")
        + f", {s['wall_s']:.2f} s",
        f"{'':16}{'p50':>12}{'p90':>12}{'p99':>12}",
    ]
    for name, key, unit in (("ttft", "ttft_s", "s"), ("e2e", "e2e_s", "s"), ("decode tok/s", "decode_tokens_per_s", "")):
        row = s[key]
        lines.append(f"{name:16}" + "".join(f"{f(row[p], unit):>12}" for p in ("p50", "p90", "p99")))
    tps, rps = s["throughput_tokens_per_s"], s["throughput_requests_per_s"]
    lines.append(f"throughput: {s['output_tokens']} output tokens, "
                 f"{'-' if tps is None else f'{tps:.1f}'} tokens/s, {'-' if rps is None else f'{rps:.2f}'} requests/s"
                 + (f"; arrivals up to {s['max_late_s'] * 1000:.0f} ms late (--concurrency)" if s["max_late_s"] > 0.05 else ""))
    return "\n".join(lines)


def main(path: str, url: str = DEFAULT_URL, *, concurrency: int | None = None, speed: float = 1.0,
         limit: int | None = None, as_json: bool = False) -> int:
    """The command: 0 when the server answered, 1 when it could not be reached, 2 on a bad trace."""
    try:
        import httpx
    except ImportError:
        print("caldrix: replay needs httpx (pip install httpx)", file=sys.stderr)
        return 1
    try:
        trace = load_trace(path)
    except (OSError, TraceError) as exc:
        print(f"caldrix: {exc}", file=sys.stderr)
        return 2
    if limit is not None:
        trace = Trace(trace.header, trace.requests[:limit])
    try:
        parsed = httpx.URL(base_url(url))
        if parsed.scheme not in ("http", "https") or not parsed.host:
            raise ValueError("it needs http:// or https:// and a host")
    except (httpx.InvalidURL, TypeError, ValueError) as exc:
        print(f"caldrix: --url {url!r} is not a URL: {exc}", file=sys.stderr)
        return 2
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
    try:
        try:
            results, wall = trio.run(lambda: replay(trace, url, concurrency=concurrency, speed=speed))
        except BaseExceptionGroup as group:  # trio hands Ctrl-C and errors back from its nursery
            interrupt, rest = group.split(KeyboardInterrupt)
            if interrupt is not None and rest is None:
                raise KeyboardInterrupt from None
            http, rest = group.split(httpx.HTTPError)
            if http is not None and rest is None:
                raise http.exceptions[0] from None
            raise
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except (httpx.HTTPError, httpx.InvalidURL) as exc:
        print(f"caldrix: cannot reach {url}: {exc}", file=sys.stderr)
        return 1
    summary = summarize(results, wall)
    if as_json:
        print(orjson.dumps(summary).decode())
    else:
        print(format_summary(summary, path, base_url(url)))
    return 0
