"""How long a client refused with 429 (the request queue is full) should wait: Retry-After.

The queue frees one place each time a running request ends. Over the replay ring's recent
finished requests, a request took `service` seconds from admission to its end on average; with
`max_batch` running at once, a place frees about every service / max_batch seconds, and a client
retrying then finds room ahead of the `waiting` requests only once (waiting + 1) places have
freed. That estimate, clamped to 0.25..60 s (the official openai client honours a Retry-After of up
to 60 s and falls back to its own backoff beyond), is sent both as Retry-After (whole seconds,
RFC 9110) and as retry-after-ms (which the openai clients read first, so they need not round up).
"""

from __future__ import annotations

import math

RECENT = 32  # finished requests the estimate averages over
FLOOR_S = 0.25  # never ask for less: a retry sooner mostly meets the same full queue
CEILING_S = 60.0


def retry_after_s(records, waiting: int, max_batch: int) -> float:
    """Seconds to wait, from the replay ring's `records` (oldest first). With no finished request
    to learn from, one second."""
    took = [r.end - r.queued for r in records[-RECENT:]
            if r.end is not None and r.queued is not None and r.end >= r.queued]
    if not took:
        return 1.0
    service = sum(took) / len(took)
    return min(max(service * (waiting + 1) / max(max_batch, 1), FLOOR_S), CEILING_S)


def headers(seconds: float) -> dict[str, str]:
    return {"Retry-After": str(max(1, math.ceil(seconds))), "retry-after-ms": str(max(1, round(seconds * 1000)))}
