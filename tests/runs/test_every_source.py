"""One engine behind every face (issue 54): the same requests through every source of rank 0's engine
(a request file, the Batch API, live HTTP requests, the Python API, the terminal's --prompts) give the
same results, at P = 1 and P = 2 (every rank in this process). Under --batch-invariant a row's numbers do
not depend on what shares its micro-batch, so the results are compared exactly."""

from __future__ import annotations

import json
import threading
import time

import pytest

from tests.utils import free_port, read_jsonl, run_local, write_jsonl

try:  # the openai package's HTTP client (httpx, or its fork httpx2)
    import httpx
except ImportError:
    import httpx2 as httpx

REQUESTS = [
    {"prompt": "Once upon a time", "max_tokens": 12, "temperature": 0, "logprobs": 2},
    {"prompt": "Tom has 3 apples. Ann has", "max_tokens": 6, "temperature": 0, "stop": ["."]},
    {"prompt": "Copy: red blue green ->", "max_tokens": 8, "temperature": 0.8, "seed": 5, "n": 2},
    {"prompt": "The garden is west of the kitchen.", "max_tokens": 0, "echo": True, "logprobs": 1},
    {"messages": [{"role": "user", "content": "Say something"}], "max_tokens": 6, "temperature": 0},
    {"prompt": "x", "n": 0},  # its error, in its place
]
FLAGS = ["--batch-invariant", "--no-progress", "--num-threads", "1"]


def choices(result: dict | None) -> list | None:
    """What a result computed (ids, times and the batch it ran in aside)."""
    if result is None:
        return None
    out = []
    for c in result["choices"]:
        text = c["message"]["content"] if "message" in c else c["text"]
        out.append((c["index"], text, c["finish_reason"], json.dumps(c.get("logprobs"), sort_keys=True)))
    return out + [result["usage"]["completion_tokens"]]


def file_line(r: dict) -> dict:
    """A request as a request file holds it: a chat request as a Batch API line."""
    if "messages" in r:
        return {"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions", "body": r}
    return r


def result_of(line: dict) -> dict | None:
    return line.get("result") if "custom_id" not in line else (line.get("response") or {}).get("body")


def error_of(line: dict) -> str | None:
    err = line.get("error") or ((line.get("response") or {}).get("body") or {}).get("error")
    return err and err.get("message")


class Server:
    """Serve mode in this process (every rank a thread), stopped by its own event."""

    def __init__(self, stages: int, tmp):
        from tests.servers import _enter_process

        _enter_process()  # the serving process's umask and log levels, undone by the last server's close
        self.port, self.stop = free_port(), threading.Event()
        argv = [*FLAGS, "--serve", f"127.0.0.1:{self.port}", "--serve-dir", str(tmp / "state"),
                "--in-process", "--pipeline-group-size", str(stages)]
        import dist_inference_runner

        self.thread = threading.Thread(target=dist_inference_runner.main, args=(argv,),
                                       kwargs={"signals": False, "stopping": self.stop}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url("/health"), timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.1)
        raise AssertionError("the in-process server did not come up")

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def close(self) -> None:
        from tests.servers import _leave_process

        self.stop.set()
        self.thread.join(60)
        _leave_process()
        assert not self.thread.is_alive()


@pytest.mark.parametrize("stages", [1, 2])
def test_every_source_gives_the_same_results(tmp_path, stages):
    src = write_jsonl(tmp_path / "r.jsonl", [file_line(r) for r in REQUESTS])
    res = run_local([*FLAGS, "--infer-data", src, "--output-path", str(tmp_path / "file.jsonl")], stages)
    assert res.returncode == 0, res.stderr[-3000:]
    file_lines = read_jsonl(tmp_path / "file.jsonl")
    want = [choices(result_of(line)) if not error_of(line) else None for line in file_lines]
    want_errors = [error_of(line) for line in file_lines]
    assert want_errors[-1] and all(e is None for e in want_errors[:-1])

    server = Server(stages, tmp_path)
    try:
        live = []  # HTTP requests, one at a time
        for r in REQUESTS:
            body = httpx.post(server.url("/v1/chat/completions" if "messages" in r else "/v1/completions"),
                              json=r, timeout=120).json()
            live.append(None if "error" in body else choices(body))
        batch_lines = [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions", "body": r}
                       for i, r in enumerate(REQUESTS) if "messages" not in r]
        fid = httpx.post(server.url("/v1/files"), data={"purpose": "batch"}, timeout=60,
                         files={"file": ("b.jsonl", "".join(json.dumps(x) + "\n" for x in batch_lines))}).json()["id"]
        bid = httpx.post(server.url("/v1/batches"), json={"input_file_id": fid, "endpoint": "/v1/completions",
                                                         "completion_window": "24h"}, timeout=60).json()["id"]
        deadline = time.monotonic() + 120
        while (b := httpx.get(server.url(f"/v1/batches/{bid}"), timeout=60).json())["status"] != "completed":
            assert time.monotonic() < deadline and b["status"] in ("validating", "in_progress", "finalizing"), b
            time.sleep(0.1)
        out = httpx.get(server.url(f"/v1/files/{b['output_file_id']}/content"), timeout=60).text
        batch = {x["custom_id"]: choices(x["response"]["body"]) for x in map(json.loads, out.splitlines())}
    finally:
        server.close()
    assert live == want
    assert [batch[f"r{i}"] for i, r in enumerate(REQUESTS[:-1]) if "messages" not in r] == \
        [w for w, r in zip(want[:-1], REQUESTS) if "messages" not in r]

    from dist_inference_runner import LLM

    with LLM(pipeline_size=stages, in_process=True, batch_invariant=True, no_progress=True, num_threads=1) as llm:
        results = llm.generate(REQUESTS)
    assert [choices(r.raw) if r.ok else None for r in results] == want
    assert results[-1].error["message"] == want_errors[-1]

    # the terminal: --prompts sends the sampling flags' fields with each prompt (the first request's here)
    res = run_local([*FLAGS, "--prompts", REQUESTS[0]["prompt"], "--max-tokens", "12", "--temperature", "0"],
                    stages)
    assert res.returncode == 0, res.stderr[-2000:]
    assert f"---- completion 1 (finish_reason: {want[0][0][2]}) ----\n{want[0][0][1]}\n" in res.stdout
