"""Dummy-data mode's request file from its own small config (no RunOptions)."""

from __future__ import annotations

import os

import orjson

from tasks.dummy import DummyWorkload, write_dummy_requests


def test_dummy_requests_follow_the_workload():
    path = write_dummy_requests(DummyWorkload(batch_size=3, prompt_tokens=5, new_tokens=2))
    try:
        with open(path, "rb") as f:
            lines = [orjson.loads(line) for line in f]
    finally:
        os.unlink(path)
    assert len(lines) == 3 and all(len(x["prompt"]) == 5 and x["max_tokens"] == 2 and x["temperature"] == 0
                                   for x in lines)
    assert lines[0]["prompt"] != lines[1]["prompt"]  # distinct rows
