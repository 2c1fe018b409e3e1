"""``--metrics-port``: a file-mode run's status (tasks.status) as Prometheus metrics, read from
:meth:`RunStatus.snapshot` at each scrape so that they always agree with the status file.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from tasks.status import RunStatus

STATES = ("loading", "running", "finished", "stopped", "failed")


class StatusCollector:
    """A custom collector over one run's status."""

    def __init__(self, status: RunStatus):
        self.status = status

    def collect(self) -> Iterator[Metric]:
        s = self.status.snapshot()
        state = GaugeMetricFamily("dist_infer_run_state", "1 for the run's current state", labels=["state"])
        for name in STATES:
            state.add_metric([name], 1.0 if s["state"].split(":")[0] == name else 0.0)
        yield state
        lines = GaugeMetricFamily("dist_infer_lines", "Request lines of the run's input files", labels=["state"])
        lines.add_metric(["total"], s["lines_total"])
        lines.add_metric(["done"], s["lines_done"])
        yield lines
        for name, key, text in (("dist_infer_request_errors", "errors", "Error lines written"),
                                ("dist_infer_prompt_tokens", "prompt_tokens", "Prompt tokens of answered requests"),
                                ("dist_infer_generation_tokens", "generated_tokens", "Tokens generated"),
                                ("dist_infer_prefix_cache_hit_tokens", "cached_prompt_tokens",
                                 "Prompt tokens served by the prefix cache")):
            yield CounterMetricFamily(name, text, value=s[key])
        yield GaugeMetricFamily("dist_infer_generation_tokens_per_second",
                                "Generated tokens per second over the last minute",
                                value=s["generated_tokens_per_second_last_minute"] or 0.0)
        if s["eta_seconds"] is not None:
            yield GaugeMetricFamily("dist_infer_eta_seconds", "Estimated seconds until the run ends",
                                    value=s["eta_seconds"])
        yield from stage_metrics(s["stages"])


def stage_metrics(stages: list[dict]) -> Iterator[Metric]:
    """Per-stage busy ratio, KV cells and peak memory (labelled ``stage``)."""
    busy = GaugeMetricFamily("dist_infer_stage_busy_ratio", "Share of the wall time a stage computed",
                             labels=["stage"])
    cells = GaugeMetricFamily("dist_infer_kv_cache_cells", "KV-cache token positions a stage holds",
                              labels=["stage"])
    memory = GaugeMetricFamily("dist_infer_stage_peak_memory_bytes",
                               "A stage's peak memory (resident set on CPU, allocated on CUDA)", labels=["stage"])
    for s in stages:
        busy.add_metric([str(s["stage"])], s["busy_fraction"])
        cells.add_metric([str(s["stage"])], s["kv_cells"])
        memory.add_metric([str(s["stage"])], s["peak_memory_mb"] * 2**20)
    yield busy
    yield cells
    yield memory
