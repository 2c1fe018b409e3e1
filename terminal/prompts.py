"""``--prompts "text" ...`` / ``--prompts-file``: generate for a few prompts on the loaded pipeline, print
each with its completion, then a latency report in the style of llm-foundry's ``hf_generate``. The prompts
go in as completion requests with the sampling flags' fields, in order, so the answers equal a request
file's with the same lines.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass

from pipeline.config.interactive_options import sampling_body, unescape
from tasks.protocol import RequestError

from terminal.local_engine import LocalEngine, Ticket, error_of


@dataclass
class Latency:
    """One run of prompts, llm-foundry's figures."""

    batch: int
    input_tokens: list[int]
    output_tokens: list[int]
    encode: float  # seconds tokenizing on rank 0
    generate: float  # first request queued -> last answer back (the last rank detokenizes as it goes)
    decode: float  # rank 0 turning the answers into the printed texts

    def lines(self) -> list[str]:
        out = sum(self.output_tokens)
        total = self.encode + self.generate + self.decode
        per_token = 1000 * self.generate / max(1, max(self.output_tokens, default=0))
        return [f"bs: {self.batch}, input tokens: {self.input_tokens}, output tokens: {self.output_tokens}",
                f"encode latency: {1000 * self.encode:.2f} ms, generate latency: {1000 * self.generate:.2f} ms, "
                f"decode latency: {1000 * self.decode:.2f} ms, total latency: {1000 * total:.2f} ms",
                f"latency per output token: {per_token:.2f} ms (the batch's longest answer: one token a step for "
                "every prompt)",
                f"output tokens/s: {out / max(self.generate, 1e-9):.1f}"]


def read_prompts(opts) -> list[str]:
    """--prompts as given, or --prompts-file's non-blank lines (``\\n`` in a line is a newline)."""
    if opts.prompts:
        return list(opts.prompts)
    with open(opts.prompts_file, encoding="utf-8") as f:
        return [unescape(line.rstrip("\r\n")) for line in f if line.strip()]


def run_prompts(engine: LocalEngine, opts, out=None) -> int:
    """Print every prompt and its completion (or its error), then the report (to ``out``, default
    stdout); 1 when any failed."""
    out = out or sys.stdout
    prompts = read_prompts(opts)
    body = sampling_body(opts)
    tickets: list[Ticket | RequestError] = []
    for p in prompts:
        try:
            tickets.append(engine.submit({"prompt": p, **body}, chat=False))
        except RequestError as e:
            tickets.append(e)
    started = min((t.submitted for t in tickets if isinstance(t, Ticket)), default=time.perf_counter())
    for t in tickets:
        if isinstance(t, Ticket):
            engine.wait(t)
    t0 = time.perf_counter()
    texts, usage = [], []
    for t in tickets:
        err = t if isinstance(t, RequestError) else error_of(t.answer)
        if err is not None:
            texts.append((None, err.message))
            continue
        result = t.answer.result
        choice = result["choices"][0]
        texts.append((choice["finish_reason"], choice["text"]))
        usage.append((t, result["usage"]))
    decode = time.perf_counter() - t0
    finished = max((t.finished for t, _ in usage), default=started)
    for i, (p, (reason, text)) in enumerate(zip(prompts, texts), 1):
        print(f"---- prompt {i} ----\n{p}", file=out)
        print(f"---- {'error' if reason is None else 'completion'} {i}"
              f"{'' if reason is None else f' (finish_reason: {reason})'} ----\n{text}", file=out)
    lat = Latency(len(prompts), [u["prompt_tokens"] for _, u in usage], [u["completion_tokens"] for _, u in usage],
                  sum(t.encode_seconds for t, _ in usage), finished - started, decode)
    print("---- latency ----", *lat.lines(), sep="\n", file=out)
    out.flush()
    return 1 if len(usage) < len(texts) else 0
