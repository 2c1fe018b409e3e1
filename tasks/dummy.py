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
                                  "temperature": 0}) + b"\n")
    return path


def print_latency(report, opts) -> None:
    """Latency figures in the style of llm-foundry's hf_generate."""
    s = report.summary
    out_tokens = s.completion_tokens
    gen = max(s.wall_seconds - s.encode_seconds - s.decode_seconds, 1e-9)
    print(f"dummy data: batch {opts.batch_size} x {opts.input_seq_length} prompt tokens, "
          f"{opts.generate_seq_length} new tokens each")
    print(f"encode latency: {1000 * s.encode_seconds:.2f} ms")
    print(f"generation latency: {1000 * gen:.2f} ms")
    print(f"decode latency: {1000 * s.decode_seconds:.2f} ms")
    print(f"total latency: {1000 * s.wall_seconds:.2f} ms")
    print(f"latency per output token: {1000 * gen / max(1, out_tokens / opts.batch_size):.2f} ms "
          f"(batch of {opts.batch_size})")
    print(f"output tokens/s: {out_tokens / gen:.1f}")
