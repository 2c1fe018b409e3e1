"""The Batch API over HTTP with the `openai` package at P = 1 and P = 2: files and batches in a key's own
namespace, answers equal to file mode's, a bad line in the error file, one endpoint per batch, cancel; on
the shared in-process "tiny" servers (each test with a key of its own). A batch across a restart of its
server (resumed from its journal; failed with its answered lines under other settings) on servers of their
own; across a SIGKILL: tests/integration/test_serve_processes.py."""

from __future__ import annotations

import json
import re

import openai
import pytest

from tests.serve_cases import (CHAT_LINE, as_lines, batch_bodies, batch_lines, jsonl_bytes, wait_batch,
                               wait_completed)
from tests.servers import LocalServer
from tests.utils import assert_consistent_results, assert_identical_results, read_jsonl, run_local


@pytest.fixture(scope="module", params=[1, 2], ids=["P1", "P2"])
def server(request, servers):
    return servers.get("tiny", request.param)


@pytest.fixture
def client(server):
    return server.client(server.key())


def test_batch_api(server, client, serve_reference):
    f = client.files.create(file=("in.jsonl", jsonl_bytes(batch_lines())), purpose="batch")
    assert f.id.startswith("file-") and client.files.retrieve(f.id).bytes == f.bytes
    assert not list(server.serve_dir.rglob("in.jsonl"))  # kept under its id, never the client's name
    batch = client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
    assert batch.request_counts.total == len(batch_lines())
    done = wait_batch(client, batch.id)
    assert done.status == "completed" and done.request_counts.completed == len(batch_lines()) - 1
    assert done.request_counts.failed == 1
    out = batch_bodies(client.files.content(done.output_file_id).text)
    errs = batch_bodies(client.files.content(done.error_file_id).text)
    assert set(errs) == {"bad"} and set(out) == {x["custom_id"] for x in batch_lines()} - {"bad"}
    ref = {x["custom_id"]: x for x in serve_reference[1]}
    ids = sorted(out)
    assert_consistent_results(as_lines([{"choices": out[i]["response"]["body"]["choices"]} for i in ids]),
                              as_lines([{"choices": ref[i]["response"]["body"]["choices"]} for i in ids]))
    assert batch.id in [b.id for b in client.batches.list()]
    listed = [x.id for x in client.files.list(purpose="batch")]
    assert f.id in listed and done.output_file_id not in listed
    assert done.output_file_id in [x.id for x in client.files.list()]
    assert client.files.delete(f.id).deleted
    assert f.id not in [x.id for x in client.files.list()]
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(f.id)
    chat = client.files.create(file=("chat.jsonl", jsonl_bytes([CHAT_LINE])), purpose="batch")
    with pytest.raises(openai.BadRequestError, match="differs from the batch's endpoint"):
        client.batches.create(input_file_id=chat.id, endpoint="/v1/completions", completion_window="24h")
    done = wait_batch(client, client.batches.create(input_file_id=chat.id, endpoint="/v1/chat/completions",
                                                    completion_window="24h").id)
    got = batch_bodies(client.files.content(done.output_file_id).text)["chat"]["response"]["body"]["choices"]
    assert_consistent_results(as_lines([{"choices": got}]),
                              as_lines([{"choices": ref["chat"]["response"]["body"]["choices"]}]))


def test_keys_see_only_their_own_files_and_batches(server, client):
    """Another key's ids answer 404, as ids that do not exist; its lists hold none of them."""
    f = client.files.create(file=("mine.jsonl", jsonl_bytes(batch_lines())), purpose="batch")
    done = wait_batch(client, client.batches.create(input_file_id=f.id, endpoint="/v1/completions",
                                                    completion_window="24h").id)
    other = server.client(server.key())
    for call in (lambda: other.files.retrieve(f.id), lambda: other.files.content(done.output_file_id),
                 lambda: other.batches.retrieve(done.id), lambda: other.files.delete(f.id)):
        with pytest.raises(openai.NotFoundError):
            call()
    assert not other.files.list().data and not other.batches.list().data
    assert client.files.retrieve(f.id).id == f.id  # still there for its owner


def test_batch_cancel(client):
    lines = batch_lines(extra=200)
    f = client.files.create(file=("c.jsonl", jsonl_bytes(lines)), purpose="batch")
    batch = client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
    with pytest.raises(openai.BadRequestError) as e:  # a restart would resume from it
        client.files.delete(f.id)
    assert "has not finished" in e.value.response.json()["error"]["message"]  # the server's words, not openai's
    assert client.batches.cancel(batch.id).status in ("cancelling", "cancelled", "completed")
    done = wait_batch(client, batch.id)
    assert done.status in ("cancelled", "completed")
    if done.status == "cancelled":
        out = batch_bodies(client.files.content(done.output_file_id).text)
        assert len(out) < len(lines) and done.request_counts.completed == len(out)


# -- across a restart: servers of their own ---------------------------------------------------------
@pytest.fixture
def own_server(make_llama, tmp_path):
    """Micro-batches of 4 rows: most of a batch's lines wait in the queue, not in flight, when it stops."""
    s = LocalServer(["--model-name", make_llama(num_hidden_layers=2), "--max-micro-batch-size", "4"], tmp_path,
                    stages=2, name="restarted")
    yield s
    s.stop(check=False)


def _start_long_batch(client, answered: int):
    lines = batch_lines(extra=60)
    f = client.files.create(file=("big.jsonl", jsonl_bytes(lines)), purpose="batch")
    batch = client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
    assert wait_completed(client, batch.id, answered) < len(lines)
    return batch, lines


def test_batch_resumes_after_a_restart(own_server):
    """P = 2, stopped (as by SIGTERM) mid-batch and started again on its --serve-dir: the batch resumes from its
    journal and every line is answered exactly once (a SIGKILL: tests/integration/test_serve_processes.py)."""
    key = own_server.key()
    batch, lines = _start_long_batch(own_server.start().client(key), 10)
    mark = own_server.log.mark()
    own_server.restart()
    client = own_server.client(key)
    done = wait_batch(client, batch.id)
    assert done.status == "completed", done
    resumed = re.search(r"resuming after (\d+) answered requests", own_server.log.since(mark))
    assert resumed and 10 <= int(resumed.group(1)) < len(lines), own_server.log.since(mark)
    out = batch_bodies(client.files.content(done.output_file_id).text)
    errs = batch_bodies(client.files.content(done.error_file_id).text)
    assert sorted([*out, *errs]) == sorted(x["custom_id"] for x in lines) and set(errs) == {"bad"}
    assert done.request_counts.completed == len(lines) - 1


@pytest.mark.parametrize("invariant", [False, True], ids=["default", "batch-invariant"])
def test_a_batch_stopped_mid_generation_resumes_its_rows(own_server, make_llama, tmp_path, invariant):
    """Stopped (as by SIGTERM) while its rows generate, a batch's rows in flight are checkpointed, and the
    next start on the same --serve-dir resumes them where they stopped: each line as an uninterrupted
    file-mode run answers it (tokens; logprobs within float rounding: docs/usage/recovery.md); under
    --batch-invariant byte for byte, logprobs too."""
    if invariant:
        own_server.args = [*own_server.args, "--batch-invariant"]
    lines = [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
              "body": {"prompt": f"Once upon a time {i}", "max_tokens": 60, "temperature": 0 if i % 2 else 0.8,
                       "seed": i, "logprobs": 1}} for i in range(16)]
    key = own_server.key()
    client = own_server.start().client(key)
    f = client.files.create(file=("long.jsonl", jsonl_bytes(lines)), purpose="batch")
    batch = client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
    assert wait_completed(client, batch.id, 2) < len(lines)
    mark = own_server.log.mark()
    own_server.restart()
    client = own_server.client(key)
    done = wait_batch(client, batch.id)
    assert done.status == "completed" and done.request_counts.completed == len(lines), done
    assert "rows where they stopped" in own_server.log.since(mark), own_server.log.since(mark)
    got = batch_bodies(client.files.content(done.output_file_id).text)
    src = tmp_path / "long.jsonl"
    src.write_bytes(jsonl_bytes(lines))
    p = run_local([*own_server.args, "--infer-data", str(src), "--output-path", str(tmp_path / "ref.jsonl"),
                   "--no-progress"], 2)
    assert p.returncode == 0, p.stderr[-3000:]
    ref = {x["custom_id"]: x for x in read_jsonl(tmp_path / "ref.jsonl")}
    want = [{"request": x["body"], "result": ref[x["custom_id"]]["response"]["body"]} for x in lines]
    have = [{"request": x["body"], "result": got[x["custom_id"]]["response"]["body"]} for x in lines]
    if invariant:
        assert_identical_results(want, have)
    else:
        assert_consistent_results(want, have, tol=1e-3)


def test_restart_with_another_seed_delivers_the_answered_lines(own_server):
    """Started again with another --seed: the batch fails with the lines it answered in its output file and the
    others listed in its error file; no server path shown."""
    key = own_server.key()
    batch, lines = _start_long_batch(own_server.start().client(key), 5)
    own_server.restart([*own_server.args, "--seed", "7"])
    client = own_server.client(key)
    done = wait_batch(client, batch.id)
    assert done.status == "failed", done
    message = done.errors.data[0].message
    assert "other settings" in message and str(own_server.folder) not in message and "/" not in message
    out = batch_bodies(client.files.content(done.output_file_id).text)
    errs = batch_bodies(client.files.content(done.error_file_id).text)
    assert out and sorted([*out, *errs]) == sorted(x["custom_id"] for x in lines)
    assert errs[lines[-1]["custom_id"]]["error"]["code"] == "batch_failed"
    assert done.request_counts.completed == len(out) and done.request_counts.failed == len(errs)
    assert json.loads(json.dumps(done.model_dump()))["status"] == "failed"
