"""Serve mode against file mode on the same requests: tokens/s and latency at 1, 8 and 32 clients.

    python bench/serve_bench.py                      # the "quick" Llama of throughput.py, 128 generation requests
    python bench/serve_bench.py --nproc 2 --json /tmp/s.json
    python bench/serve_bench.py --tiny               # seconds, for a smoke run

The model and the request file come from bench/throughput.py (random Llama, prompts cut from the
corpus, greedy, max_tokens 1..N, some stop strings; generation requests only). File mode runs the
file (`--infer-data`; its own summary gives tokens/s over the generation wall time, loading
excluded) before and after serve mode. Serve mode starts one server (`--serve`, same P and threads)
and sends every request once per concurrency level, C client threads each taking the next request
(plain HTTP POSTs to /v1/completions; the clients are built before the clock starts). Per level:
completion tokens/s (tokens / wall), per-request latency p50 and p99, and seconds per request
(wall / requests). File mode and the 8- and 32-client levels run `--repeats` times (default 2) and
keep their best run, as the other benchmarks here do, since the machine's load may drift during a
run (the JSON has every run). Targets (issue #14): at 32 clients >= 0.8x file mode's tokens/s, and
per-request time at 32 clients >= 3x better than one client at a time.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.throughput import PROFILES, RUNNER, build_model, build_workload, free_port  # noqa: E402

LEVELS = (1, 8, 32)

try:  # the openai package's HTTP client: httpx, or its fork httpx2 in newer releases
    import httpx as httpx_client
except ImportError:
    import httpx2 as httpx_client


def launcher(nproc: int) -> list[str]:
    if nproc == 1:
        return [sys.executable, str(RUNNER)]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1",
            "--master-port", str(free_port()), str(RUNNER)]


def env(threads: int) -> dict:
    e = dict(os.environ, OMP_NUM_THREADS=str(threads))
    e["PYTHONPATH"] = str(REPO) + os.pathsep + e.get("PYTHONPATH", "")
    return e


def file_mode(model: Path, requests: Path, out: Path, nproc: int, threads: int) -> dict:
    cmd = [*launcher(nproc), "--model-name", str(model), "--infer-data", str(requests), "--output-path", str(out),
           "--num-threads", str(threads), "--no-progress", "--overwrite"]
    subprocess.run(cmd, check=True, env=env(threads), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    s = json.loads(Path(str(out) + ".summary.json").read_text())
    return {"completion_tokens": s["completion_tokens"], "seconds": s["wall_seconds"],
            "tokens_per_s": s["completion_tokens"] / s["wall_seconds"]}


def post(client, url: str, body: dict) -> tuple[float, int]:
    t0 = time.perf_counter()
    r = client.post(url, json=body, timeout=600)
    r.raise_for_status()
    return time.perf_counter() - t0, r.json()["usage"]["completion_tokens"]


def serve_level(url: str, bodies: list[dict], clients: int) -> dict:
    work: queue.Queue = queue.Queue()
    for b in bodies:
        work.put(b)
    lat, toks, errors = [], [], []
    ready = threading.Barrier(clients + 1)  # clients are built before the clock starts (not server time)

    def worker() -> None:
        with httpx_client.Client() as client:
            ready.wait()
            while True:
                try:
                    body = work.get_nowait()
                except queue.Empty:
                    return
                try:
                    s, n = post(client, url, body)
                    lat.append(s)
                    toks.append(n)
                except Exception as e:  # noqa: BLE001
                    errors.append(repr(e))

    threads = [threading.Thread(target=worker) for _ in range(clients)]
    for t in threads:
        t.start()
    ready.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    lat.sort()
    return {"clients": clients, "requests": len(lat), "errors": errors[:3], "completion_tokens": sum(toks),
            "seconds": wall, "tokens_per_s": sum(toks) / wall, "seconds_per_request": wall / len(bodies),
            "latency_p50": statistics.median(lat), "latency_p99": lat[min(len(lat) - 1, int(0.99 * len(lat)))]}


def serve_mode(model: Path, bodies: list[dict], nproc: int, threads: int, log: Path, repeats: int = 2) -> list[dict]:
    port = free_port()
    cmd = [*launcher(nproc), "--model-name", str(model), "--serve", str(port), "--num-threads", str(threads),
           "--no-progress", "--max-pending", "1024"]
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, env=env(threads), stdout=f, stderr=f, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the server did not start:\n" + log.read_text()[-2000:])
            try:
                if httpx_client.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx_client.HTTPError:
                time.sleep(0.3)
        url = f"http://127.0.0.1:{port}/v1/completions"
        serve_level(url, bodies[:4], 4)  # warm-up
        out = []
        for c in LEVELS:  # the best of `repeats` runs (one for a single client: it only sets the baseline)
            runs = [serve_level(url, bodies, c) for _ in range(1 if c == 1 else repeats)]
            best = max(runs, key=lambda r: r["tokens_per_s"])
            out.append({**best, "runs_tokens_per_s": [r["tokens_per_s"] for r in runs]})
        return out
    finally:
        os.killpg(proc.pid, 15)
        try:
            proc.wait(35)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)


def report(res: dict) -> str:
    f = res["file_mode"]
    lines = [f"model {res['model']}, {res['requests']} generation requests, P = {res['nproc']}",
             f"{'mode':<16}{'tok/s':>9}{'x file':>8}{'s/request':>11}{'p50 s':>8}{'p99 s':>8}",
             f"{'file mode':<16}{f['tokens_per_s']:>9.1f}{1.0:>8.2f}{f['seconds'] / res['requests']:>11.3f}{'':>8}{'':>8}"]
    for lv in res["serve"]:
        lines.append(f"{'serve, ' + str(lv['clients']) + ' clients':<16}{lv['tokens_per_s']:>9.1f}"
                     f"{lv['tokens_per_s'] / f['tokens_per_s']:>8.2f}{lv['seconds_per_request']:>11.3f}"
                     f"{lv['latency_p50']:>8.3f}{lv['latency_p99']:>8.3f}")
    t = res["targets"]
    lines.append(f"targets: 32 clients / file mode tok/s = {t['serve32_vs_file']:.2f} (>= 0.8), "
                 f"per-request time 1 client / 32 clients = {t['speedup_32_vs_1']:.2f} (>= 3)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="the tiny profile (smoke run)")
    ap.add_argument("--requests", type=int, default=128, help="generation requests (default 128)")
    ap.add_argument("--nproc", type=int, default=1, help="pipeline stages P (torchrun for P > 1)")
    ap.add_argument("--cores", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--cache-dir", default=os.environ.get("DIST_INFER_CACHE", str(Path.home() / ".cache" / "dist-inference-runner")) + "/bench")
    ap.add_argument("--repeats", type=int, default=2,
                    help="runs of file mode (half before serve mode, half after) and of the 8- and 32-client levels; "
                         "each keeps its best (default 2)")
    ap.add_argument("--json", default=None, help="write the figures here")
    args = ap.parse_args(argv)
    prof = dict(PROFILES["tiny" if args.tiny else "quick"])
    prof["requests"] = int(args.requests / (1 - 0.2)) + 1  # throughput.py makes 20% scoring requests
    model = build_model(Path(args.cache_dir), prof)
    work = Path(tempfile.mkdtemp(prefix="serve-bench-"))
    build_workload(model, prof, work)
    bodies = [json.loads(x) for x in (work / "gen.jsonl").read_text().splitlines()][: args.requests]
    gen = work / "requests.jsonl"
    gen.write_text("".join(json.dumps(b) + "\n" for b in bodies))
    threads = max(1, args.cores // args.nproc)
    runs = [file_mode(model, gen, work / "out.jsonl", args.nproc, threads) for _ in range(max(1, args.repeats // 2))]
    levels = serve_mode(model, bodies, args.nproc, threads, work / "server.log", args.repeats)
    runs += [file_mode(model, gen, work / "out.jsonl", args.nproc, threads) for _ in range(max(1, args.repeats - len(runs)))]
    fm = {**max(runs, key=lambda r: r["tokens_per_s"]), "runs_tokens_per_s": [r["tokens_per_s"] for r in runs]}
    by = {lv["clients"]: lv for lv in levels}
    res = {"model": model.name, "requests": len(bodies), "nproc": args.nproc, "threads": threads, "file_mode": fm,
           "serve": levels, "targets": {"serve32_vs_file": by[32]["tokens_per_s"] / fm["tokens_per_s"],
                                        "speedup_32_vs_1": by[1]["seconds_per_request"] / by[32]["seconds_per_request"]}}
    print(report(res))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
