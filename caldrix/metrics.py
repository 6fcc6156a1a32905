"""The Prometheus collectors of one server, and their rendering for GET /metrics.

Names follow vLLM's set (shared/research/peers.md, section 3) under a `caldrix:` prefix, so a
dashboard written for vLLM reads caldrix by changing the prefix. Every series carries the
`model_name` label, as vLLM's do.

Each server owns a CollectorRegistry of its own (never prometheus_client's global one), so
several servers can live in one process. Who updates what:

- the telemetry hook (telemetry.py, called synchronously from the scheduler's on_finish and
  from the routes) observes the latency histograms and moves the token and finish counters;
- the app's after_request hook counts responses by handler, method and status, and refusals;
- the running, waiting and KV-slot gauges are read at scrape time from Scheduler.statistics()
  and the request channel's statistics(), by a collector of their own: nothing keeps a copy;
- the process_* series (memory, CPU time, fds) are prometheus_client's ProcessCollector's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

if TYPE_CHECKING:
    from caldrix.sched.loop import SchedStats

PREFIX = "caldrix:"

# vLLM's bucket sets (vllm/v1/metrics/loggers.py), so histograms line up with its dashboards.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
# vLLM starts at 10 ms; a small model on a CPU decodes faster than that, so two finer buckets lead.
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
               2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                   120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
# Queue, prefill and decode times are often far under 0.3 s here: finer buckets at the bottom.
PHASE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25) + REQUEST_BUCKETS
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000)

# Response status -> requests_rejected_total{reason}, for the routes that generate (GENERATING).
REJECT_REASONS = {400: "invalid", 413: "too_large", 429: "queue_full", 503: "unavailable"}
GENERATING = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/systemone"})
# The method label's values: the methods of RFC 9110 and PATCH; any other (a client may send any
# token as a method) is counted as "other", so no client can add series or text to /metrics.
METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "DELETE", "CONNECT", "OPTIONS", "TRACE", "PATCH"})


class _Live:
    """Scrape-time gauges: calls `read()` during collect, so the values are never stale."""

    def __init__(self, model_name: str, read: Callable[[], "SchedStats | None"]):
        self.model_name = model_name
        self.read = read

    def collect(self):
        stats = self.read()
        if stats is None:
            return
        labels = ["model_name"]
        value = [self.model_name]

        def gauge(name: str, doc: str, v: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(PREFIX + name, doc, labels=labels)
            g.add_metric(value, v)
            return g

        slots = stats.running + stats.free_slots
        yield gauge("num_requests_running", "Requests holding a KV slot (being prefilled or decoded).", stats.running)
        yield gauge("num_requests_waiting", "Requests queued for a KV slot (at most --queue-depth).", stats.waiting)
        yield gauge("kv_cache_usage_perc", "Fraction of KV slots in use, 0 to 1.", stats.running / slots if slots else 0.0)
        yield gauge("num_kv_slots", "KV slots (--max-batch), each holding --context rows.", slots)
        yield gauge("kv_cache_held_rows", "Prompt rows kept in free slots for prefix reuse.", stats.held_rows)
        yield gauge("num_kept_states", "States kept for the later prompts of a /v1/systemone request (a lease), "
                    "until the scheduler drops them.", stats.kept_states)
        steps = CounterMetricFamily(PREFIX + "engine_steps", "Forward passes (scheduler steps) run.", labels=labels)
        steps.add_metric(value, stats.steps)
        yield steps


class _Images:
    """Scrape-time gauges of the image decode limiter (caldrix/vision/limiter.py)."""

    def __init__(self, model_name: str, read: Callable[[], tuple[int, int]]):
        self.model_name = model_name
        self.read = read

    def collect(self):
        decoding, waiting = self.read()
        for name, doc, v in (("num_images_decoding", "Requests decoding images now (at most 2).", decoding),
                             ("num_images_waiting", "Image requests waiting for a decode slot (at most --queue-depth).",
                              waiting)):
            g = GaugeMetricFamily(PREFIX + name, doc, labels=["model_name"])
            g.add_metric([self.model_name], v)
            yield g


class Metrics:
    """The collectors of one server. Update methods are plain calls, from the trio thread."""

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None):
        self.model_name = model_name
        self.registry = registry if registry is not None else CollectorRegistry()
        self._read_live: Callable[[], object] = lambda: None
        reg = self.registry
        m = ["model_name"]

        def hist(name, doc, buckets):
            return Histogram(PREFIX + name, doc, m, buckets=buckets, registry=reg).labels(model_name)

        def count(name, doc):
            return Counter(PREFIX + name, doc, m, registry=reg).labels(model_name)

        self.ttft = hist("time_to_first_token_seconds", "Arrival to first reply token.", TTFT_BUCKETS)
        self.itl = hist("inter_token_latency_seconds", "Time between consecutive reply tokens of a request.", ITL_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "Arrival to the end of the request.", REQUEST_BUCKETS)
        self.queue_time = hist("request_queue_time_seconds", "Arrival to admission into a KV slot.", PHASE_BUCKETS)
        self.prefill_time = hist("request_prefill_time_seconds", "Admission to first reply token.", PHASE_BUCKETS)
        self.decode_time = hist("request_decode_time_seconds", "First reply token to the end of the request.", PHASE_BUCKETS)
        self.prompt_size = hist("request_prompt_tokens", "Prompt tokens per request.", TOKEN_BUCKETS)
        self.reply_size = hist("request_generation_tokens", "Reply tokens generated per request.", TOKEN_BUCKETS)
        self.prompt_tokens = count("prompt_tokens", "Prompt tokens of admitted requests.")
        self.generation_tokens = count("generation_tokens", "Reply tokens generated.")
        self.prefix_queries = count("prefix_cache_queries", "Prompt tokens looked up in the held KV rows (prompt tokens of admitted requests).")
        self.prefix_hits = count("prefix_cache_hits", "Prompt rows reused from a held KV slot instead of being recomputed.")
        # vLLM's spec_decode_num_draft_tokens / num_accepted_tokens, counted when a request ends
        self.spec_drafts = count("spec_decode_num_draft_tokens", "Speculative guesses proposed (n-gram lookup or draft model), over ended requests.")
        self.spec_accepted = count("spec_decode_num_accepted_tokens", "Speculative guesses the model confirmed, over ended requests.")
        self._success = Counter(PREFIX + "request_success", "Requests that reached the scheduler, by finish reason.",
                                m + ["finished_reason"], registry=reg)
        self._http = Counter(PREFIX + "http_requests", "HTTP responses by route, method and status code.",
                             m + ["handler", "method", "status"], registry=reg)
        self._rejected = Counter(PREFIX + "requests_rejected", "Requests refused before generating (400, 413, 429, 503).",
                                 m + ["reason"], registry=reg)
        for reason in ("stop", "length", "abort", "error"):  # present at zero from the start
            self._success.labels(model_name, reason)
        for reason in REJECT_REASONS.values():
            self._rejected.labels(model_name, reason)
        reg.register(_Live(model_name, lambda: self._read_live()))
        if registry is None:
            # The process_* series a default prometheus_client registry has (resident memory,
            # CPU seconds, open fds), as vLLM's /metrics does; unprefixed and unlabelled there too.
            # Several servers in one process (tests) each report the same process.
            ProcessCollector(registry=reg)

    def read_live_from(self, read: Callable[[], object]) -> None:
        """Where the scrape-time gauges come from: a callable returning SchedStats (or None)."""
        self._read_live = read

    def finished(self, reason: str) -> None:
        self._success.labels(self.model_name, reason).inc()

    def response(self, handler: str, method: str, status: int) -> None:
        """Count a response. `handler` is a route's rule or "unmatched" (a bounded set); a refusal
        counts in requests_rejected_total only on a generating route (not a /healthz 503 or a
        /debug 400)."""
        self._http.labels(self.model_name, handler, method if method in METHODS else "other", str(status)).inc()
        reason = REJECT_REASONS.get(status)
        if reason is not None and handler in GENERATING:
            self._rejected.labels(self.model_name, reason).inc()

    def read_images_from(self, read: Callable[[], tuple[int, int]]) -> None:
        """A vision server's image decode limiter, read at scrape time: `read()` gives (requests
        decoding images now, image requests waiting for a decode slot)."""
        self.registry.register(_Images(self.model_name, read))

    def render(self) -> bytes:
        return generate_latest(self.registry)


# The text format 0.0.4 that the body is written in (every name here is a classic one), pinned:
# prometheus_client's CONTENT_TYPE_LATEST says version=1.0.0 from 0.22 on, so the header would
# change with the installed version while the body does not.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
