"""llama.cpp's server beside this runner: the same checkpoint and the same requests, generated tokens/s and
peak memory, batch work and single-stream decode.

    python bench/llamacpp.py                                  # 1B shapes: f32, bf16, int8/Q8_0; batch 32 + single
    python bench/llamacpp.py --batch 32,256 --repeats 2
    python bench/llamacpp.py --model 8b --precisions bf16,int8 --batch 32
    python bench/llamacpp.py --model 8b --precisions bf16,int8 --batch '' --isa avx2   # single stream, AVX2 only

What it does, once per machine (cached under ``$DIST_INFER_CACHE/llamacpp``, never in the repository):

1. **llama.cpp's server**, built from the llama.cpp that the llama-cpp-python sdist vendors
   (``pip download --no-binary :all: --no-deps llama-cpp-python==VERSION``; ``cmake`` and a C/C++
   compiler, ``-DGGML_NATIVE=ON``: every instruction the CPU has). Without cmake or a compiler, or if
   the download or the build fails, the benchmark says why and exits 0 without a comparison.
2. **The checkpoint**: a random Llama of the chosen shape (bench/real_size.py's builder: bf16 weights,
   the project's tokenizer; ``1b``: TinyLlama-1.1B's shape, ``8b``: Llama-3.1-8B's), converted to GGUF
   f32, bf16 and Q8_0 by the vendored ``convert_hf_to_gguf.py`` (with the vendored ``gguf`` package; the
   tokenizer's pre-tokenizer is declared GPT-2's byte-level BPE, as it is).

Then per precision (runner ``--dtype float32`` against f32 GGUF, ``--dtype bfloat16`` against bf16,
``--quantize int8`` against Q8_0) and workload, the two engines run the same requests, interleaved
``runner, llama.cpp, llama.cpp, runner`` (``--repeats`` such quartets):

- **batch**: ``--batch`` requests (each number a workload; 32 by default) of ``--prompt`` token ids
  (random ids of the tokenizer's range, the same list for both) and ``--gen`` greedy tokens. The runner
  answers the request file at P = 1 (``--num-threads`` = ``--threads``); llama-server (``-t`` the same,
  ``-np --slots`` slots with continuous batching, a context of slots x (prompt + gen)) gets every
  request at once over HTTP. Time: the runner's own per-file time (its summary; loading excluded),
  llama.cpp's from the first request sent to the last answer (the server started and warmed up first).
- **single**: one request of 16 prompt tokens and ``--gen`` generated, the decode speed a chat user
  sees; also reported as the share of the memory-bandwidth bound, tokens/s x bytes of weights read per
  token / bandwidth (the best of 7 reads of a 1 GiB tensor on the same threads, measured in the run).

Generated tokens are what each engine reports (EOS ends a row early on both; a random model rarely
picks it). Printed per precision and workload: each engine's generated tokens/s (median of its runs),
the ratio runner / llama.cpp, and each engine's peak RSS over its runs (the runner's process, loading
included; llama-server's VmHWM).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tarfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.real_size import SHAPES, build  # noqa: E402
from pipeline.paths import cache_root  # noqa: E402

LLAMA_CPP_PYTHON = "0.3.36"  # the sdist whose vendored llama.cpp is built
PRECISIONS = {"f32": (["--dtype", "float32"], "f32"), "bf16": (["--dtype", "bfloat16"], "bf16"),
              "int8": (["--quantize", "int8"], "q8_0")}
MODELS = {"1b": "1b", "8b": "8b"}
MB = 2**20


def cache() -> Path:
    return cache_root() / "llamacpp"


# ------------------------------------------------------------------------------------------------
# llama.cpp: source, build, conversion
# ------------------------------------------------------------------------------------------------
def source_dir() -> Path | str:
    """The vendored llama.cpp of the llama-cpp-python sdist (downloaded once), or why not."""
    root = cache() / f"llama-cpp-python-{LLAMA_CPP_PYTHON}"
    src = root / f"llama_cpp_python-{LLAMA_CPP_PYTHON}" / "vendor" / "llama.cpp"
    if (src / "CMakeLists.txt").is_file():
        return src
    root.mkdir(parents=True, exist_ok=True)
    sdist = root / f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz"
    if not sdist.is_file():
        r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
                            f"llama-cpp-python=={LLAMA_CPP_PYTHON}", "-d", str(root)], capture_output=True, text=True)
        if r.returncode != 0 or not sdist.is_file():
            return f"pip could not download the llama-cpp-python sdist: {r.stderr.strip()[-500:]}"
    with tarfile.open(sdist) as tar:
        tar.extractall(root, filter="data")
    return src if (src / "CMakeLists.txt").is_file() else f"{sdist} has no vendor/llama.cpp"


# --isa avx2: both engines held to AVX2 and FMA on a CPU that has more. The runner through the variables
# PyTorch, oneDNN and MKL read (its C loops follow PyTorch's, pipeline.models.kernels.native._march);
# llama.cpp built for that level instead of -DGGML_NATIVE=ON.
ISA_ENV = {"avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}}
ISA_CMAKE = {"native": ["-DGGML_NATIVE=ON"],
             "avx2": ["-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON",
                      "-DGGML_BMI2=ON", "-DGGML_AVX512=OFF"]}


def server_binary(jobs: int, isa: str = "native") -> Path | str:
    """llama-server (and llama-quantize), built once with cmake for ``isa``, or why not."""
    build_dir = cache() / f"build-{LLAMA_CPP_PYTHON}{'' if isa == 'native' else '-' + isa}"
    binary = build_dir / "bin" / "llama-server"
    if binary.is_file():
        return binary
    missing = [tool for tool in ("cmake", "cc", "c++") if shutil.which(tool) is None]
    if missing:
        return f"no {', '.join(missing)} on PATH: llama.cpp cannot be built here"
    src = source_dir()
    if isinstance(src, str):
        return src
    configure = ["cmake", "-S", str(src), "-B", str(build_dir), "-DCMAKE_BUILD_TYPE=Release", *ISA_CMAKE[isa],
                 "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=ON",
                 "-DLLAMA_BUILD_TOOLS=ON", "-DBUILD_SHARED_LIBS=OFF"]
    for cmd in (configure, ["cmake", "--build", str(build_dir), "--target", "llama-server", "-j", str(jobs)]):
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            return f"{' '.join(cmd[:3])} failed: {(r.stderr or r.stdout).strip()[-1500:]}"
    return binary if binary.is_file() else f"the build made no {binary}"


CONVERT = """
import sys
sys.path.insert(0, sys.argv[1])           # the vendored gguf package, matching the converter
sys.path.insert(0, sys.argv[2])           # the converter's folder
import convert_hf_to_gguf as c
try:  # where TextModel lives moved between llama.cpp versions
    from conversion.base import TextModel
except ImportError:
    TextModel = c.TextModel
# the project's tokenizer is a byte-level BPE of its own: the converter knows pre-tokenizers by a hash of
# their output on a probe text and stops at an unknown one; it splits as GPT-2's does
_pre = TextModel.get_vocab_base_pre
def get_vocab_base_pre(self, tokenizer):
    try:
        return _pre(self, tokenizer)
    except NotImplementedError:
        return "gpt-2"
TextModel.get_vocab_base_pre = get_vocab_base_pre
sys.argv = ["convert_hf_to_gguf.py", *sys.argv[3:]]
c.main()
"""


def gguf(model_dir: Path, outtype: str) -> Path:
    """``model_dir`` converted to GGUF ``outtype`` (f32, bf16, q8_0), once."""
    out = cache() / "gguf" / f"{model_dir.name}-{outtype}.gguf"
    if out.is_file():
        return out
    src = source_dir()
    assert isinstance(src, Path), src
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    log = out.with_suffix(".log")
    with open(log, "w") as f:
        r = subprocess.run([sys.executable, "-c", CONVERT, str(src / "gguf-py"), str(src), str(model_dir), "--outtype",
                            outtype, "--outfile", str(tmp)], stdout=f, stderr=subprocess.STDOUT)
    if r.returncode != 0:
        raise RuntimeError(f"convert_hf_to_gguf.py failed (exit {r.returncode}): {log.read_text()[-2000:]}")
    tmp.rename(out)
    return out


# ------------------------------------------------------------------------------------------------
# the engines
# ------------------------------------------------------------------------------------------------
def run_runner(model_dir: Path, flags: list[str], requests: list[list[int]], gen: int, threads: int,
               work: Path, isa: str = "native") -> dict:
    """The runner at P = 1 on the requests: generated tokens, its per-file seconds, peak RSS (loading
    included) and its memory account."""
    from bench.throughput import run_measured

    data = work / "requests.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "max_tokens": gen, "temperature": 0}) + "\n" for p in requests))
    out = work / "runner-out.jsonl"
    cmd = [sys.executable, str(REPO / "dist_inference_runner.py"), "--model-name", str(model_dir), "--infer-data",
           str(data), "--output-path", str(out), "--overwrite", "--no-progress", "--num-threads", str(threads),
           *flags]
    env = dict(os.environ, PYTHONPATH=str(REPO), DIST_INFER_LOG="WARNING", **ISA_ENV.get(isa, {}))
    m = run_measured(cmd, env, work / "runner.log", timeout=7200)
    if m["rc"] != 0:
        raise RuntimeError(f"runner failed: {(work / 'runner.log').read_text()[-2000:]}")
    s = json.loads(Path(f"{out}.summary.json").read_text())
    # the runner's own VmHWM (its summary): wait4's ru_maxrss keeps this process's resident set at the fork
    peak = s.get("last_rank_peak_rss_mb") or m["peak_rss_mb"]
    return {"generated": s["completion_tokens"], "seconds": s["wall_seconds"], "peak_rss_mb": peak,
            "stage_memory_mb": s.get("stage_memory_mb")}


def _die_with_parent() -> None:
    """In the server's process before exec: the kernel kills it when the benchmark dies (Linux)."""
    try:
        import ctypes
        import signal

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class LlamaServer:
    """llama-server on one GGUF file: started, waited for, measured, stopped."""

    def __init__(self, binary: Path, model: Path, threads: int, slots: int, ctx_per_slot: int, work: Path,
                 extra: list[str] = ()):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.log = open(work / "llama-server.log", "w")
        self.proc = subprocess.Popen([str(binary), "-m", str(model), "-t", str(threads), "-tb", str(threads),
                                      "-np", str(slots), "-c", str(slots * ctx_per_slot), "--host", "127.0.0.1",
                                      "--port", str(self.port), "--no-webui", "-b", "2048", "-ub", "512", *extra],
                                     stdout=self.log, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent)
        deadline = time.time() + 1800
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited: {(work / 'llama-server.log').read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.5)
        self.complete([1, 2, 3, 4], 4)  # warm-up

    def complete(self, prompt: list[int], gen: int) -> int:
        body = json.dumps({"prompt": prompt, "n_predict": gen, "temperature": 0, "cache_prompt": False,
                           "seed": 0}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/completion", body,
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=7200) as r:
            out = json.loads(r.read())
        return int(out.get("tokens_predicted") or out.get("timings", {}).get("predicted_n") or 0)

    def run(self, requests: list[list[int]], gen: int) -> dict:
        t0 = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(max_workers=len(requests)) as pool:
            generated = sum(pool.map(lambda p: self.complete(p, gen), requests))
        return {"generated": generated, "seconds": time.perf_counter() - t0}

    def peak_rss_mb(self) -> float:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
        return float("nan")

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


# ------------------------------------------------------------------------------------------------
# the comparison
# ------------------------------------------------------------------------------------------------
def read_bandwidth(threads: int) -> float:
    """GB/s of reading memory: the best of 7 sums of a 1 GiB float32 tensor on ``threads`` threads (a
    decode step reads its weights and writes little; the best run is the closest to what the memory
    gives, on a machine where other work takes some of it)."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    a = torch.ones(1 << 28, dtype=torch.float32)
    a.sum()
    best = 0.0
    for _ in range(7):
        t0 = time.perf_counter()
        a.sum()
        best = max(best, a.numel() * 4 / 1e9 / (time.perf_counter() - t0))
    torch.set_num_threads(old)
    return best


def workloads(args, vocab: int) -> list[tuple[str, list[list[int]]]]:
    """(name, prompts): each --batch size, then single-stream decode; random ids in the tokenizer's range."""
    rng = random.Random(0)
    out = [(f"batch {n}", [[rng.randrange(3, vocab) for _ in range(args.prompt)] for _ in range(n)])
           for n in args.batch]
    if not args.no_single:
        out.append(("single", [[rng.randrange(3, vocab) for _ in range(16)]]))
    return out


def weight_bytes_per_token(model_dir: Path, precision: str, engine: str) -> int:
    """Bytes of weights a decode step reads: every layer's projections and the head (not the embedding,
    a row lookup). The runner keeps its head in float32 under ``--quantize int8``; llama.cpp's Q8_0 is
    34 bytes per 32 weights, its head included."""
    cfg = json.loads((model_dir / "config.json").read_text())
    h, i, layers, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    kv = cfg["num_key_value_heads"] * h // cfg["num_attention_heads"]
    per_layer = h * (h + 2 * kv) + h * h + 3 * h * i
    size = {"f32": 4.0, "bf16": 2.0, "int8": 1.0 if engine == "runner" else 34 / 32}[precision]
    head = vocab * h * (4.0 if precision == "int8" and engine == "runner" else size)
    return int(layers * per_layer * size + head)


def compare(args, binary: Path, model_dir: Path, work: Path) -> list[dict]:
    from pipeline.loading.default_model import build_tokenizer

    vocab = len(build_tokenizer())
    bw = read_bandwidth(args.threads)
    rows = []
    for precision in args.precisions:
        flags, outtype = PRECISIONS[precision]
        model_file = gguf(model_dir, outtype)
        for name, requests in workloads(args, vocab):
            runs = {"runner": [], "llama.cpp": []}
            peaks = {"runner": 0.0, "llama.cpp": 0.0}
            memory = None
            slots = min(args.slots, len(requests))
            for _ in range(args.repeats):
                for engine in ("runner", "llama.cpp", "llama.cpp", "runner"):
                    if engine == "runner":
                        r = run_runner(model_dir, flags, requests, args.gen, args.threads, work, args.isa)
                        memory = r["stage_memory_mb"]
                    else:
                        server = LlamaServer(binary, model_file, args.threads, slots, args.prompt + args.gen + 8, work,
                                             args.llama_args.split())
                        try:
                            r = server.run(requests, args.gen)
                            r["peak_rss_mb"] = server.peak_rss_mb()
                        finally:
                            server.close()
                    runs[engine].append(r["generated"] / r["seconds"])
                    peaks[engine] = max(peaks[engine], r["peak_rss_mb"])
                    print(f"  {precision} {name} {engine}: {r['generated']} tokens in {r['seconds']:.2f} s "
                          f"({runs[engine][-1]:.1f} tok/s), peak RSS {r['peak_rss_mb']:.0f} MB", flush=True)
            tok_s = {k: statistics.median(v) for k, v in runs.items()}
            row = {"precision": precision, "workload": name, "tok_s": tok_s, "runs": runs,
                   "ratio": tok_s["runner"] / tok_s["llama.cpp"], "peak_rss_mb": peaks, "runner_memory_mb": memory}
            if name == "single":
                row["bandwidth_share"] = {k: v * weight_bytes_per_token(model_dir, precision, k) / (bw * 1e9)
                                          for k, v in tok_s.items()}
                row["bandwidth_gb_s"] = bw
            rows.append(row)
    return rows


def report(rows: list[dict], args, model_dir: Path) -> str:
    from bench.machine import cpu_model

    held = "" if args.isa == "native" else f" held to {args.isa.upper()} (--isa)"
    lines = [f"{cpu_model()}{held}, {args.threads} threads each; model {args.model} ({model_dir.name}); llama.cpp from "
             f"llama-cpp-python {LLAMA_CPP_PYTHON} {args.llama_args}; {args.repeats} x (runner, llama.cpp, llama.cpp, "
             "runner)",
             f"{'precision':<9} {'workload':<10} {'runner tok/s':>12} {'llama.cpp tok/s':>15} {'ratio':>7} "
             f"{'runner peak MB':>14} {'llama.cpp peak MB':>17}  bandwidth share (runner, llama.cpp)"]
    for r in rows:
        share = r.get("bandwidth_share")
        note = f"{share['runner']:.2f}, {share['llama.cpp']:.2f} of {r['bandwidth_gb_s']:.1f} GB/s" if share else ""
        lines.append(f"{r['precision']:<9} {r['workload']:<10} {r['tok_s']['runner']:>12.1f} "
                     f"{r['tok_s']['llama.cpp']:>15.1f} {r['ratio']:>6.2f}x {r['peak_rss_mb']['runner']:>14.0f} "
                     f"{r['peak_rss_mb']['llama.cpp']:>17.0f}  {note}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from pipeline.config.cores import usable_cores

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="1b")
    ap.add_argument("--precisions", default="f32,bf16,int8", help="comma list of f32, bf16, int8 (Q8_0 for llama.cpp)")
    ap.add_argument("--batch", default="32", help="comma list of request counts for the batch workloads (e.g. 32,256)")
    ap.add_argument("--no-single", action="store_true", help="leave out the single-stream decode workload")
    ap.add_argument("--prompt", type=int, default=128, help="prompt tokens of each batch request")
    ap.add_argument("--gen", type=int, default=128, help="generated tokens of each request")
    ap.add_argument("--threads", type=int, default=usable_cores(), help="threads of each engine (default: the cores)")
    ap.add_argument("--slots", type=int, default=16, help="llama-server's parallel slots (continuous batching)")
    ap.add_argument("--repeats", type=int, default=1, help="(runner, llama.cpp, llama.cpp, runner) quartets")
    ap.add_argument("--llama-args", default="", help="more llama-server flags, e.g. '--poll 0' (its threads sleep "
                    "instead of spinning while they wait: what the runner's do, OMP_WAIT_POLICY=PASSIVE)")
    ap.add_argument("--isa", choices=("native", "avx2"), default="native", help="native: every instruction the CPU "
                    "has; avx2: both engines held to AVX2 and FMA (an AVX2-only node's paths, measured on a CPU with "
                    "more; the memory bandwidth stays this machine's)")
    ap.add_argument("--json", help="write the results here too")
    args = ap.parse_args(argv)
    args.precisions = [p for p in args.precisions.split(",") if p]
    args.batch = [int(n) for n in args.batch.split(",") if n]
    if any(p not in PRECISIONS for p in args.precisions) or args.repeats < 1 or any(n < 1 for n in args.batch):
        ap.error(f"--precisions from {', '.join(PRECISIONS)}; --repeats and --batch sizes at least 1")
    binary = server_binary(args.threads, args.isa)
    if isinstance(binary, str):
        print(f"bench/llamacpp.py: skipped, llama.cpp's server is not available: {binary}")
        return 0
    model_dir = cache_root() / "real-size" / f"llama-{MODELS[args.model]}"
    if not (model_dir / "config.json").is_file():
        build(model_dir, SHAPES[MODELS[args.model]])
    work = cache() / "work"
    work.mkdir(parents=True, exist_ok=True)
    rows = compare(args, binary, model_dir, work)
    if args.json:  # first: the figures are kept whatever the report does
        Path(args.json).write_text(json.dumps({"model": args.model, "rows": rows}, indent=1))
    print(report(rows, args, model_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
