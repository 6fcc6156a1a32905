"""How long a client refused with 429 should wait: Retry-After.

Either queue (the request queue, the image decode queue) frees one place each time a request it
serves lets go. Over its recent requests, one held a place `service` seconds on average; with
`parallel` served at once (--max-batch, or the 2 decode slots), a place frees about every
service / parallel seconds, and a client retrying then finds room ahead of the `waiting`
requests only once (waiting + 1) places have freed. That estimate, clamped to 0.25..60 s (the
official openai client honours a Retry-After of up to 60 s and falls back to its own backoff
beyond), is sent both as Retry-After (whole seconds, RFC 9110) and as retry-after-ms (which the
openai clients read first, so they need not round up).
"""

from __future__ import annotations

import math

RECENT = 32  # finished requests the estimate averages over
FLOOR_S = 0.25  # never ask for less: a retry sooner mostly meets the same full queue
CEILING_S = 60.0


def retry_after_s(records, waiting: int, max_batch: int) -> float:
    """Seconds to wait for the request queue, from the replay ring's `records` (oldest first):
    each finished request's time from admission to its end."""
    took = [r.end - r.queued for r in records[-RECENT:]
            if r.end is not None and r.queued is not None and r.end >= r.queued]
    return estimate(took, waiting, max_batch)


def estimate(took, waiting: int, parallel: int) -> float:
    """Seconds to wait, from the last RECENT of `took` (seconds each recent request held a place,
    oldest first). With none to learn from, one second."""
    took = list(took)[-RECENT:]
    if not took:
        return 1.0
    service = sum(took) / len(took)
    return min(max(service * (waiting + 1) / max(parallel, 1), FLOOR_S), CEILING_S)


def headers(seconds: float) -> dict[str, str]:
    return {"Retry-After": str(max(1, math.ceil(seconds))), "retry-after-ms": str(max(1, round(seconds * 1000)))}
