"""A stage's forward that raises on one request (issue 37), in serve mode: a Batch API line whose forward
raises fails alone and the server goes on (pipeline.runtime.retry). File mode's retries at every stage
of P = 1, 2, 3, in one process: tests/runs/test_failure_isolation_runs.py; a line that kills an earlier
stage's process: tests/integration/test_reliability.py."""

from __future__ import annotations

import json
import os

import pytest

from tests.utils import REPO

DEFAULT_MODEL = REPO / "examples" / "tiny-llama-default"


@pytest.mark.parametrize("stages", [1, 2])
def test_a_batch_line_whose_forward_raises_fails_alone_and_the_server_goes_on(tmp_path, stages):
    from serve.batches import BatchStore
    from tests.integration.test_serve import Server, wait_batch

    lines = [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
              "body": {"prompt": f"Line {i} is", "max_tokens": 3, "temperature": 0}} for i in range(10)]
    store = BatchStore(tmp_path / "state")  # the batch waits in the folder; the server runs it at start
    f = store.add_file("default", "".join(json.dumps(x) + "\n" for x in lines).encode(), "in.jsonl", "batch")
    bid = store.create_batch("default", {"input_file_id": f["id"], "endpoint": "/v1/completions",
                                         "completion_window": "24h"})["id"]
    s = Server(str(DEFAULT_MODEL), stages, tmp_path / "state", tmp_path / "server.log")
    fault = {"DIST_INFER_FAULT": "forward-raise", "DIST_INFER_FAULT_LINE": "4",
             "DIST_INFER_FAULT_RANK": str(stages - 1), "DIST_INFER_FAULT_PASS": "2"}
    try:
        os.environ.update(fault)  # Server passes os.environ on
        try:
            s.start()
        finally:
            for k in fault:
                os.environ.pop(k)
        client = s.client()
        b = wait_batch(client, bid, timeout=600)
        assert b.status == "completed" and b.request_counts.failed == 1 and b.request_counts.completed == 9
        (bad,) = [json.loads(x) for x in client.files.content(b.error_file_id).text.splitlines()]
        assert bad["custom_id"] == "r4" and "forward raised" in bad["error"]["message"]
        assert client.completions.create(model="tiny", prompt="Hi", max_tokens=2).choices
        assert s.proc.poll() is None
    finally:
        s.kill()
