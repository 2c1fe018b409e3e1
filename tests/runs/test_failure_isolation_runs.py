"""A failure stays with its row (issue 37), in one process (``--in-process``): bad lines and chat
templates that refuse their messages, mixed into 200 good lines, each get an error in place at P = 1
and 2 while the rest of the file is answered in one run; a row whose sampling or output raises is its
own error; a stage's forward that raises on one request (``DIST_INFER_FAULT=forward-raise``, each
stage's own fault point) at the first, middle and last stage of P = 1, 2 and 3, while it prefills and
while it decodes, with the prefix cache and chunked prefill: the failed pass comes back round the ring,
rank 0 computes its groups again one at a time, the culprit gets an error line and every other line
equals a clean run's (pipeline.runtime.retry); in serve mode (a server in this process, every rank a
thread: tests/servers.py) each bad request is answered 400 and the server goes on, a Batch API batch
with bad lines completes with an error file (one whose input is gone fails, across a restart), a batch
line whose forward raises fails alone. A line that kills its process: tests/integration/test_reliability.py
(file mode) and tests/integration/test_failure_isolation.py (a server)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

import pipeline.output.head as head
import pipeline.sampling.step as step
from tests.fuzz_requests import MISTRAL_INSTRUCT
from tests.utils import REPO, assert_identical_results, read_jsonl, run_inprocess, run_local

DEFAULT_MODEL = REPO / "examples" / "tiny-llama-default"

# each crashed a run or a server before; (request, the error's param), in file mode as Batch API lines
BAD = [
    ({"prompt": "Hello", "logit_bias": {"5000": 5}}, "logit_bias"),  # past the vocabulary (1024)
    ({"prompt": "Hello", "logit_bias": {"99999999999999999999": 5}}, "logit_bias"),  # overflows int64
    ({"prompt": "Hello", "logit_bias": {"-1": 100}}, "logit_bias"),  # silently biased the last entry
    ({"prompt": "Hello", "logit_bias": {"1023": 5}, "seed": 2**64}, "seed"),  # could not be sent to rank 1
    ({"prompt": [5, 1024, 7]}, "prompt"),
    ({"prompt": "Hello", "top_k": 2**40}, "top_k"),
]
CHAT_BAD = [  # what Mistral-Instruct's template refuses, and an image (no model here takes one)
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
    [{"role": "user", "content": "Hi"}, {"role": "user", "content": "again"}],
    [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}],
]


@pytest.fixture(scope="module")
def mistral_model(tmp_path_factory) -> Path:
    """The default model with Mistral-Instruct's chat template (weights linked, not copied)."""
    d = tmp_path_factory.mktemp("mistral") / "tiny-mistral-template"
    d.mkdir()
    for f in DEFAULT_MODEL.iterdir():
        if f.name != "chat_template.jinja":
            (d / f.name).symlink_to(f) if f.suffix == ".safetensors" else shutil.copy(f, d / f.name)
    (d / "chat_template.jinja").write_text(MISTRAL_INSTRUCT)
    return d


def _batch(i: int, body: dict, chat: bool = False) -> dict:
    return {"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions" if chat else "/v1/completions",
            "body": body}


def mixed_lines(good: int, chat_only: bool = False) -> tuple[list[dict], dict[int, str]]:
    """``good`` valid requests with the bad ones spread among them; (lines, {index: param of its error}).
    ``chat_only``: every line for /v1/chat/completions (the bad completions' fields in chat bodies)."""
    if chat_only:
        bad = [(_batch(0, dict({k: v for k, v in b.items() if k != "prompt"},
                               messages=[{"role": "user", "content": "Hello"}]), chat=True), p)
               for b, p in BAD if p != "prompt"]
    else:
        bad = [(_batch(0, b), p) for b, p in BAD]
    bad += [(_batch(0, {"messages": m, "max_tokens": 2}, chat=True), "messages") for m in CHAT_BAD]
    lines, errors, step = [], {}, max(1, good // len(bad))
    for i in range(good):
        if i % step == 1 and bad:
            line, param = bad.pop(0)
            errors[len(lines)] = param
            lines.append(dict(line, custom_id=f"bad{len(lines)}"))
        chat = chat_only or i % 5 == 0
        body = ({"messages": [{"role": "user", "content": f"Question {i}?"}]} if chat
                else {"prompt": f"Request {i}: the garden is"})
        body.update(max_tokens=1 + i % 3, temperature=0 if i % 2 else 0.8, seed=i)
        lines.append(_batch(i, body, chat))
    return lines, errors


def _write(path: Path, lines: list[dict]) -> Path:
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def check_mixed(out: list[dict], lines: list[dict], errors: dict[int, str]) -> None:
    assert len(out) == len(lines)
    for i, (line, x) in enumerate(zip(lines, out)):
        assert x["custom_id"] == line["custom_id"]
        if i in errors:
            assert x["error"] is not None and x["response"]["body"]["error"]["param"] == errors[i], (i, x)
        else:
            assert x["error"] is None and x["response"]["body"]["choices"], (i, x)


def test_200_good_lines_with_the_bad_ones_finish_in_one_run(mistral_model, tmp_path):
    lines, errors = mixed_lines(200)
    src = _write(tmp_path / "mixed.jsonl", lines)
    out = tmp_path / "out.jsonl"
    p = run_local(["--model-name", str(mistral_model), "--infer-data", str(src), "--output-path", str(out),
                   "--no-progress", "--max-micro-batch-size", "16"])
    assert p.returncode == 0, p.stderr[-3000:]
    check_mixed(read_jsonl(out), lines, errors)
    msgs = [x["response"]["body"]["error"]["message"] for x in read_jsonl(out) if x["error"]]
    # the template's own words (its raise_exception) after the project's
    assert sum("chat template cannot render these messages: Conversation roles must alternate" in m for m in msgs) == 2
    summary = json.loads((tmp_path / "out.jsonl.summary.json").read_text())
    assert summary["answered"] == 200 and summary["errors"] == len(errors)


def test_the_same_at_two_stages(mistral_model, tmp_path):
    lines, errors = mixed_lines(40)
    src = _write(tmp_path / "mixed.jsonl", lines)
    out = tmp_path / "out.jsonl"
    p = run_local(["--model-name", str(mistral_model), "--infer-data", str(src), "--output-path", str(out),
                   "--no-progress", "--max-micro-batch-size", "8"], 2)
    assert p.returncode == 0, p.stderr[-3000:]
    check_mixed(read_jsonl(out), lines, errors)


def test_a_tiny_temperature_is_greedy(tmp_path):
    src = _write(tmp_path / "t.jsonl", [{"prompt": "Hello", "max_tokens": 4, "temperature": t, "logprobs": 1}
                                        for t in (1e-40, 0, 9e-6)])
    out = tmp_path / "out.jsonl"
    assert run_inprocess(["--model-name", str(DEFAULT_MODEL), "--infer-data", str(src), "--output-path", str(out),
                          "--no-progress"]) == 0
    texts = [x["result"]["choices"][0]["text"] for x in read_jsonl(out)]
    assert texts[0] == texts[1] == texts[2]


def test_a_row_whose_sampling_or_output_raises_is_its_own_error(monkeypatch, tmp_path):
    """Failures on the last rank while computing one row (a sampling kernel, detokenizing, stop
    strings) answer that request with an error; its micro-batch neighbours are answered."""
    real_sample, real_find = step.sample, head._find_stop

    def sample(logits, temperature, *a, **k):  # a kernel that fails on one row's settings
        if bool((temperature == 1.25).any()):
            raise RuntimeError("kernel failure")
        return real_sample(logits, temperature, *a, **k)

    def find_stop(text, stops, since):
        if "BOOM" in stops:
            raise ValueError("stop failure")
        return real_find(text, stops, since)

    monkeypatch.setattr(step, "sample", sample)
    monkeypatch.setattr(head, "_find_stop", find_stop)
    reqs = [{"prompt": f"Line {i} is", "max_tokens": 3, "temperature": 0.5, "seed": i} for i in range(8)]
    reqs[2]["temperature"] = 1.25
    reqs[5]["stop"] = ["BOOM"]
    src = _write(tmp_path / "r.jsonl", reqs)
    out = tmp_path / "out.jsonl"
    assert run_inprocess(["--model-name", str(DEFAULT_MODEL), "--infer-data", str(src), "--output-path", str(out),
                          "--no-progress", "--batch-invariant"]) == 0
    got = read_jsonl(out)
    assert [i for i, x in enumerate(got) if "error" in x] == [2, 5]
    assert "sampling its next token" in got[2]["error"]["message"] and got[2]["error"]["type"] == "server_error"
    assert "producing its output" in got[5]["error"]["message"]
    monkeypatch.undo()  # the neighbours' answers are what they are without the failing rows
    reqs[2], reqs[5] = {"prompt": "x", "max_tokens": 1}, {"prompt": "x", "max_tokens": 1}
    clean = tmp_path / "clean.jsonl"
    assert run_inprocess(["--model-name", str(DEFAULT_MODEL), "--infer-data", str(_write(tmp_path / "c.jsonl", reqs)),
                          "--output-path", str(clean), "--no-progress", "--batch-invariant"]) == 0
    keep = [0, 1, 3, 4, 6, 7]
    assert_identical_results([got[i] for i in keep], [read_jsonl(clean)[i] for i in keep])
    summary = json.loads((tmp_path / "out.jsonl.summary.json").read_text())
    assert summary["errors"] == 2 and summary["error_kinds"] == {"computation": 2}


# -- a stage's forward that raises on one request ---------------------------------------------------
CULPRIT = 6


def retry_requests() -> list[dict]:
    """Generation with mixed lengths and seeds, best_of, n, echo scoring: what a pass can hold."""
    reqs = [{"prompt": f"Request {i}: the garden behind the house is", "max_tokens": 2 + i % 5,
             "temperature": 0.7 if i % 2 else 0, "seed": i} for i in range(16)]
    reqs[3].update(best_of=2, n=1, logprobs=2)
    reqs[9].update(n=2, temperature=0.9)
    reqs[11].update(echo=True, logprobs=1, max_tokens=0)
    return reqs


RETRY_FLAGS = ["--no-progress", "--batch-invariant", "--max-micro-batch-size", "4"]


@pytest.fixture(scope="module")
def clean(tmp_path_factory) -> tuple[Path, list[dict]]:
    """The input and a clean run's answers (--batch-invariant: the same for every P and neighbour)."""
    d = tmp_path_factory.mktemp("retry")
    src = _write(d / "in.jsonl", retry_requests())
    out = d / "clean.jsonl"
    p = run_local(["--model-name", str(DEFAULT_MODEL), "--infer-data", str(src), "--output-path", str(out),
                   *RETRY_FLAGS])
    assert p.returncode == 0, p.stderr[-3000:]
    return src, read_jsonl(out)


@pytest.mark.parametrize("stages,rank,from_pass", [(1, 0, 1), (2, 1, 3), (3, 0, 1), (3, 1, 3), (3, 2, 2)])
def test_a_forward_raising_on_one_request_is_retried_row_by_row_in_the_same_run(clean, tmp_path, stages, rank,
                                                                                 from_pass):
    src, ref = clean
    out = tmp_path / "out.jsonl"
    fault = {"DIST_INFER_FAULT": "forward-raise", "DIST_INFER_FAULT_LINE": str(CULPRIT),
             "DIST_INFER_FAULT_RANK": str(rank), "DIST_INFER_FAULT_PASS": str(from_pass)}
    p = run_local(["--model-name", str(DEFAULT_MODEL), "--infer-data", str(src), "--output-path", str(out),
                   *RETRY_FLAGS], stages, env=fault)
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


def test_a_forward_raising_with_the_prefix_cache_and_chunked_prefill(tmp_path):
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
    p = run_local(args, 2, env=fault)
    assert p.returncode == 0, p.stderr[-3000:]
    got = read_jsonl(out)
    assert [i for i, x in enumerate(got) if "error" in x] == [5]
    assert all(x["result"]["choices"][0]["text"] is not None for i, x in enumerate(got) if i != 5)
    assert all(x["result"]["usage"]["completion_tokens"] >= 1 for i, x in enumerate(got) if i != 5)


# -- serve mode: servers in this process (tests/servers.py) ------------------------------------------
@pytest.fixture(scope="module")
def server(mistral_model, tmp_path_factory):
    """A server of its own in this process (tests/servers.py): one test stops and restarts it."""
    from tests.servers import LocalServer

    s = LocalServer(["--model-name", str(mistral_model), "--served-model-name", "tiny"],
                    tmp_path_factory.mktemp("isolation"), name="isolation").start()
    yield s
    s.stop(check=False)


def test_the_server_answers_each_bad_request_400_and_goes_on(server):
    from tests.servers import httpx

    headers = {"Authorization": f"Bearer {server.key()}"}
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
    assert server.running


def test_a_batch_with_bad_lines_completes_with_an_error_file_and_a_restart_works(server):
    from tests.serve_cases import wait_batch

    key = server.key()
    client = server.client(key)
    lines, errors = mixed_lines(30, chat_only=True)
    f = client.files.create(file=("in.jsonl", "".join(json.dumps(x) + "\n" for x in lines).encode()), purpose="batch")
    b = wait_batch(client, client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                                 completion_window="24h").id)
    assert b.status == "completed" and b.request_counts.failed == len(errors) and b.request_counts.completed == 30
    bad = [json.loads(x) for x in client.files.content(b.error_file_id).text.splitlines()]
    assert sorted(x["custom_id"] for x in bad) == sorted(lines[i]["custom_id"] for i in errors)
    server.stop()
    # while it is down, a batch is left in progress whose input file is gone
    from tasks.batch_store import BatchStore

    store, owner = BatchStore(server.serve_dir), server.owner(key)
    line = {"custom_id": "x", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x", "max_tokens": 1}}
    f2 = store.add_file(owner, (json.dumps(line) + "\n").encode(), "in2.jsonl", "batch")
    b2 = store.create_batch(owner, {"input_file_id": f2["id"], "endpoint": "/v1/completions",
                                    "completion_window": "24h"})
    (server.serve_dir / "keys" / owner / "files" / f2["id"]).unlink()
    client = server.start().client(key)  # the same --serve-dir: every batch keeps its state, the broken one fails
    b2 = wait_batch(client, b2["id"])
    assert b2.status == "failed" and "input file" in b2.errors.data[0].message
    assert client.batches.retrieve(b.id).status == "completed"
    assert client.completions.create(model="tiny", prompt="Hi", max_tokens=1).choices
    server.restart()  # and again, with a failed batch in the folder
    assert server.client(key).batches.retrieve(b2.id).status == "failed"


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
