"""serve.metrics and tasks.status_exporter without a server: names, labels, the busy ratio from per-stage figures."""

from __future__ import annotations

import time
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from serve.metrics import ServeMetrics
from tasks.status_exporter import StatusCollector
from tasks.status import RunStatus


def samples(text: bytes) -> dict:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text.decode()) for s in f.samples}


def test_serve_metrics_figures():
    m = ServeMetrics()
    m.on_stats([[1.0, 100, 50.0], [2.0, 80, 60.0]])
    time.sleep(0.05)
    m.on_stats([[1.02, 120, 50.0], [0.01, 90, 60.0]])  # stage 1's count restarted (a batch file opened)
    m.set_load(3, 7, 2, 40, 100)
    started = time.monotonic() - 0.2
    m.first_token(started)
    m.answered(started, {"prompt_tokens": 5, "completion_tokens": 4}, first_at=started + 0.1)
    m.requests.labels("/v1/completions", "200").inc()
    s = samples(m.text())
    assert s[("dist_infer_queue_length", ())] == 3 and s[("dist_infer_running_rows", ())] == 7
    assert s[("dist_infer_prefix_cache_hit_tokens_total", ())] == 40
    assert s[("dist_infer_kv_cache_cells", (("stage", "0"),))] == 120
    assert abs(s[("dist_infer_stage_busy_seconds_total", (("stage", "0"),))] - 1.02) < 1e-9
    assert abs(s[("dist_infer_stage_busy_seconds_total", (("stage", "1"),))] - 2.01) < 1e-9
    assert 0 < s[("dist_infer_stage_busy_ratio", (("stage", "0"),))] <= 1
    assert s[("dist_infer_prompt_tokens_total", ())] == 5 and s[("dist_infer_generation_tokens_total", ())] == 4
    assert s[("dist_infer_time_to_first_token_seconds_count", ())] == 1
    assert s[("dist_infer_time_per_output_token_seconds_count", ())] == 1
    assert s[("dist_infer_http_requests_total", (("endpoint", "/v1/completions"), ("status", "200")))] == 1


def test_status_collector(tmp_path):
    from prometheus_client import CollectorRegistry, generate_latest

    status = RunStatus(tmp_path / "s.json", {}, [("a", "oa", 4)], 1.0, 1)
    status.open_file("a", "oa", 4, 0)
    status.progress(3, 0, 30, 0, 12, [[0.1, 64, 5.0]])
    registry = CollectorRegistry()
    registry.register(StatusCollector(status))
    s = samples(generate_latest(registry))
    assert s[("dist_infer_lines", (("state", "done"),))] == 3 and s[("dist_infer_lines", (("state", "total"),))] == 4
    assert s[("dist_infer_run_state", (("state", "running"),))] == 1
    assert s[("dist_infer_generation_tokens_total", ())] == 12
    assert s[("dist_infer_stage_peak_memory_bytes", (("stage", "0"),))] == 5.0 * 2**20
    status.finish("stopped")  # a run stopped with a file open: that state, not none of them
    s = samples(generate_latest(registry))
    assert [st for (name, labels), v in s.items() if name == "dist_infer_run_state" and v for _, st in labels] == ["stopped"]


def test_each_data_groups_writer_serves_metrics_on_a_port_of_its_own(tmp_path):
    """--metrics-port PORT with --data-group-size 2: group d's on PORT + d (both on PORT: the second rank's
    'Address already in use' ended the run)."""
    from pipeline.config.options import parse_options
    from pipeline.runtime.monitor import start_metrics, stop_metrics
    from tests.utils import free_port

    port = free_port()
    opts = parse_options(["--metrics-port", str(port)])
    servers = []
    try:
        for d in (0, 1):
            status = RunStatus(tmp_path / f"s{d}.json", {"data_rank": d}, [("a", f"o{d}", 4 + d)], 1.0, 1)
            servers.append(start_metrics(opts, status))
        for d in (0, 1):
            with urllib.request.urlopen(f"http://127.0.0.1:{port + d}/metrics", timeout=10) as r:
                assert samples(r.read())[("dist_infer_lines", (("state", "total"),))] == 4 + d
    finally:
        for server in servers:
            stop_metrics(server)
