"""Measure the default model on held-out synthetic questions, through the runner.

    python examples/check_default_model.py [--seed 12345] [--n 100] [--pipeline 1 2]
    python examples/check_default_model.py --score examples/output_multiple_choice.jsonl

Writes a request file of fresh questions (``examples/default_tasks.py`` with a seed the training
never used), runs ``dist_inference_runner.py`` on it (plain ``python`` for P = 1, ``torchrun`` on
loopback for P > 1), and scores the output file: greedy exact match per task, and for the
multiple-choice task the lm-eval way (one request per context + candidate, token-id prompt,
``echo: true, max_tokens: 0, logprobs: 1``; the candidate with the highest summed logprob wins), and
the thinking chat tasks (path questions and sums asked with ``enable_thinking``: the answer after the
thinking must be the expected one).
Every request line carries ``task`` and ``expected`` (or ``doc`` and ``gold``) in its ``metadata`` (OpenAI's
field for a request's own bookkeeping; a thinking chat's Batch API line: in its ``custom_id``), which the
runner leaves alone and echoes back, so the output file can be scored on its own.
"""

from __future__ import annotations

import argparse
import os
import random
import socket
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import orjson

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from examples import default_tasks as dt  # noqa: E402

# (task name in the report, generator task, few-shot count range)
GENERATED = [("path/0-shot", "path", (0, 0)), ("path/few-shot", "path", (1, 5)),
             ("arith/0-shot", "arith", (0, 0)), ("arith/few-shot", "arith", (2, 4)),
             ("copy", "copy", (0, 2)), ("reverse", "reverse", (0, 2)), ("owner", "owner", (0, 0))]


def generated_requests(seed: int, n: int) -> list[dict]:
    """``n`` greedy questions per generated task; path few-shot mirrors babi_fewshot.jsonl."""
    rng = random.Random(seed)
    out = []
    for name, task, (lo, hi) in GENERATED:
        for _ in range(n):
            prompt, b = dt.few_shot(task, rng, rng.randint(lo, hi))
            max_tokens = 2 if task == "path" else 8  # the shared few-shot file asks for 2
            out.append({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stop": ["\n"],
                        "metadata": {"task": name, "expected": b.answer}})
    return out


def choice_requests(seed: int, n: int, tokenizer) -> list[dict]:
    """lm-eval's request shape: context ids + candidate ids per candidate, echo, no generation."""
    rng = random.Random(seed)
    out = []
    for doc in range(n):
        b = dt.owner_block(rng)
        ctx = tokenizer(b.prompt)["input_ids"]  # with <s>
        for cand in b.choices:
            ids = ctx + tokenizer(cand, add_special_tokens=False)["input_ids"]
            out.append({"prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 1, "temperature": 0,
                        "metadata": {"task": "owner/choice", "doc": doc, "context_tokens": len(ctx),
                                     "gold": cand == b.answer}})
    return out


def think_requests(seed: int, n: int) -> list[dict]:
    """Chat requests that ask the model to think (``enable_thinking``): path questions and sums as a user
    would write them; the answer (``message.content``, the thinking apart) must be the expected one.
    Batch API lines, whose output echoes only ``custom_id``: it carries the task and the answer."""
    rng = random.Random(seed)
    out = []
    for task in ("path", "arith"):
        for _ in range(n):
            q, want = dt.chat_question(task, rng)
            out.append({"custom_id": f"{task}/think={want}", "method": "POST", "url": "/v1/chat/completions",
                        "body": {"messages": [{"role": "user", "content": q}], "max_tokens": 48, "temperature": 0,
                                 "chat_template_kwargs": {"enable_thinking": True}}})
    return out


def heldout_requests(seed: int, n: int, tokenizer) -> list[dict]:
    return generated_requests(seed, n) + choice_requests(seed + 1, n, tokenizer) + think_requests(seed + 2, n)


def score(lines: list[dict]) -> dict[str, tuple[int, int]]:
    """(hits, total) per task from the runner's output lines (``request`` echoed in each)."""
    hits: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    docs: dict[int, list[tuple[float, bool]]] = defaultdict(list)
    for line in lines:
        if "custom_id" in line:  # a thinking chat request: its task and answer in custom_id
            task, want = line["custom_id"].split("=", 1)
            if line.get("error"):
                raise RuntimeError(f"request failed: {line['error']}")
            h = hits[task]
            h[0] += line["response"]["body"]["choices"][0]["message"]["content"].strip() == want
            h[1] += 1
            continue
        req = line["request"]["metadata"]  # the request's own bookkeeping, echoed back (OpenAI's metadata field)
        if "result" not in line:
            raise RuntimeError(f"request failed: {line.get('error')}")
        choice = line["result"]["choices"][0]
        if "doc" in req:  # summed logprob of the candidate's tokens only
            lps = choice["logprobs"]["token_logprobs"][req["context_tokens"]:]
            docs[req["doc"]].append((sum(lps), req["gold"]))
            continue
        h = hits[req["task"]]
        h[0] += choice["text"] == req["expected"]
        h[1] += 1
    if docs:
        h = hits["owner/choice"]
        for cands in docs.values():
            h[0] += max(cands)[1]  # the best-scored candidate is the gold one
            h[1] += 1
    return {task: (a, b) for task, (a, b) in hits.items()}


def greedy_texts(lines: list[dict]) -> list[str]:
    """Every generated text, in input order (to compare P = 1 with P = 2)."""
    return [x["response"]["body"]["choices"][0]["message"]["content"] if "custom_id" in x else
            x["result"]["choices"][0]["text"] for x in lines if "custom_id" in x or "doc" not in x["request"]["metadata"]]


def run_runner(requests_path: Path, out_path: Path, pipeline: int, timeout: float = 600) -> None:
    """The runner on the default model: python for P = 1, torchrun (gloo, loopback) for P > 1."""
    runner = [str(REPO / "dist_inference_runner.py"), "--infer-data", str(requests_path),
              "--output-path", str(out_path), "--no-progress"]
    if pipeline == 1:
        cmd = [sys.executable, *runner]
    else:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(pipeline),
               "--master-addr", "127.0.0.1", "--master-port", str(port), *runner]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if p.returncode != 0:
        raise RuntimeError(f"runner failed (P={pipeline}):\n{p.stderr[-3000:]}")


def read_jsonl(path: Path) -> list[dict]:
    return [orjson.loads(line) for line in path.read_bytes().splitlines() if line.strip()]


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))


def main(argv: list[str] | None = None) -> None:
    """CLI: held-out requests -> runner at each P -> accuracy table; P's greedy texts must agree."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=12345)
    ap.add_argument("--n", type=int, default=100, help="questions per task")
    ap.add_argument("--pipeline", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--score", type=Path,
                    help="only score this output file (e.g. of multiple_choice.jsonl)")
    args = ap.parse_args(argv)
    if args.score:
        for task, (hit, total) in score(read_jsonl(args.score)).items():
            print(f"{task:15s} {hit:4d}/{total:<4d} {100 * hit / total:5.1f}%")
        return
    from pipeline.loading.default_model import build_tokenizer

    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "heldout.jsonl"
        write_jsonl(src, heldout_requests(args.seed, args.n, build_tokenizer()))
        texts = {}
        for p in args.pipeline:
            out = Path(tmp) / f"out_p{p}.jsonl"
            run_runner(src, out, p)
            lines = read_jsonl(out)
            texts[p] = greedy_texts(lines)
            for task, (hit, total) in score(lines).items():
                print(f"P={p}  {task:15s} {hit:4d}/{total:<4d} {100 * hit / total:5.1f}%")
        first = texts[args.pipeline[0]]
        same = all(t == first for t in texts.values())
        print(f"greedy texts identical across P={args.pipeline}: {same}")


if __name__ == "__main__":
    main()
