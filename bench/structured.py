"""Structured outputs' cost: a request file where half the rows are constrained (the varied cases of
tests/structured_cases.py: JSON schemas, regexes, choices, Lark and GBNF grammars) against the same
file with no constraint, in one run of this script, one runner process (or torchrun group) each.

    python bench/structured.py                        # the default model, 96 requests, P = 1
    python bench/structured.py --model DIR --requests 256 --nproc 2 --max-tokens 64

Prints generated tokens/s of both files (from each run's summary), their ratio (target >= 0.9x),
the grammars' compile time and the last rank's mask time. Greedy, so every run is deterministic.

The free file must decode the same rows for the same number of steps as the mixed one, without
telling the scheduler more than the mixed file does (a constrained row ends when its grammar does,
before its ``max_tokens``, at a step nobody knew ahead). So each free request keeps its mixed twin's
``max_tokens`` and ends through a stop string: the whole text it generates in that many steps
(learnt by a first, unmeasured run that gives it its twin's length as ``max_tokens``), which the
last rank finds exactly where its twin ended and the scheduler cannot see. Mixed and free then run
``--repeats`` times each, interleaved, and the best run of each is compared (on a shared machine
other work only ever slows a run down; the medians are printed too).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.structured_cases import cases  # noqa: E402


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()}, {os.cpu_count()} cores"
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


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
    """The same requests with no constraint. Without ``texts``: each generates as many tokens as its
    twin (``max_tokens`` = that length). With them: each keeps its twin's ``max_tokens`` and stops on
    its own text of that length (a text that is empty, or that shows up early, keeps the exact length)."""
    path = out / ("free.jsonl" if texts else "free-lengths.jsonl")
    with open(mixed) as src, open(path, "w") as dst:
        for i, line in enumerate(src):
            body = {k: v for k, v in json.loads(line).items() if k not in ("response_format", "structured_outputs")}
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


def run(data: Path, out: Path, model: str | None, nproc: int) -> dict:
    args = [str(REPO / "dist_inference_runner.py"), "--infer-data", str(data), "--output-path", str(out),
            "--no-progress", "--overwrite", "--num-threads", str(max(1, (os.cpu_count() or 2) // nproc))]
    if model:
        args += ["--model-name", model]
    if nproc > 1:
        args = ["-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1",
                "--master-port", "29533", *args]
    p = subprocess.run([sys.executable, *args], capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"the runner failed on {data.name}:\n{p.stderr[-3000:]}")
    return json.loads(Path(str(out) + ".summary.json").read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="model folder (default: the embedded default model)")
    ap.add_argument("--requests", type=int, default=96)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--nproc", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5, help="measured runs of each file, interleaved (best compared)")
    ap.add_argument("--json", help="write the figures here")
    a = ap.parse_args()
    ap_runs: dict[str, list[dict]] = {"mixed": [], "free": []}
    with tempfile.TemporaryDirectory() as tmp:
        t = Path(tmp)
        mixed = mixed_file(t, a.requests, a.max_tokens)
        run(mixed, t / "out-mixed.jsonl", a.model, a.nproc)  # also warms the page cache
        lengths = twin_lengths(mixed, t / "out-mixed.jsonl")
        run(free_file(t, mixed, lengths), t / "out-lengths.jsonl", a.model, a.nproc)
        free = free_file(t, mixed, lengths, texts_of(t / "out-lengths.jsonl"))
        for _ in range(a.repeats):
            ap_runs["mixed"].append(run(mixed, t / "out-mixed.jsonl", a.model, a.nproc))
            ap_runs["free"].append(run(free, t / "out-free.jsonl", a.model, a.nproc))
    s_mixed, s_free = (max(r, key=lambda x: x["completion_tokens_per_second"])
                       for r in (ap_runs["mixed"], ap_runs["free"]))  # the best run of each
    median = {k: sorted(x["completion_tokens_per_second"] for x in r)[len(r) // 2] for k, r in ap_runs.items()}
    st = s_mixed.get("structured", {})
    ratio = s_mixed["completion_tokens_per_second"] / s_free["completion_tokens_per_second"]
    figures = {"cpu": cpu_name(), "requests": a.requests, "nproc": a.nproc, "max_tokens": a.max_tokens,
               "repeats": a.repeats, "mixed_runs": [r["completion_tokens_per_second"] for r in ap_runs["mixed"]],
               "free_runs": [r["completion_tokens_per_second"] for r in ap_runs["free"]],
               "free_tokens_per_s": s_free["completion_tokens_per_second"],
               "mixed_tokens_per_s": s_mixed["completion_tokens_per_second"], "ratio": round(ratio, 3),
               "free_completion_tokens": s_free["completion_tokens"],
               "mixed_completion_tokens": s_mixed["completion_tokens"], **st}
    print(f"CPU: {figures['cpu']}; {a.requests} requests (half constrained), max_tokens {a.max_tokens}, P = {a.nproc}")
    print(f"free:  {s_free['completion_tokens']} tokens, {s_free['completion_tokens_per_second']} tok/s "
          f"(best of {figures['free_runs']})")
    print(f"mixed: {s_mixed['completion_tokens']} tokens, {s_mixed['completion_tokens_per_second']} tok/s "
          f"(best of {figures['mixed_runs']}) "
          f"({st.get('constrained_rows', 0)} constrained rows)")
    figures["median_ratio"] = round(median["mixed"] / median["free"], 3)
    print(f"ratio mixed/free: {ratio:.3f}x (medians: {figures['median_ratio']}x) ({'PASS' if ratio >= 0.9 else 'FAIL'}: target >= 0.9x); "
          f"{st.get('grammars_compiled', 0)} grammars compiled in {st.get('compile_seconds', 0)} s, "
          f"masks {st.get('mask_seconds', 0)} s on the step, {st.get('mask_ahead_seconds', 0)} s computed ahead")
    if a.json:
        Path(a.json).write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
