"""The server's settings, parsed from the command line into one frozen record. No I/O here."""

from __future__ import annotations

import attrs

from caldrix.protocol import SamplingParams

DEFAULT_PORT = 8425


class FlagError(ValueError):
    """A flag whose value this server cannot honour, found after parsing (exit status 2)."""


@attrs.frozen
class ServeConfig:
    model: str | None = None  # None: the embedded default
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    served_name: str | None = None
    backend: str = "auto"  # auto | cpu | cuda | hip | host
    dtype: str = "auto"
    weights: str = "auto"  # auto: keep a GGUF's Q4_1 blocks 4-bit where the engine can; dense; q4 (runtime._quantize)
    context: int | None = None  # None: the model's maximum, capped at 8192
    max_batch: int = 1  # the CLI resolves its default from the lane (lanes.default_max_batch)
    queue_depth: int = 64
    # The server's sampling defaults; seed None draws fresh entropy per request.
    sampling: SamplingParams = SamplingParams()
    seed: int | None = None
    prefill_chunk: int | None = None  # None: the engine's default (Engine.default_prefill_chunk)
    replay_ring: int = 256
    log_level: str = "info"
    graceful_timeout: float = 30.0
    # Speculative decoding (http-api.md): off | ngram | draft | auto.
    speculate: str = "off"
    draft: str | None = None
    draft_tokens: int | None = None  # None: tuned live
    ngram: tuple[int, int] = (2, 4)
    speculation_memory: str | None = None
    # The GPU lanes (lanes.py): where sampled tokens are picked, and --weight-budget in bytes.
    sampler: str = "device"  # device | host; the device pick runs only where lanes.uses_device_pick
    weight_budget: int | None = None
    # Browser origins allowed besides this machine's own pages (routes/origins.py); "*": any.
    allowed_origins: tuple[str, ...] = ()
