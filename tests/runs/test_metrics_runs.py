"""Prometheus /metrics of a two-stage server (the shared in-process "tiny" server at P = 2, the stages'
figures every second), scraped with prometheus_client's parser while requests run: counters move,
histograms have buckets, the API key is enforced; and file mode's --metrics-port while a run lasts (in
this process, its port closed when the run ends)."""

from __future__ import annotations

import threading
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.serve_cases import NAME
from tests.servers import httpx
from tests.utils import free_port, run_inprocess, write_jsonl


def scrape(url: str, key: str | None = None) -> dict[tuple, float]:
    """{(sample name, sorted labels): value} of every sample."""
    r = httpx.get(url, headers={"Authorization": f"Bearer {key}"} if key else {}, timeout=30)
    assert r.status_code == 200, r.text
    out = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(samples: dict, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


@pytest.fixture(scope="module")
def server(servers):
    return servers.get("tiny", 2)


def test_metrics_move_with_requests(server):
    key = server.key()
    url = server.url("/metrics")
    assert httpx.get(url).status_code == 401  # the key the /v1 routes need
    assert httpx.get(url, headers={"Authorization": "Bearer wrong"}).status_code == 401
    before = scrape(url, key)
    client = server.client(key)
    usage = []
    for i in range(3):
        r = client.completions.create(model=NAME, prompt=f"Counting requests {i}", max_tokens=12, temperature=0)
        usage.append(r.usage)
    chunks = list(client.completions.create(model=NAME, prompt="A streamed answer", max_tokens=16, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    usage.append(chunks[-1].usage)
    time.sleep(1.5)  # a pass after the next --status-interval brings the stages' figures back
    client.completions.create(model=NAME, prompt="one more", max_tokens=4, temperature=0)
    after = scrape(url, key)
    done = value(after, "dist_infer_http_requests_total", endpoint="/v1/completions", status="200") - value(
        before, "dist_infer_http_requests_total", endpoint="/v1/completions", status="200")
    assert done == 5
    assert value(after, "dist_infer_http_requests_total", endpoint="/metrics", status="401") >= 2
    generated = value(after, "dist_infer_generation_tokens_total") - value(before, "dist_infer_generation_tokens_total")
    assert generated >= sum(u.completion_tokens for u in usage)
    assert value(after, "dist_infer_prompt_tokens_total") > value(before, "dist_infer_prompt_tokens_total")
    buckets = [k for k in after if k[0] == "dist_infer_time_to_first_token_seconds_bucket"]
    assert len(buckets) > 5 and value(after, "dist_infer_time_to_first_token_seconds_count") >= 1
    assert value(after, "dist_infer_time_to_first_token_seconds_bucket", le="+Inf") == value(
        after, "dist_infer_time_to_first_token_seconds_count")
    assert value(after, "dist_infer_request_duration_seconds_count") - value(
        before, "dist_infer_request_duration_seconds_count") == 5
    assert value(after, "dist_infer_time_per_output_token_seconds_count") >= 1
    stages = {dict(k[1])["stage"] for k in after if k[0] == "dist_infer_stage_busy_seconds_total"}
    assert stages == {"0", "1"}, after
    assert all(value(after, "dist_infer_stage_peak_memory_bytes", stage=s) > 0 for s in stages)
    assert ("dist_infer_queue_length", ()) in after and ("dist_infer_running_rows", ()) in after
    assert value(after, "dist_infer_prefix_cache_queried_tokens_total") > 0


def test_file_mode_metrics_port(llama_2l, tmp_path):
    """--metrics-port: the status figures as metrics while the run lasts; the port is closed after it."""
    # one row a pass, ~2,000 passes: seconds of running, several status intervals, on any machine (a
    # run shorter than one interval showed no line done before it ended)
    data = write_jsonl(tmp_path / "req.jsonl", [{"prompt": f"Line {i} of a longer file", "max_tokens": 64,
                                                 "temperature": 0} for i in range(32)])
    port = free_port()
    codes: list = []
    run = threading.Thread(target=lambda: codes.append(run_inprocess(
        ["--model-name", llama_2l, "--infer-data", data, "--metrics-port", str(port), "--status-interval", "1",
         "--max-micro-batch-size", "1", "--num-threads", "1", "--no-progress"])), daemon=True)
    run.start()
    seen = []
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and run.is_alive():
        try:
            seen.append(scrape(f"http://127.0.0.1:{port}/metrics"))
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    run.join(120)
    assert codes == [0]
    assert seen, "never scraped"
    done = [value(s, "dist_infer_lines", state="done") for s in seen]
    assert done == sorted(done) and done[-1] > 0
    assert value(seen[-1], "dist_infer_lines", state="total") == 32
    assert any(value(s, "dist_infer_run_state", state="running") == 1 for s in seen)
    with pytest.raises(httpx.HTTPError):  # the run's port is closed with it (a process would have ended)
        httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5)
