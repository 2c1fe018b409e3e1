"""Calls between the project's modules per generated token: how much of the per-token work is glue.

    python bench/calls.py                    # P = 1 and P = 2 (in process), the default model, one request
    python bench/calls.py --stages 2 --top 15 --functions --requests 32 --max-tokens 64

Runs a file-mode job in this process (``--in-process``: every rank a thread, so a P > 1 run's calls
are all counted, as the sum over its processes) under ``sys.setprofile``, counting each Python call
whose caller and callee are functions of two different modules of the project (pipeline/, comm/,
tasks/, serve/, the entry script; model code, pipeline/models, excluded: a layer calling its
kernels is compute, not glue). Prints calls per generated token and the busiest module pairs (or
functions). The default workload is one greedy request of 64 tokens: one pass per token, so the figure
is the glue of a pass; more requests share a pass and divide it.
Counts do not depend on the machine's speed, only on the code and the workload (greedy requests:
the same tokens every run), so they can be compared across commits.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import tempfile
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PACKAGES = ("pipeline", "comm", "tasks", "serve")
EXCLUDED = ("pipeline/models",)


def module_of(filename: str) -> str | None:
    """The project module a code object belongs to (None: not the project's, or model code)."""
    try:
        rel = Path(filename).resolve().relative_to(ROOT).as_posix()
    except ValueError:
        return None
    if rel == "dist_inference_runner.py":
        return rel
    if not rel.startswith(PACKAGES) or rel.startswith(EXCLUDED):
        return None
    return rel


class Counter:
    def __init__(self):
        self.pairs: collections.Counter = collections.Counter()
        self.functions: collections.Counter = collections.Counter()  # (caller module, callee module:function)
        self._modules: dict[str, str | None] = {}
        self._lock = threading.Lock()

    def _module(self, filename: str) -> str | None:
        m = self._modules.get(filename, False)
        if m is False:
            m = self._modules[filename] = module_of(filename)
        return m

    def profile(self, frame, event, arg):
        if event != "call":
            return
        callee = self._module(frame.f_code.co_filename)
        caller = frame.f_back
        if callee is None or caller is None:
            return
        origin = self._module(caller.f_code.co_filename)
        if origin is None or origin == callee:
            return
        with self._lock:
            self.pairs[(origin, callee)] += 1
            self.functions[(origin, f"{callee}:{frame.f_code.co_name}")] += 1

    @property
    def total(self) -> int:
        return sum(self.pairs.values())


def workload(path: Path, requests: int, max_tokens: int) -> None:
    prompts = ["Once upon a time", "The garden is west of the kitchen.", "Tom has 3 apples and Ann has",
               "Copy: red blue green ->"]
    lines = [{"prompt": prompts[i % len(prompts)] + f" ({i})", "max_tokens": max_tokens, "temperature": 0}
             for i in range(requests)]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))


def measure(stages: int, requests: int, max_tokens: int) -> tuple[Counter, int]:
    import dist_inference_runner
    from pipeline.config.options import parse_options

    with tempfile.TemporaryDirectory() as d:
        src, out = Path(d) / "calls.jsonl", Path(d) / "out.jsonl"
        workload(src, requests, max_tokens)
        args = ["--infer-data", str(src), "--output-path", str(out), "--no-progress", "--status-file", "none",
                "--num-threads", "1"]
        if stages > 1:
            args += ["--in-process", "--pipeline-group-size", str(stages)]
        warm = parse_options([*args, "--overwrite"])
        dist_inference_runner.run(warm)  # loaded once: what is measured is the run, not first imports
        counter = Counter()
        threading.setprofile(counter.profile)
        sys.setprofile(counter.profile)
        try:
            dist_inference_runner.run(parse_options([*args, "--overwrite"]))
        finally:
            sys.setprofile(None)
            threading.setprofile(None)
        generated = json.loads(Path(str(out) + ".summary.json").read_text())["completion_tokens"]
    return counter, generated


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stages", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--requests", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--top", type=int, default=10, help="module pairs listed")
    ap.add_argument("--functions", action="store_true", help="list the called functions instead of module pairs")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args(argv)
    import logging

    logging.basicConfig(level=logging.WARNING)
    figures = {}
    for p in args.stages:
        counter, generated = measure(p, args.requests, args.max_tokens)
        per_token = counter.total / max(1, generated)
        figures[f"P{p}"] = {"calls": counter.total, "generated_tokens": generated, "calls_per_token": round(per_token, 1)}
        print(f"P = {p}: {counter.total} calls between project modules, {generated} generated tokens: "
              f"{per_token:.1f} calls per generated token")
        for (a, b), n in (counter.functions if args.functions else counter.pairs).most_common(args.top):
            print(f"    {n / max(1, generated):7.1f}  {a} -> {b}")
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
