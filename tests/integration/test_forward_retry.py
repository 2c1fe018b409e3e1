"""A stage's forward that raises on one request (issue 37): the run goes on. The failed pass comes back
round the ring as a message, rank 0 computes its groups again one at a time, the group that fails alone
is answered with an error line and every other line as a clean run answers it, in one run, at any stage
of P = 1, 2, 3 and in serve mode (pipeline.runtime.retry). The fault: ``DIST_INFER_FAULT=forward-raise``
(comm.faults) makes a stage's forward raise whenever it computes the rows of line
``DIST_INFER_FAULT_LINE``, from its ``DIST_INFER_FAULT_PASS``-th such pass on (> 1: while it decodes)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.utils import REPO, assert_identical_results, read_jsonl, run_single, run_torchrun

DEFAULT_MODEL = REPO / "examples" / "tiny-llama-default"
CULPRIT = 6


def requests() -> list[dict]:
    """Generation with mixed lengths and seeds, best_of, n, echo scoring: what a pass can hold."""
    reqs = [{"prompt": f"Request {i}: the garden behind the house is", "max_tokens": 2 + i % 5,
             "temperature": 0.7 if i % 2 else 0, "seed": i} for i in range(16)]
    reqs[3].update(best_of=2, n=1, logprobs=2)
    reqs[9].update(n=2, temperature=0.9)
    reqs[11].update(echo=True, logprobs=1, max_tokens=0)
    return reqs


def _write(path: Path, lines: list[dict]) -> Path:
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


@pytest.fixture(scope="module")
def clean(tmp_path_factory) -> tuple[Path, list[dict]]:
    """The input and a clean run's answers (--batch-invariant: the same for every P and neighbour)."""
    d = tmp_path_factory.mktemp("retry")
    src = _write(d / "in.jsonl", requests())
    out = d / "clean.jsonl"
    p = run_single(["--model-name", str(DEFAULT_MODEL), "--infer-data", str(src), "--output-path", str(out),
                    "--no-progress", "--batch-invariant", "--max-micro-batch-size", "4"], timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    return src, read_jsonl(out)


@pytest.mark.parametrize("stages,rank,from_pass", [(1, 0, 1), (2, 1, 3), (3, 0, 1), (3, 1, 3), (3, 2, 2)])
def test_a_forward_raising_on_one_request_is_retried_row_by_row_in_the_same_run(clean, tmp_path, stages, rank,
                                                                                 from_pass):
    src, ref = clean
    out = tmp_path / "out.jsonl"
    args = ["--model-name", str(DEFAULT_MODEL), "--infer-data", str(src), "--output-path", str(out),
            "--no-progress", "--batch-invariant", "--max-micro-batch-size", "4"]
    fault = {"DIST_INFER_FAULT": "forward-raise", "DIST_INFER_FAULT_LINE": str(CULPRIT),
             "DIST_INFER_FAULT_RANK": str(rank), "DIST_INFER_FAULT_PASS": str(from_pass)}
    p = run_single(args, env=fault, timeout=600) if stages == 1 else run_torchrun(args, stages, env=fault, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "computing its groups again one at a time" in p.stderr
    got = read_jsonl(out)
    assert [i for i, x in enumerate(got) if "error" in x] == [CULPRIT]
    err = got[CULPRIT]["error"]
    assert err["type"] == "server_error" and "forward raised while computing this request alone" in err["message"]
    assert "injected fault" in err["message"]
    keep = [i for i in range(len(ref)) if i != CULPRIT]
    assert_identical_results([got[i] for i in keep], [ref[i] for i in keep])
    summary = json.loads((tmp_path / "out.jsonl.summary.json").read_text())
    assert summary["errors"] == 1 and summary["error_kinds"] == {"computation": 1}
    assert not (tmp_path / "out.jsonl.partial.inflight").exists()


def test_with_the_prefix_cache_and_chunked_prefill(tmp_path):
    """A failed pass may hold prompts that load or save prefix pool blocks and chunks of long prompts:
    the retry computes each prompt from its first token, rank 0 forgets the pool, and every other line
    is answered (P = 2, the culprit's forward raising on the first stage while it decodes)."""
    shared = "The committee met on a grey morning to discuss the budget for the coming year, and " * 3
    reqs = [{"prompt": shared + f"item {i} was", "max_tokens": 3 + i % 3, "temperature": 0} for i in range(12)]
    src = _write(tmp_path / "in.jsonl", reqs)
    out = tmp_path / "out.jsonl"
    args = ["--model-name", str(DEFAULT_MODEL), "--infer-data", str(src), "--output-path", str(out), "--no-progress",
            "--max-micro-batch-size", "4", "--prefix-cache", "on", "--prefix-block-size", "16", "--prefill-chunk", "16"]
    fault = {"DIST_INFER_FAULT": "forward-raise", "DIST_INFER_FAULT_LINE": "5", "DIST_INFER_FAULT_RANK": "0",
             "DIST_INFER_FAULT_PASS": "2"}
    p = run_torchrun(args, 2, env=fault, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    got = read_jsonl(out)
    assert [i for i, x in enumerate(got) if "error" in x] == [5]
    assert all(x["result"]["choices"][0]["text"] is not None for i, x in enumerate(got) if i != 5)
    assert all(x["result"]["usage"]["completion_tokens"] >= 1 for i, x in enumerate(got) if i != 5)


@pytest.mark.parametrize("stages", [1, 2])
def test_a_batch_line_whose_forward_raises_fails_alone_and_the_server_goes_on(tmp_path, stages, monkeypatch):
    """The server in this process (every rank a thread: tests/servers.py); the last stage's forward raises on one
    batch line."""
    from tasks.batch_store import BatchStore
    from tests.serve_cases import wait_batch
    from tests.servers import LocalServer

    lines = [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
              "body": {"prompt": f"Line {i} is", "max_tokens": 3, "temperature": 0}} for i in range(10)]
    store = BatchStore(tmp_path / "state")  # the batch waits in the folder; the server runs it at start
    f = store.add_file("default", "".join(json.dumps(x) + "\n" for x in lines).encode(), "in.jsonl", "batch")
    bid = store.create_batch("default", {"input_file_id": f["id"], "endpoint": "/v1/completions",
                                         "completion_window": "24h"})["id"]
    s = LocalServer(["--model-name", str(DEFAULT_MODEL), "--served-model-name", "tiny"], tmp_path, stages, keys=0)
    fault = {"DIST_INFER_FAULT": "forward-raise", "DIST_INFER_FAULT_LINE": "4",
             "DIST_INFER_FAULT_RANK": str(stages - 1), "DIST_INFER_FAULT_PASS": "2"}
    try:
        with monkeypatch.context() as env:  # read when each stage is built
            for k, v in fault.items():
                env.setenv(k, v)
            s.start()
        client = s.client()
        b = wait_batch(client, bid, timeout=600)
        assert b.status == "completed" and b.request_counts.failed == 1 and b.request_counts.completed == 9
        (bad,) = [json.loads(x) for x in client.files.content(b.error_file_id).text.splitlines()]
        assert bad["custom_id"] == "r4" and "forward raised" in bad["error"]["message"]
        assert client.completions.create(model="tiny", prompt="Hi", max_tokens=2).choices
        assert s.running
    finally:
        s.stop(check=False)


@pytest.mark.parametrize("stages,rank", [(3, 1), (2, 0)])
def test_a_line_killing_an_earlier_stage_in_its_first_pass_is_recorded(clean, tmp_path, stages, rank):
    """A process death (a segfault) while an earlier stage computes a line's first pass: rank 0 tells the
    last rank which lines a pass admits before any stage computes it (messages.Admitting), so the rerun
    runs the lines in flight alone and the next one answers the culprit with an error: no crash loop."""
    src, ref = clean
    out = tmp_path / "out.jsonl"
    args = ["--model-name", str(DEFAULT_MODEL), "--infer-data", str(src), "--output-path", str(out),
            "--no-progress", "--batch-invariant", "--max-micro-batch-size", "4"]
    fault = {"DIST_INFER_FAULT": "forward-kill", "DIST_INFER_FAULT_LINE": str(CULPRIT),
             "DIST_INFER_FAULT_RANK": str(rank)}
    for attempt in range(2):
        p = run_torchrun(args, stages, env=fault, timeout=900)
        assert p.returncode != 0 and not out.exists(), p.stderr[-2000:]
        record = (tmp_path / "out.jsonl.partial.inflight").read_text()
        assert str(CULPRIT) in record, record  # recorded although the last stage never saw its pass
    assert "run again one at a time" in p.stderr
    p = run_torchrun(args, stages, env=fault, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    got = read_jsonl(out)
    assert [i for i, x in enumerate(got) if "error" in x] == [CULPRIT]
    assert "when the process ended" in got[CULPRIT]["error"]["message"]
    keep = [i for i in range(len(ref)) if i != CULPRIT]
    assert_identical_results([got[i] for i in keep], [ref[i] for i in keep])
