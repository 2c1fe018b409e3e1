"""Dummy-data mode: a synthetic batch when no request file is given (--batch-size,
--input-seq-length, --generate-seq-length), for quick latency checks of a model and launch."""

from __future__ import annotations

import os
import tempfile

import orjson


def write_dummy_requests(opts) -> str:
    """A temporary JSONL of ``batch_size`` token-id prompts, greedy, fixed generation length."""
    fd, path = tempfile.mkstemp(prefix="dummy_requests_", suffix=".jsonl")
    with os.fdopen(fd, "wb") as f:
        for i in range(opts.batch_size):
            prompt = [(7 * i + 13 * j) % 1000 + 3 for j in range(opts.input_seq_length)]
            f.write(orjson.dumps({"prompt": prompt, "max_tokens": opts.generate_seq_length,
                                  "temperature": 0, "ignore_eos": True}) + b"\n")
    return path
