"""Prometheus metrics of the server at ``GET /metrics`` (behind the API key, as ``/v1``): HTTP requests
by route template and status, the scheduler's load, answered requests' tokens and latencies, request
fields refused or ignored, the prefix cache, and per-stage figures. docs/usage/monitoring.md lists them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from starlette.routing import Match

from tasks.fields import KNOWN
from tasks.status_exporter import stage_metrics

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class ServeMetrics:
    """The server's registry; the HTTP thread counts requests, the pipeline thread the rest."""

    def __init__(self):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("dist_infer_http_requests", "HTTP requests by endpoint and status",
                                ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("dist_infer_prompt_tokens", "Prompt tokens of answered requests", registry=r)
        self.generation_tokens = Counter("dist_infer_generation_tokens", "Tokens generated for answered requests",
                                         registry=r)
        self.ttft = Histogram("dist_infer_time_to_first_token_seconds", "Streams: submission to the first text",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("dist_infer_time_per_output_token_seconds",
                              "Streams: seconds per generated token after the first", buckets=TOKEN_BUCKETS,
                              registry=r)
        self.duration = Histogram("dist_infer_request_duration_seconds", "Completions: submission to answer",
                                  buckets=LATENCY_BUCKETS, registry=r)
        self.busy_seconds = Counter("dist_infer_stage_busy_seconds", "Seconds a stage computed", ["stage"],
                                    registry=r)
        self.request_fields = Counter("dist_infer_request_fields", "Request fields refused or ignored (unknown, or "
                                      "not implemented with the value given)", ["field", "outcome"], registry=r)
        self.lock = threading.Lock()
        self.load = {"queue": 0, "rows": 0, "live": 0, "hit": 0, "queried": 0}
        self.stages: list[dict] = []
        self._last: list[tuple[float, float]] = []  # per stage (time, busy seconds) of the previous figures
        r.register(self)  # collect(): the load and the stages' figures, read at each scrape

    def text(self) -> bytes:
        return generate_latest(self.registry)

    def fields(self, names: list[str], outcome: str) -> None:
        """Request fields the server did not take: ``refused`` or ``ignored`` (--lenient-fields); a name no
        table knows counts as ``unknown``, so clients cannot add series without bound (the answer names it)."""
        for name in names:
            self.request_fields.labels(name if name in KNOWN else "unknown", outcome).inc()

    # -- the pipeline thread ----------------------------------------------------------------------
    def set_load(self, queue: int, rows: int, live: int, hit_tokens: int, queried_tokens: int) -> None:
        with self.lock:
            self.load = {"queue": queue, "rows": rows, "live": live, "hit": hit_tokens, "queried": queried_tokens}

    def on_stats(self, stats: list[list[float]]) -> None:
        """A pass's per-stage [busy seconds since the stage's figures restarted, KV cells, peak MiB]."""
        now = time.monotonic()
        figures = []
        for i, (busy, cells, peak) in enumerate(stats):
            then, before = self._last[i] if i < len(self._last) else (None, 0.0)
            delta = busy - before if busy >= before else busy  # a batch file's OpenFile restarted the count
            self.busy_seconds.labels(str(i)).inc(max(0.0, delta))
            ratio = min(1.0, delta / (now - then)) if then is not None and now > then else 0.0
            figures.append({"stage": i, "busy_fraction": round(max(0.0, ratio), 4), "kv_cells": int(cells),
                            "peak_memory_mb": peak})
        self._last = [(now, s[0]) for s in stats]
        with self.lock:
            self.stages = figures

    def idle(self, kv_cells: int) -> None:
        """Nothing runs: every stage busy 0 and holding ``kv_cells`` (the prefix pool: every stage holds the
        same micro-batches and pool, and the micro-batches went with the engine's Release)."""
        with self.lock:
            self.stages = [dict(s, busy_fraction=0.0, kv_cells=kv_cells) for s in self.stages]

    def answered(self, started: float, usage: dict | None, first_at: float | None = None) -> None:
        now = time.monotonic()
        self.duration.observe(now - started)
        if usage:
            self.tokens(usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0))
            later = usage.get("completion_tokens", 0) - 1
            if first_at is not None and later > 0:
                self.tpot.observe((now - first_at) / later)

    def first_token(self, started: float) -> None:
        self.ttft.observe(time.monotonic() - started)

    def tokens(self, prompt: int, generated: int) -> None:
        self.prompt_tokens.inc(prompt)
        self.generation_tokens.inc(generated)

    def collect(self) -> Iterator[Metric]:
        with self.lock:
            load, stages = dict(self.load), list(self.stages)
        yield GaugeMetricFamily("dist_infer_queue_length", "Prompt groups waiting for the scheduler",
                                value=load["queue"])
        yield GaugeMetricFamily("dist_infer_running_rows", "Micro-batch rows computing", value=load["rows"])
        yield GaugeMetricFamily("dist_infer_live_requests", "Interactive requests in the pipeline", value=load["live"])
        yield CounterMetricFamily("dist_infer_prefix_cache_hit_tokens", "Prompt tokens served by the prefix cache",
                                  value=load["hit"])
        yield CounterMetricFamily("dist_infer_prefix_cache_queried_tokens", "Prompt tokens looked up in the prefix cache",
                                  value=load["queried"])
        yield from stage_metrics(stages)


def endpoint_of(app, scope) -> str:
    """The route template a request matched (bounded label values), else ``other``."""
    for route in app.router.routes:
        match, _ = route.matches(scope)
        if match == Match.FULL:
            return getattr(route, "path", "other")
    return "other"


class CountRequests:
    """ASGI middleware, outermost: counts every HTTP request by endpoint and final status."""

    def __init__(self, app, metrics: ServeMetrics, routes):
        self.app, self.metrics, self.routes = app, metrics, routes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = [500]

        async def watched(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, watched)
        finally:
            self.metrics.requests.labels(endpoint_of(self.routes, scope), str(status[0])).inc()
