"""Threads under contention: the runner at its default settings against the best ``--num-threads`` choice,
on a quiet machine, beside a busy loop on one core, and beside a second runner.

    python bench/contention.py                          # quick start + throughput workload, 3 situations
    python bench/contention.py --profile quick          # the throughput workload's small model (minutes)
    python bench/contention.py --workloads quickstart --situations busy-loop --repeats 5
    python bench/contention.py --env OMP_WAIT_POLICY=ACTIVE   # the same with another OpenMP wait policy

Each measurement is one runner process (``python dist_inference_runner.py``, P = 1) on one workload:

- ``quickstart``: the README's quick start, ``--infer-data examples/requests.jsonl`` (6 requests, the
  embedded default model), five copies of the file in one invocation (one file takes ~0.06 s, mostly
  the scheduler's jitter on a busy machine);
- ``throughput``: bench/throughput.py's workload at its default size (a 12-layer hidden-768 random
  Llama, 256 mixed requests: generation and echo scoring; ``--profile quick``: 4 layers of 256, 48
  requests), both files in one invocation.

The figure is the runner's own per-file time (``wall_seconds`` of each ``<output>.summary.json``, the
time its summary line prints; loading excluded), summed over the files. Situations (``--situations``):

- ``quiet``: nothing started by the benchmark (other users of the machine are not stopped: the
  machine's load from /proc/stat is printed beside every figure);
- ``busy-loop``: a Python process spinning on one core (pinned to the last core of this process's
  affinity mask) for the whole situation;
- ``second-runner``: another runner on the same workload at default settings, restarted in a loop.

Per situation the configurations (``default``: no thread flag; ``--num-threads N`` for N = 1 .. cores)
run interleaved, ``--repeats`` rounds in a rotated order (A B C, B C A, ...), and the table prints each
one's median seconds, the machine's other load meanwhile, and ``default / best``: the ratio of the
default's median to the best configuration's (1.00 = the default is the best choice).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RUNNER = REPO / "dist_inference_runner.py"
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.machine import cpu_model  # noqa: E402

SITUATIONS = ("quiet", "busy-loop", "second-runner")
WORKLOADS = ("quickstart", "throughput")
QUICKSTART_COPIES = 5
THREADS = re.compile(r"(\d+) threads \(")
# spins on one core while the benchmark that started it lives (a killed benchmark must not leave it behind)
BUSY_LOOP = ("import os, sys\nparent = os.getppid()\nos.sched_setaffinity(0, {int(sys.argv[1])})\n"
             "while os.getppid() == parent:\n    for _ in range(10**6):\n        pass\n")


def machine_busy_seconds() -> float:
    """CPU seconds all processes of the machine have used since boot (/proc/stat, idle and iowait excluded)."""
    f = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    return (sum(f[:8]) - f[3] - f[4]) / os.sysconf("SC_CLK_TCK")


def workload_args(name: str, work: Path, profile: str = "full") -> list[str]:
    """The runner's flags for a workload (its files built on first use); ``profile``: the throughput
    workload's size (bench/throughput.py's PROFILES)."""
    if name == "quickstart":  # five copies: one file's 0.06 s is mostly the scheduler's jitter on a busy machine
        copies = []
        for i in range(QUICKSTART_COPIES):
            copies.append(work / "quickstart" / f"requests{i}.jsonl")
            copies[-1].parent.mkdir(parents=True, exist_ok=True)
            copies[-1].write_bytes((REPO / "examples" / "requests.jsonl").read_bytes())
        return ["--infer-data", *map(str, copies), "--output-path", str(work / "qs")]
    from bench.throughput import PROFILES, build_model, build_workload
    from pipeline.paths import cache_root

    prof = PROFILES[profile]
    model = build_model(cache_root() / "bench", prof)
    wdir = work / f"throughput-{profile}"
    if not (wdir / "score.jsonl").is_file():
        build_workload(model, prof, wdir)
    return ["--model-name", str(model), "--infer-data", str(wdir / "gen.jsonl"), str(wdir / "score.jsonl"),
            "--output-path", str(work / "tp")]


def run_once(args: list[str], threads: int | None, env: dict, log: Path) -> tuple[float, float, int]:
    """One runner process: (its summed per-file seconds, other processes' cores busy meanwhile, its threads)."""
    cmd = [sys.executable, str(RUNNER), *args, "--no-progress", "--overwrite"]
    if threads:
        cmd += ["--num-threads", str(threads)]
    t0, busy0, own0, started = time.perf_counter(), machine_busy_seconds(), _children_cpu(), time.time() - 1
    with open(log, "w") as f:
        p = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=str(REPO), timeout=1800)
    wall, busy = time.perf_counter() - t0, machine_busy_seconds() - busy0 - (_children_cpu() - own0)
    text = log.read_text()
    fresh = [f for f in summaries(args) if f.exists() and f.stat().st_mtime >= started]
    times = [json.loads(f.read_text())["wall_seconds"] for f in fresh]
    if p.returncode != 0 or len(times) != len(summaries(args)):
        raise RuntimeError(f"runner failed ({p.returncode}): {text[-2000:]}")
    used = THREADS.search(text)
    return sum(times), max(0.0, busy / wall), int(used.group(1)) if used else 0


def summaries(args: list[str]) -> list[Path]:
    """The per-file summaries (``<output>.summary.json``) a run with ``args`` writes."""
    out = Path(args[args.index("--output-path") + 1])
    inputs = [Path(a) for a in args[args.index("--infer-data") + 1 : args.index("--output-path")]]
    if len(inputs) == 1:
        return [Path(f"{out}.summary.json")]
    return [out / f"output_{i.name}.summary.json" for i in inputs]


def _children_cpu() -> float:
    """CPU seconds of this process's finished children (the measured runner, once reaped)."""
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def cores() -> int:
    from pipeline.config.cores import usable_cores

    return usable_cores()


class Neighbour:
    """What a situation starts beside the measured runner (nothing for ``quiet``)."""

    def __init__(self, situation: str, args: list[str], env: dict, work: Path):
        self.situation, self.args, self.env, self.work = situation, args, env, work
        self.proc: subprocess.Popen | None = None

    def __enter__(self):
        if self.situation == "busy-loop":
            core = sorted(os.sched_getaffinity(0))[-1]
            self.proc = subprocess.Popen([sys.executable, "-c", BUSY_LOOP, str(core)])
        elif self.situation == "second-runner":
            other = [a.replace(str(self.work), str(self.work / "neighbour")) for a in self.args]
            (self.work / "neighbour").mkdir(exist_ok=True)
            loop = ("import os, subprocess, sys\nparent = os.getppid()\nwhile os.getppid() == parent:\n"
                    "    subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\n")
            self.proc = subprocess.Popen([sys.executable, "-c", loop, sys.executable, str(RUNNER), *other,
                                          "--no-progress", "--overwrite"], env=self.env, cwd=str(REPO),
                                         start_new_session=True)
        time.sleep(1.0 if self.proc else 0.0)
        return self

    def __exit__(self, *exc):
        if self.proc is not None:
            if self.situation == "second-runner":
                os.killpg(self.proc.pid, 9)
            else:
                self.proc.kill()
            self.proc.wait()


def measure(situation: str, workload: str, configs: list[int | None], repeats: int, env: dict, work: Path,
            profile: str) -> dict:
    """Each configuration ``repeats`` times, interleaved in rotated orders: medians and the ratio."""
    args = workload_args(workload, work, profile)
    seconds: dict[str, list[float]] = {label(c): [] for c in configs}
    others: list[float] = []
    default_threads = 0
    with Neighbour(situation, args, env, work):
        for r in range(repeats):
            order = configs[r % len(configs):] + configs[: r % len(configs)]
            for c in order:
                s, other, used = run_once(args, c, env, work / "log.txt")
                seconds[label(c)].append(s)
                others.append(other)
                if c is None:
                    default_threads = used
    med = {k: statistics.median(v) for k, v in seconds.items()}
    best = min(med, key=med.get)
    return {"situation": situation, "workload": workload, "median_s": med, "runs_s": seconds, "best": best,
            "default_over_best": med["default"] / med[best], "other_load_cores": statistics.median(others),
            "default_threads": default_threads}


def label(threads: int | None) -> str:
    return "default" if threads is None else f"--num-threads {threads}"


def report(results: list[dict], env_note: str) -> str:
    lines = [f"CPU: {cpu_model()}, {cores()} usable cores; {env_note}",
             "situation      workload    " + "  ".join(f"{k:>16}" for k in results[0]["median_s"])
             + "  default/best  default's threads  others' load (cores)"]
    for r in results:
        lines.append(f"{r['situation']:<14} {r['workload']:<11} " + "  ".join(f"{v:>15.3f}s" for v in r["median_s"].values())
                     + f"  {r['default_over_best']:>11.2f}x  {r['default_threads']:>17}  {r['other_load_cores']:>6.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--situations", default=",".join(SITUATIONS), help=f"comma list of {', '.join(SITUATIONS)}")
    ap.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma list of {', '.join(WORKLOADS)}")
    ap.add_argument("--repeats", type=int, default=3, help="rounds per situation (each runs every configuration once)")
    ap.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                    help="environment for every runner (e.g. OMP_WAIT_POLICY=ACTIVE to measure another wait policy)")
    ap.add_argument("--profile", default="full", choices=("full", "quick", "tiny"),
                    help="the throughput workload's size, as bench/throughput.py's (default: full, its default)")
    ap.add_argument("--work-dir", default=str(REPO / "bench" / "results" / "contention"))
    ap.add_argument("--json", help="write the results here too")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error("--repeats must be at least 1")
    env = dict(os.environ, DIST_INFER_LOG="INFO", PYTHONPATH=str(REPO))
    for item in args.env:
        name, sep, value = item.partition("=")
        if not sep:
            ap.error(f"--env {item}: expected NAME=VALUE")
        env[name] = value
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    configs = [None, *range(1, cores() + 1)]
    results = [measure(s, w, configs, args.repeats, env, work, args.profile) for s in args.situations.split(",")
               for w in args.workloads.split(",")]
    text = report(results, f"extra env: {' '.join(args.env) or 'none'}")
    print(text)
    if args.json:
        Path(args.json).write_text(json.dumps({"cpu": cpu_model(), "env": args.env, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
