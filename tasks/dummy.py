"""Dummy-data mode: a synthetic batch when no request file is given (--batch-size,
--input-seq-length, --generate-seq-length), for quick latency checks of a model and launch."""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass

import orjson


@dataclass(frozen=True)
class DummyWorkload:
    """``batch_size`` prompts of ``prompt_tokens`` token ids, ``new_tokens`` generated for each."""

    batch_size: int
    prompt_tokens: int
    new_tokens: int


def write_dummy_requests(work: DummyWorkload) -> str:
    """A temporary JSONL of ``batch_size`` token-id prompts, greedy, fixed generation length."""
    fd, path = tempfile.mkstemp(prefix="dummy_requests_", suffix=".jsonl")
    with os.fdopen(fd, "wb") as f:
        for i in range(work.batch_size):
            prompt = [(7 * i + 13 * j) % 1000 + 3 for j in range(work.prompt_tokens)]
            f.write(orjson.dumps({"prompt": prompt, "max_tokens": work.new_tokens, "temperature": 0}) + b"\n")
    return path


def print_latency(report, work: DummyWorkload) -> None:
    """Latency figures in the style of llm-foundry's hf_generate."""
    s = report.summary
    out_tokens = s.completion_tokens
    gen = max(s.wall_seconds - s.encode_seconds - s.decode_seconds, 1e-9)
    print(f"dummy data: batch {work.batch_size} x {work.prompt_tokens} prompt tokens, "
          f"{work.new_tokens} new tokens each")
    print(f"encode latency: {1000 * s.encode_seconds:.2f} ms")
    print(f"generation latency: {1000 * gen:.2f} ms")
    print(f"decode latency: {1000 * s.decode_seconds:.2f} ms")
    print(f"total latency: {1000 * s.wall_seconds:.2f} ms")
    print(f"latency per output token: {1000 * gen / max(1, out_tokens / work.batch_size):.2f} ms "
          f"(batch of {work.batch_size})")
    print(f"output tokens/s: {out_tokens / gen:.1f}")
