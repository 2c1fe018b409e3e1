"""A failure stays with its row (issue 37), in serve mode, where only a process shows it: a batch line that
kills the server is answered once it died alone. File mode's and the in-process servers':
tests/runs/test_failure_isolation_runs.py; a line that kills a file run: tests/integration/test_reliability.py."""

from __future__ import annotations

import json
import math
import os
import time

from tests.runs.test_failure_isolation_runs import mistral_model  # noqa: F401 (a fixture)


def test_a_batch_line_that_kills_the_server_is_answered_after_it_died_alone(mistral_model, tmp_path):
    """Each restart on the same --serve-dir resumes the batch; the lines in flight when the server died
    are probed in halves (pipeline/scheduling/isolation.py) until the line that ends the server dies
    alone, within 1 + log2(lines) deaths, and the next start answers it with an error: the batch
    completes (a process of its own: the fault kills it)."""
    from tests.serve_cases import wait_batch
    from tests.servers import ProcessServer

    lines = [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
              "body": {"prompt": f"Line {i} is", "max_tokens": 2, "temperature": 0}} for i in range(12)]
    from tasks.batch_store import BatchStore

    store = BatchStore(tmp_path / "state")  # the batch waits in the folder; each server start runs it
    f = store.add_file("default", "".join(json.dumps(x) + "\n" for x in lines).encode(), "in.jsonl", "batch")
    bid = store.create_batch("default", {"input_file_id": f["id"], "endpoint": "/v1/completions",
                                         "completion_window": "24h"})["id"]
    s = ProcessServer(["--model-name", str(mistral_model)], 1, tmp_path)
    try:
        os.environ.update(DIST_INFER_FAULT="line", DIST_INFER_FAULT_LINE="6")  # ProcessServer passes os.environ on
        deaths, most = 0, 1 + math.ceil(math.log2(len(lines)))
        try:
            while deaths <= most:
                try:
                    s.start()
                except AssertionError:  # it died while starting up: the batch runs at once
                    s.proc.wait()
                deadline = time.monotonic() + 120
                while s.proc.poll() is None and time.monotonic() < deadline:
                    try:
                        if s.client().batches.retrieve(bid).status == "completed":
                            break
                    except Exception:  # the server died under the request
                        pass
                    time.sleep(0.3)
                if s.proc.poll() is None:
                    break
                deaths += 1
        finally:
            os.environ.pop("DIST_INFER_FAULT")
            os.environ.pop("DIST_INFER_FAULT_LINE")
        assert 2 <= deaths <= most, deaths  # in a batch, ..., alone
        b = wait_batch(s.client(), bid)
        assert b.status == "completed" and b.request_counts.failed == 1 and b.request_counts.completed == 11, \
            (b.errors, [x for x in s.log.read_text().splitlines() if "batch" in x or "earlier run" in x][-30:])
        (bad,) = [json.loads(x) for x in s.client().files.content(b.error_file_id).text.splitlines()]
        assert bad["custom_id"] == "r6" and "when the process ended" in bad["error"]["message"]
    finally:
        s.kill()
