"""Server-sent event framing."""

from __future__ import annotations

import orjson

DONE = b"data: [DONE]\n\n"


def event(obj: dict) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"
