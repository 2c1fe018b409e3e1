"""What the serve tests send and what they compare with: completion requests of every kind (greedy with
logprobs, echo, n with a seed, stop strings, a list of prompts, scoring), a chat request, Batch API lines,
and file mode's answers to them (the session fixture ``serve_reference``); Batch API helpers."""

from __future__ import annotations

import json
import time

import pytest

from tests.utils import read_jsonl, run_inprocess, write_jsonl

NAME = "tiny"  # the served name of the shared "tiny" servers (tests/servers.py)

REQUESTS = [
    {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0, "logprobs": 3},
    {"prompt": "Once upon a time", "max_tokens": 6, "temperature": 0, "echo": True, "logprobs": 1},
    {"prompt": "Hello", "max_tokens": 10, "temperature": 0.8, "n": 2, "seed": 7},
    {"prompt": "A B C", "max_tokens": 12, "temperature": 0, "stop": ["e", "a"]},
    {"prompt": ["one", "two"], "max_tokens": 4, "temperature": 0},
    {"prompt": "Score this sentence", "max_tokens": 0, "echo": True, "logprobs": 0},
]
CHAT = {"messages": [{"role": "user", "content": "Say something"}], "max_tokens": 8, "temperature": 0}
CHAT_LINE = {"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions", "body": CHAT}


def batch_lines(extra: int = 0, chat: bool = False) -> list[dict]:
    """Completion lines (a batch holds one endpoint's requests, as OpenAI's; file mode mixes them: ``chat``),
    one bad line, and ``extra`` sampled lines of 40 tokens (a batch that runs for a while)."""
    lines = [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions", "body": r} for i, r in enumerate(REQUESTS)]
    if chat:
        lines.append(CHAT_LINE)
    lines.append({"custom_id": "bad", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x", "n": 0}})
    lines += [{"custom_id": f"x{i}", "method": "POST", "url": "/v1/completions",
               "body": {"prompt": f"Line {i} of a long batch", "max_tokens": 40, "temperature": 0.7, "seed": i}}
              for i in range(extra)]
    return lines


def jsonl_bytes(lines: list[dict]) -> bytes:
    return "".join(json.dumps(x) + "\n" for x in lines).encode()


def as_lines(results: list[dict]) -> list[dict]:
    """Answers as output lines (for tests.utils.assert_consistent_results)."""
    return [{"request": i, "result": r} for i, r in enumerate(results)]


@pytest.fixture(scope="session")
def serve_reference(make_llama, tmp_path_factory):
    """File mode's answers (P = 1, in this process) to REQUESTS and to ``batch_lines(chat=True)``, on the model of
    the shared "tiny" servers: (completion result lines, Batch API output lines)."""
    d = tmp_path_factory.mktemp("serve_ref")
    model = make_llama(num_hidden_layers=2)
    out = []
    for name, lines in (("r", REQUESTS), ("b", batch_lines(chat=True))):
        src = write_jsonl(d / f"{name}.jsonl", lines)
        assert run_inprocess(["--model-name", model, "--infer-data", src, "--num-threads", "1", "--no-progress"]) == 0
        out.append(read_jsonl(d / f"output_{name}.jsonl"))
    return out[0], out[1]


def wait_batch(client, bid: str, until=("completed", "failed", "cancelled", "expired"), timeout: float = 180):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        b = client.batches.retrieve(bid)
        if b.status in until:
            return b
        time.sleep(0.1)
    raise AssertionError(f"batch {bid} still {b.status}")


def wait_completed(client, bid: str, count: int, timeout: float = 120) -> int:
    """Wait until at least ``count`` of a batch's lines are answered (they advance as it runs); how many are."""
    deadline = time.monotonic() + timeout
    while (done := client.batches.retrieve(bid).request_counts.completed) < count:
        assert time.monotonic() < deadline, f"batch {bid}: {done} lines answered after {timeout} s"
        time.sleep(0.02)
    return done


def batch_bodies(text: str) -> dict[str, dict]:
    """A Batch API output (or error) file by custom_id; fails on an id answered twice."""
    out = {}
    for line in text.splitlines():
        if line.strip():
            obj = json.loads(line)
            assert obj["custom_id"] not in out, "a custom_id answered twice"
            out[obj["custom_id"]] = obj
    return out
