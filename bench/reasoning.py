"""Thinking requests with a small max_tokens on the default model: the share of empty (starved) answers
and the tokens spent, without a budget, with budgets, and with --retry-starved, in one run of this script.

    python bench/reasoning.py                          # 200 requests (path questions and sums), max_tokens 20
    python bench/reasoning.py --requests 400 --max-tokens 24 --budget 8 --nproc 2

Every request is a chat completion that asks the default model to think (``chat_template_kwargs:
{"enable_thinking": true}``): held-out path questions (a thinking of about 24 tokens with its end: the
question again, then its answer; about 28 with the answer) and sums (about 13 and 17), greedy. The
default model's end of thinking is 8 tokens (``\n</think>\n\n`` in its BPE), so a budget B leaves the
answer max_tokens - B - 8. Each configuration runs the same file in this
process (``--in-process``, P = ``--nproc``) and is read from its output and summary:

- ``roomy``: max_tokens 64, no budget: what the thinking needs (the accuracy a row gets when nothing starves);
- ``no budget``: max_tokens ``--max-tokens``: rows whose thinking is longer come back empty (starved);
- ``budget B``: ``thinking_token_budget`` B: the thinking is cut at B tokens, the answer follows;
- ``effort low`` / ``effort medium``: ``reasoning_effort`` (a quarter / half of max_tokens);
- ``--retry-starved``: no budget, the starved rows run once more (twice the thinking, that much more max_tokens);
- ``budget B + --retry-starved``.

Printed per configuration: empty answers (share of requests), right answers (share), tokens generated
(the summary's completion_tokens: every try), tokens per right answer, and the ratio of tokens to
``no budget``'s. Greedy and deterministic: the figures repeat on any machine with the same torch; wall
time is printed too, measured on a CPU named in the output.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.machine import cpu_name  # noqa: E402
from examples import default_tasks as dt  # noqa: E402

SEED = 4242  # held out: training drew rows with seeds 1 and 101, tokenizer text with 0


def requests(n: int, seed: int = SEED) -> list[tuple[dict, str]]:
    """(Batch API chat line, the expected answer) for ``n`` questions, path questions and sums alternating."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        q, want = dt.chat_question("path" if i % 2 == 0 else "arith", rng)
        body = {"messages": [{"role": "user", "content": q}], "temperature": 0,
                "chat_template_kwargs": {"enable_thinking": True}}
        out.append(({"custom_id": f"q{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}, want))
    return out


def run(tmp: Path, name: str, lines: list[tuple[dict, str]], body: dict, flags: list[str], nproc: int) -> dict:
    """One configuration: its figures from the output lines and the summary."""
    import dist_inference_runner

    src, out = tmp / f"{name}.jsonl", tmp / f"out-{name}.jsonl"
    src.write_text("".join(json.dumps({**line, "body": {**line["body"], **body}}) + "\n" for line, _ in lines))
    argv = ["--infer-data", str(src), "--output-path", str(out), "--no-progress", "--overwrite", "--in-process",
            "--pipeline-group-size", str(nproc), *flags]
    t0 = time.perf_counter()
    code = dist_inference_runner.main(argv, signals=False)
    wall = time.perf_counter() - t0
    assert code == 0, f"{name}: exit {code}"
    summary = json.loads(Path(f"{out}.summary.json").read_text())
    empty = right = 0
    for (_, want), got in zip(lines, (json.loads(x) for x in out.read_text().splitlines())):
        choice = got["response"]["body"]["choices"][0]
        content = choice["message"]["content"].strip()
        empty += not content
        right += content == want
    n = len(lines)
    return {"name": name, "empty": empty / n, "right": right / n, "tokens": summary["completion_tokens"],
            "retried": summary.get("reasoning", {}).get("retried", 0), "wall": wall}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--max-tokens", type=int, default=20)
    ap.add_argument("--budget", type=int, default=6, help="thinking_token_budget of the budget configurations")
    ap.add_argument("--nproc", type=int, default=1, help="pipeline stages (threads of this process)")
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args(argv)
    lines = requests(args.requests)
    m, b = args.max_tokens, args.budget
    configs = [("roomy", {"max_tokens": 64}, []),
               ("no budget", {"max_tokens": m}, []),
               (f"budget {b}", {"max_tokens": m, "thinking_token_budget": b}, []),
               ("effort low", {"max_tokens": m, "reasoning_effort": "low"}, []),
               ("effort medium", {"max_tokens": m, "reasoning_effort": "medium"}, []),
               ("--retry-starved", {"max_tokens": m}, ["--retry-starved"]),
               (f"budget {b} + --retry-starved", {"max_tokens": m, "thinking_token_budget": b}, ["--retry-starved"])]
    with tempfile.TemporaryDirectory() as d:
        rows = [run(Path(d), f"c{i}", lines, body, flags, args.nproc) | {"name": name}
                for i, (name, body, flags) in enumerate(configs)]
    base = rows[1]["tokens"]
    print(f"{args.requests} thinking requests (path questions and sums), max_tokens {m}, greedy, default model, "
          f"P = {args.nproc}; {cpu_name()}")
    print(f"{'configuration':<28} {'empty':>6} {'right':>6} {'tokens':>7} {'x no budget':>11} {'per right':>9} "
          f"{'reruns':>6} {'wall s':>6}")
    for r in rows:
        per = r["tokens"] / (r["right"] * args.requests) if r["right"] else float("inf")
        print(f"{r['name']:<28} {r['empty']:>6.0%} {r['right']:>6.0%} {r['tokens']:>7} {r['tokens'] / base:>10.2f}x "
              f"{per:>9.1f} {r['retried']:>6} {r['wall']:>6.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "cpu": cpu_name(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
