"""Stops that lose nothing (issue 55), in one process: a cancelled batch ends within a pass whatever its
size (queued lines never start, rows in flight stop, what was answered is delivered, the rest listed as
cancelled), and a server that goes idle frees its micro-batches on every stage (/metrics at rest)."""

from __future__ import annotations

import json
import time

import pytest

from tests.runs.test_every_source import Server

try:
    import httpx
except ImportError:
    import httpx2 as httpx


def upload_batch(server: Server, lines: list[dict]) -> str:
    fid = httpx.post(server.url("/v1/files"), data={"purpose": "batch"}, timeout=60,
                     files={"file": ("b.jsonl", "".join(json.dumps(x) + "\n" for x in lines))}).json()["id"]
    return httpx.post(server.url("/v1/batches"), json={"input_file_id": fid, "endpoint": "/v1/completions",
                                                      "completion_window": "24h"}, timeout=60).json()["id"]


def wait_status(server: Server, bid: str, want: str, seconds: float = 60) -> dict:
    deadline = time.monotonic() + seconds
    while (b := httpx.get(server.url(f"/v1/batches/{bid}"), timeout=60).json())["status"] != want:
        assert time.monotonic() < deadline, b
        time.sleep(0.05)
    return b


def lines_of(server: Server, fid: str | None) -> list[dict]:
    if fid is None:
        return []
    return [json.loads(x) for x in httpx.get(server.url(f"/v1/files/{fid}/content"), timeout=60).text.splitlines()]


@pytest.mark.parametrize("stages", [1, 2])
@pytest.mark.parametrize("size", [40, 300])
def test_a_cancelled_batch_ends_at_once_with_what_it_answered(tmp_path, stages, size):
    server = Server(stages, tmp_path)
    try:
        lines = [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
                  "body": {"prompt": f"Once upon a time {i}", "max_tokens": 200, "temperature": 0}}
                 for i in range(size)]
        bid = upload_batch(server, lines)
        wait_status(server, bid, "in_progress")
        t0 = time.monotonic()
        assert httpx.post(server.url(f"/v1/batches/{bid}/cancel"), timeout=60).json()["status"] == "cancelling"
        b = wait_status(server, bid, "cancelled")
        took = time.monotonic() - t0
        ok, bad = lines_of(server, b.get("output_file_id")), lines_of(server, b.get("error_file_id"))
        assert sorted(x["custom_id"] for x in ok + bad) == sorted(f"r{i}" for i in range(size))  # each once
        assert len(ok) < size and {x["error"]["code"] for x in bad} == {"batch_cancelled"}
        assert b["request_counts"]["completed"] == len(ok) and b["request_counts"]["failed"] == len(bad)
        # rows in flight stop: far sooner than the 200 tokens each of the lines read would take
        assert took < 30, took
        # the server goes on: a live request is answered, and once idle every stage holds no micro-batch
        r = httpx.post(server.url("/v1/completions"), json={"prompt": "Hello", "max_tokens": 3}, timeout=60)
        assert r.status_code == 200
        time.sleep(0.5)
        text = httpx.get(server.url("/metrics"), timeout=60).text
        running = [line for line in text.splitlines() if line.startswith("dist_infer_running_rows")]
        assert running and all(line.endswith(" 0.0") for line in running), running
    finally:
        server.close()
