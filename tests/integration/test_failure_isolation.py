"""A failure stays with its row (issue 37), in serve mode: the server answers each bad request 400 and
goes on; a Batch API batch with bad lines completes with an error file, one that cannot run fails with
its partial output, and a batch line that kills the server is answered after two restarts. File
mode's: tests/runs/test_failure_isolation_runs.py (in one process) and tests/integration/test_reliability.py
(a line that kills its process)."""

from __future__ import annotations

import json
import os
import time

import pytest

from tests.runs.test_failure_isolation_runs import BAD, CHAT_BAD, mistral_model, mixed_lines  # noqa: F401 (a fixture)


# -- serve mode ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(mistral_model, tmp_path_factory):
    from tests.integration.test_serve import Server

    folder = tmp_path_factory.mktemp("isolation")
    s = Server(str(mistral_model), 1, folder / "state", folder / "server.log")
    s.start()
    yield s
    s.kill()


def test_the_server_answers_each_bad_request_400_and_goes_on(server):
    from tests.integration.test_serve import KEY, httpx

    headers = {"Authorization": f"Bearer {KEY}"}
    for body, param in BAD:
        r = httpx.post(server.url("/v1/completions"), json=dict(body, max_tokens=2), headers=headers, timeout=120)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    for messages in CHAT_BAD:
        r = httpx.post(server.url("/v1/chat/completions"), json={"messages": messages, "max_tokens": 2},
                       headers=headers, timeout=120)
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
    r = httpx.post(server.url("/v1/chat/completions"), headers=headers, timeout=120,
                   json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] is not None
    assert server.proc.poll() is None


def test_a_batch_with_bad_lines_completes_with_an_error_file_and_a_restart_works(server):
    from tests.integration.test_serve import wait_batch

    client = server.client()
    lines, errors = mixed_lines(30, chat_only=True)
    f = client.files.create(file=("in.jsonl", "".join(json.dumps(x) + "\n" for x in lines).encode()), purpose="batch")
    b = wait_batch(client, client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                                 completion_window="24h").id)
    assert b.status == "completed" and b.request_counts.failed == len(errors) and b.request_counts.completed == 30
    bad = [json.loads(x) for x in client.files.content(b.error_file_id).text.splitlines()]
    assert sorted(x["custom_id"] for x in bad) == sorted(lines[i]["custom_id"] for i in errors)
    server.kill()
    # while it is down, a batch is left in progress whose input file is gone
    from serve.batches import BatchStore

    store = BatchStore(server.serve_dir)
    line = {"custom_id": "x", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x", "max_tokens": 1}}
    f2 = store.add_file("default", (json.dumps(line) + "\n").encode(), "in2.jsonl", "batch")
    b2 = store.create_batch("default", {"input_file_id": f2["id"], "endpoint": "/v1/completions",
                                        "completion_window": "24h"})
    (server.serve_dir / "files" / f2["id"]).unlink()
    server.start()  # the same --serve-dir: every batch keeps its state, the broken one fails
    client = server.client()
    b2 = wait_batch(client, b2["id"])
    assert b2.status == "failed" and "input file" in b2.errors.data[0].message
    assert client.batches.retrieve(b.id).status == "completed"
    assert client.completions.create(model="tiny", prompt="Hi", max_tokens=1).choices
    server.kill()
    server.start()  # and again, with a failed batch in the folder
    assert server.client().batches.retrieve(b2.id).status == "failed"


def test_a_batch_line_that_kills_the_server_is_answered_after_two_restarts(mistral_model, tmp_path):
    """Each restart on the same --serve-dir resumes the batch; the line that ends the server is run
    alone after the first crash and answered with an error after the second: the batch completes."""
    from tests.integration.test_serve import Server, wait_batch

    lines = [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
              "body": {"prompt": f"Line {i} is", "max_tokens": 2, "temperature": 0}} for i in range(12)]
    from serve.batches import BatchStore

    store = BatchStore(tmp_path / "state")  # the batch waits in the folder; each server start runs it
    f = store.add_file("default", "".join(json.dumps(x) + "\n" for x in lines).encode(), "in.jsonl", "batch")
    bid = store.create_batch("default", {"input_file_id": f["id"], "endpoint": "/v1/completions",
                                         "completion_window": "24h"})["id"]
    s = Server(str(mistral_model), 1, tmp_path / "state", tmp_path / "server.log")
    try:
        os.environ.update(DIST_INFER_FAULT="line", DIST_INFER_FAULT_LINE="6")  # Server passes os.environ on
        deaths = 0
        try:
            while deaths < 4:
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
        assert deaths == 2
        b = wait_batch(s.client(), bid)
        assert b.status == "completed" and b.request_counts.failed == 1 and b.request_counts.completed == 11
        (bad,) = [json.loads(x) for x in s.client().files.content(b.error_file_id).text.splitlines()]
        assert bad["custom_id"] == "r6" and "when the process ended" in bad["error"]["message"]
    finally:
        s.kill()
