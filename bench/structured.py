"""Structured outputs' cost: a request file where half the rows are constrained (the varied cases of
tests/structured_cases.py: JSON schemas, regexes, choices, Lark and GBNF grammars) against the same
file with no constraint, in one run of this script, one runner process (or torchrun group) each.

    python bench/structured.py                        # the default model, 256 requests, P = 1
    python bench/structured.py --model DIR --requests 256 --nproc 2 --max-tokens 64

Prints generated tokens/s of both files (from the runs' summaries), their ratio (target >= 0.9x),
the grammars' compile time and the last rank's mask time. Greedy, so every run is deterministic.

The free file must decode the same rows for the same number of steps as the mixed one, without
telling the scheduler more than the mixed file does (a constrained row ends when its grammar does,
before its ``max_tokens``, at a step nobody knew ahead). So each constrained row's free twin keeps its
``max_tokens`` and ends through a stop string: the whole text it generates in that many steps (learnt
by a first, unmeasured run that gives it its twin's length as ``max_tokens``), which the last rank
finds exactly where its twin ended and the scheduler cannot see. The free rows are the same in both
files. One runner process then reads copies of both files, ``--repeats`` pairs interleaved ABBA
(mixed, free; free, mixed; ...) after a warm-up pair, and the ratio is of the tokens/s over all
measured files of each kind: on a shared machine a file's speed drifts by more than the difference
measured (+-15% from one file to the next on the 2-core VM of the docs), and interleaving makes the
drift weigh on both alike. Each pair's ratio is printed too.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.machine import cpu_name  # noqa: E402
from tests.structured_cases import cases  # noqa: E402


def mixed_file(out: Path, n: int, max_tokens: int) -> Path:
    """The requests; every other one carries a constraint (cycling through the test cases)."""
    kinds = cases()
    lines = []
    for i in range(n):
        body = {"prompt": f"Request {i}: answer in the format asked.", "max_tokens": max_tokens, "temperature": 0}
        lines.append({**body, **kinds[(i // 2) % len(kinds)][0]} if i % 2 else body)
    path = out / "mixed.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def twin_lengths(mixed: Path, answers: Path) -> list[int]:
    with open(answers) as got:
        return [max(1, json.loads(a)["result"]["usage"]["completion_tokens"]) for a in got]


def free_file(out: Path, mixed: Path, lengths: list[int], texts: list[str] | None = None) -> Path:
    """The same requests with no constraint (rows that had none unchanged). Without ``texts``: each
    constrained row's twin generates as many tokens as it did (``max_tokens`` = that length). With them:
    it keeps its ``max_tokens`` and stops on its own text of that length (a text that is empty, or that
    shows up early, keeps the exact length)."""
    path = out / ("free.jsonl" if texts else "free-lengths.jsonl")
    with open(mixed) as src, open(path, "w") as dst:
        for i, line in enumerate(src):
            body = json.loads(line)
            if "response_format" not in body and "structured_outputs" not in body:
                dst.write(json.dumps(body) + "\n")
                continue
            body = {k: v for k, v in body.items() if k not in ("response_format", "structured_outputs")}
            text = texts[i] if texts else ""
            if text.strip() and len(text) <= 256:
                body["stop"] = [text]
            else:
                body["max_tokens"] = lengths[i]
            dst.write(json.dumps(body) + "\n")
    return path


def texts_of(answers: Path) -> list[str]:
    with open(answers) as got:
        return [json.loads(a)["result"]["choices"][0]["text"] for a in got]


def run(data: list[Path], out: Path, model: str | None, nproc: int) -> list[dict]:
    """One runner process (or torchrun group) over ``data`` in order; each file's summary."""
    args = [str(REPO / "dist_inference_runner.py"), "--infer-data", *map(str, data), "--output-path", str(out),
            "--no-progress", "--overwrite", "--num-threads", str(max(1, (os.cpu_count() or 2) // nproc))]
    if model:
        args += ["--model-name", model]
    if nproc > 1:
        args = ["-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1",
                "--master-port", "29533", *args]
    p = subprocess.run([sys.executable, *args], capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"the runner failed on {[d.name for d in data]}:\n{p.stderr[-3000:]}")
    outs = [out] if len(data) == 1 else [out / f"output_{d.name}" for d in data]
    return [json.loads(Path(str(o) + ".summary.json").read_text()) for o in outs]


def interleaved(t: Path, mixed: Path, free: Path, pairs: int) -> list[tuple[str, Path]]:
    """Copies of both files for one run, a warm-up pair first, then ``pairs`` pairs in ABBA order
    (mixed, free; free, mixed; ...): a drift in speed during the run weighs on both files alike."""
    order = [("mixed", "free") if i % 2 == 0 else ("free", "mixed") for i in range(pairs + 1)]
    files = []
    for i, pair in enumerate(order):
        for k in pair:
            copy = t / "runs" / f"{i:02d}-{k}.jsonl"
            copy.parent.mkdir(exist_ok=True)
            copy.write_bytes((mixed if k == "mixed" else free).read_bytes())
            files.append((k, copy))
    return files


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="model folder (default: the embedded default model)")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--nproc", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=10, help="measured pairs of files, interleaved in one run")
    ap.add_argument("--json", help="write the figures here")
    a = ap.parse_args()
    if a.repeats < 1 or a.requests < 2 or a.max_tokens < 1:
        ap.error("--repeats and --max-tokens must be >= 1, --requests >= 2 (half of them constrained)")
    runs: dict[str, list[dict]] = {"mixed": [], "free": []}
    with tempfile.TemporaryDirectory() as tmp:
        t = Path(tmp)
        mixed = mixed_file(t, a.requests, a.max_tokens)
        run([mixed], t / "out-mixed.jsonl", a.model, a.nproc)
        lengths = twin_lengths(mixed, t / "out-mixed.jsonl")
        run([free_file(t, mixed, lengths)], t / "out-lengths.jsonl", a.model, a.nproc)
        free = free_file(t, mixed, lengths, texts_of(t / "out-lengths.jsonl"))
        files = interleaved(t, mixed, free, a.repeats)
        summaries = run([f for _, f in files], t / "out", a.model, a.nproc)
        first = summaries[0].get("structured", {})  # the warm-up mixed file: every grammar compiled there
        for (k, _), summary in list(zip(files, summaries))[2:]:  # (the warm-up pair is not counted)
            runs[k].append(summary)
    speed = {k: [r["completion_tokens_per_second"] for r in rs] for k, rs in runs.items()}
    wall = {k: sum(r["wall_seconds"] for r in rs) for k, rs in runs.items()}
    tokens = {k: sum(r["completion_tokens"] for r in rs) for k, rs in runs.items()}
    ratio = (tokens["mixed"] / wall["mixed"]) / (tokens["free"] / wall["free"])  # tokens/s over every measured run
    pairs = sorted(m / f for m, f in zip(speed["mixed"], speed["free"]))
    masks = sum(r.get("structured", {}).get("mask_seconds", 0) for r in runs["mixed"])
    ahead = sum(r.get("structured", {}).get("mask_ahead_seconds", 0) for r in runs["mixed"])
    figures = {"cpu": cpu_name(), "requests": a.requests, "nproc": a.nproc, "max_tokens": a.max_tokens,
               "pairs": a.repeats, "mixed_runs": speed["mixed"], "free_runs": speed["free"],
               "pair_ratios": [round(x, 3) for x in pairs], "ratio": round(ratio, 3),
               "median_pair_ratio": round((pairs[(len(pairs) - 1) // 2] + pairs[len(pairs) // 2]) / 2, 3),
               "mixed_tokens_per_s": round(tokens["mixed"] / wall["mixed"], 1),
               "free_tokens_per_s": round(tokens["free"] / wall["free"], 1), "completion_tokens": tokens,
               "wall_seconds": wall, "mask_seconds": round(masks, 4), "mask_ahead_seconds": round(ahead, 4),
               "constrained_rows": first.get("constrained_rows", 0),
               "grammars_compiled": first.get("grammars_compiled", 0),
               "compile_seconds": first.get("compile_seconds", 0), "masks_on_thread": first.get("masks_on_thread")}
    print(f"CPU: {figures['cpu']}; {a.requests} requests (half constrained), max_tokens {a.max_tokens}, P = {a.nproc}, "
          f"{a.repeats} pairs of files in one run")
    print(f"free:  {figures['free_tokens_per_s']} tok/s over {tokens['free']} tokens (each file: {speed['free']})")
    print(f"mixed: {figures['mixed_tokens_per_s']} tok/s over {tokens['mixed']} tokens (each file: {speed['mixed']}), "
          f"{figures['constrained_rows']} constrained rows per file")
    print(f"ratio mixed/free: {ratio:.3f}x ({'PASS' if ratio >= 0.9 else 'FAIL'}: target >= 0.9x); pairs "
          f"{figures['pair_ratios']}, median {figures['median_pair_ratio']}x")
    print(f"{figures['grammars_compiled']} grammars compiled in {figures['compile_seconds']} s (first mixed file); "
          f"masks {figures['mask_seconds']} s on the step, {figures['mask_ahead_seconds']} s computed ahead "
          f"({'on a thread' if figures['masks_on_thread'] else 'on the step'}) over the measured mixed files")
    if a.json:
        Path(a.json).write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
