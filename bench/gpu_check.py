"""The runner on a GPU, checked in one command that fits a short lease and says everything it found.

    python bench/gpu_check.py --wheels wheels --out "$OUT"   # a GPU machine (its time estimate is printed first)
    python bench/gpu_check.py --device cpu --out /tmp/gc     # the same code on small models, on the CPU

Parts, each isolated (a failure is recorded with the end of its traceback and the next part runs)
and under its own time limit (the limits add up to less than 8 minutes on a GPU):

1. ``environment``: the versions found (Python, torch, CUDA, the GPU, transformers, ...) and which
   of the project's requirements are missing; with ``--wheels DIR`` those are installed from DIR
   (``pip install --no-index --find-links DIR``: the GPU machine has no network).
2. ``parity``: the runner against transformers on the same device, P = 1, for Llama, Qwen3, Gemma 3,
   Mixtral and GPT-2 (tiny random checkpoints made here) in bfloat16 and float16: greedy tokens
   and logprobs (the rule: ``bench/gpu_check_models.py: verdict``).
3. ``file_mode``: a 1B-class Llama (random weights drawn on the device) through file mode against
   transformers' batched ``generate``: generated tokens/s, peak memory against the weights, time to
   the first result.
4. ``two_stages``: P = 2 with both ranks on the one device (``--dist-backend gloo``: NCCL refuses
   two ranks of a GPU), against P = 1; ``quantized``: int8, FP8, GPTQ and AWQ against transformers on
   the dequantized weights; ``structured``: JSON schema, regex and choice constraints.
5. Every figure and failure goes to ``OUT/gpu_check.json`` (written after each part); one summary
   line ends the output. Exit code 0 when every part passed.

``docs/usage/gpus.md`` says how to fetch the wheels and what has run on which GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib
import importlib.metadata as metadata
import json
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

# requirements a GPU machine was seen without (2026-11): what the wheels folder must hold
GPU_MISSING = ("orjson", "llguidance", "fastapi", "uvicorn", "python-multipart")
PLATFORMS = ("manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux_2_28_x86_64", "manylinux_2_31_x86_64",
             "manylinux_2_34_x86_64")
# seconds per part on one H100: (expected, limit). The expectations are estimates (nothing has run on a
# GPU yet); the limits are enforced, and with Python's start they stay under 8 minutes.
GPU_SECONDS = {"environment": (15, 45), "parity": (50, 100), "file_mode": (80, 150), "two_stages": (30, 60),
               "quantized": (30, 60), "structured": (10, 30)}
# --device cpu, small models: expected as measured on 2 busy cores (2026-11-27); wide limits, a CPU may be busier
CPU_SECONDS = {"environment": (1, 300), "parity": (25, 300), "file_mode": (5, 300), "two_stages": (15, 300),
               "quantized": (20, 300), "structured": (5, 300)}
START_SECONDS = 15  # Python, torch and transformers imported before the first part


def pip_download_command(dest: str = "wheels") -> str:
    """The line that fetches :data:`GPU_MISSING` and what they need as wheels for the GPU machine's
    Python (CPython 3.12, x86-64 Linux), on any machine with PyPI."""
    specs = {name: spec for name, spec in requirements() if name in GPU_MISSING}
    platforms = " ".join(f"--platform {p}" for p in PLATFORMS)
    return (f"python -m pip download --dest {dest} --only-binary=:all: --python-version 3.12 --implementation cp "
            f"{platforms} " + " ".join(f'"{n}{specs.get(n, "")}"' for n in GPU_MISSING))


def requirements() -> list[tuple[str, str]]:
    """(name, version specifier) of every line of requirements.txt (the runtime's)."""
    out = []
    for line in (REPO / "requirements.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if m := re.match(r"^([A-Za-z0-9_.\-]+)\s*(.*)$", line):
            out.append((m.group(1), m.group(2).strip()))
    return out


def requirement_status() -> dict[str, dict]:
    """Each requirement: its installed version (None: missing) and whether it satisfies the specifier."""
    from packaging.specifiers import SpecifierSet

    status = {}
    for name, spec in requirements():
        try:
            have = metadata.version(name)
        except metadata.PackageNotFoundError:
            have = None
        ok = have is not None and (not spec or SpecifierSet(spec).contains(have, prereleases=True))
        status[name] = {"required": spec or "any", "installed": have, "ok": ok}
    return status


def install_wheels(wheels: Path, names: list[str], work: Path) -> dict:
    """``pip install --no-index --find-links wheels`` of ``names`` (with the specifiers of requirements.txt)
    into this Python; where its site-packages is not writable, into ``work/site`` put on the path
    (and on PYTHONPATH, for the worker processes of P > 1)."""
    specs = dict(requirements())
    args = [f"{n}{specs.get(n, '')}" for n in names]
    base = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--find-links", str(wheels),
            "--disable-pip-version-check"]
    r = subprocess.run(base + args, capture_output=True, text=True, timeout=120)
    how = "site-packages"
    if r.returncode:
        site = work / "site"
        r = subprocess.run(base + ["--target", str(site)] + args, capture_output=True, text=True, timeout=120)
        sys.path.insert(0, str(site))
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))
        how = str(site)
    importlib.invalidate_caches()
    return {"command": " ".join(base[3:] + args), "into": how, "exit_code": r.returncode,
            "output_tail": (r.stdout + r.stderr).strip().splitlines()[-6:]}


@dataclass
class Check:
    """What every part gets: the device, the scale of its models, a work folder and the options."""

    device: "torch.device"  # noqa: F821
    scale: str  # "gpu": the sizes of the GPU run; "cpu": small models, fast
    work: Path
    wheels: Path | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"


def environment(ck: Check) -> dict:
    """Versions, the GPU, the requirements (installing the missing ones from ``--wheels``) and the torch
    features the GPU paths use, tried on the device."""
    import torch

    versions = {"python": platform.python_version(), "platform": platform.platform(), "torch": torch.__version__,
                "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version() if ck.cuda else None}
    for name in ("transformers", "tokenizers", "safetensors", "huggingface_hub", "numpy", "sentencepiece",
                 "accelerate", "triton"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            versions[name] = metadata.version(name)
    out = {"versions": versions, "device": device_info(ck)}
    before = requirement_status()
    missing = [n for n, s in before.items() if not s["ok"]]
    out["requirements_missing_at_start"] = {n: before[n] for n in missing}
    if missing and ck.wheels is not None:
        out["install"] = install_wheels(ck.wheels, missing, ck.work)
    elif missing:
        ck.notes.append("missing requirements; fetch them with: " + pip_download_command())
    after = requirement_status()
    out["requirements"] = after
    out["requirements_missing"] = [n for n, s in after.items() if not s["ok"]]
    out["features"] = torch_features(ck)
    out["failures"] = [f"requirement {n} missing or too old ({after[n]})" for n in out["requirements_missing"]]
    out["failures"] += [f"torch feature {k}: {v}" for k, v in out["features"].items() if isinstance(v, str)]
    out["ok"] = not out["failures"]
    return out


def device_info(ck: Check) -> dict:
    import torch

    if not ck.cuda:
        from bench.machine import cpu_model

        return {"kind": "cpu", "name": cpu_model(), "cores": os.cpu_count()}
    p = torch.cuda.get_device_properties(ck.device)
    info = {"kind": "cuda", "name": p.name, "capability": f"{p.major}.{p.minor}", "memory_gib": round(p.total_memory / 2**30, 1),
            "multiprocessors": p.multi_processor_count, "count": torch.cuda.device_count()}
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        info["driver"] = smi.stdout.strip() or None
    return info


def torch_features(ck: Check) -> dict:
    """The torch calls the runner's GPU paths make, each tried once on the device: True, False (absent
    where it is optional: the runner falls back) or the error (a string: a failure)."""
    import torch

    feats: dict = {}

    def tryit(name: str, fn, optional: bool = False) -> None:
        try:
            value = fn()
            feats[name] = value if isinstance(value, bool) else True
        except Exception as e:  # noqa: BLE001 - recorded
            feats[name] = False if optional else f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"

    dev = ck.device
    tryit("bfloat16_matmul", lambda: (torch.ones(8, 8, device=dev, dtype=torch.bfloat16) @ torch.ones(8, 8, device=dev,
                                                                                                         dtype=torch.bfloat16)).sum())
    if not ck.cuda:
        return feats
    x = torch.randn(32, 64, device=dev, dtype=torch.bfloat16)
    tryit("mm_out_dtype_float32", lambda: torch.mm(x, x.t(), out_dtype=torch.float32).dtype == torch.float32)
    tryit("flash_attention", torch.backends.cuda.is_flash_attention_available, optional=True)
    tryit("varlen_attn", lambda: __import__("torch.nn.attention.varlen", fromlist=["varlen_attn"]).varlen_attn,
          optional=True)
    tryit("varlen_attn_enable_gqa", lambda: "enable_gqa" in __import__("inspect").signature(
        __import__("torch.nn.attention.varlen", fromlist=["varlen_attn"]).varlen_attn).parameters, optional=True)
    tryit("int_mm", lambda: torch._int_mm(torch.ones(32, 64, dtype=torch.int8, device=dev),
                                          torch.ones(64, 32, dtype=torch.int8, device=dev)), optional=True)
    tryit("float8_e4m3fn", lambda: torch.ones(4, device=dev).to(torch.float8_e4m3fn).float().sum())
    return feats


# -- running the parts ----------------------------------------------------------------------------
class PartTimeout(Exception):
    pass


@contextlib.contextmanager
def time_limit(seconds: float):
    """Raise :class:`PartTimeout` in this (main) thread after ``seconds`` (SIGALRM); elsewhere no limit."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        yield
        return

    def expire(_sig, _frame):
        raise PartTimeout(f"over its limit of {seconds:.0f} s")

    old = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def run_part(name: str, fn, ck: Check, limit: float) -> dict:
    """One part, isolated: its figures, or its failure with the last lines of the traceback."""
    t0 = time.perf_counter()
    rec: dict = {"limit_s": limit}
    try:
        with time_limit(limit):
            figures = fn(ck)
        rec["status"] = "passed" if figures.pop("ok") else "failed"
        rec.update(figures)
    except (Exception, PartTimeout) as e:  # noqa: BLE001 - recorded, the next part runs
        rec["status"] = "timed out" if isinstance(e, PartTimeout) else "error"
        rec["error"] = f"{type(e).__name__}: {e}"[:2000]
        rec["traceback"] = traceback.format_exc().strip().splitlines()[-12:]
    finally:
        from bench.gpu_check_parts import free_memory

        free_memory()
    rec["seconds"] = round(time.perf_counter() - t0, 1)
    return rec


def estimate(names: list[str], gpu: bool) -> tuple[int, int]:
    """(expected, most) seconds of a run of ``names``: the parts' expectations and their limits, plus start-up."""
    table = GPU_SECONDS if gpu else CPU_SECONDS
    return (START_SECONDS + sum(table[n][0] for n in names), START_SECONDS + sum(table[n][1] for n in names))


def summary_line(report: dict) -> str:
    parts = report["parts"]
    passed = sum(p["status"] == "passed" for p in parts.values())
    dev = report.get("device", {}).get("name", "?")
    bits = [f"gpu_check: {'PASS' if passed == len(parts) else 'FAIL'} {passed}/{len(parts)} parts on {dev}, "
            f"torch {report['torch']}, {report['seconds']:.0f} s"]
    for name, p in parts.items():
        bits.append(f"{name} {p['status'] if p['status'] != 'passed' else p.get('headline', 'passed')}")
    return " | ".join(bits) + f" -> {report['json']}"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from bench.gpu_check_parts import PARTS

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="Fetch the wheels for a GPU machine (anywhere with PyPI):\n  " + pip_download_command())
    ap.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                    help="auto: the GPU when there is one; cpu: the same code on small models")
    ap.add_argument("--out", default=os.environ.get("OUT") or str(REPO / "bench" / "results" / "gpu-check"),
                    help="folder of gpu_check.json (default: $OUT, else bench/results/gpu-check)")
    ap.add_argument("--wheels", default=None, help="folder of wheels to install missing requirements from (no network)")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}")
    ap.add_argument("--scale", choices=("gpu", "cpu"), default=None, help="model sizes (default: by device)")
    args = ap.parse_args(argv)
    args.parts = [p for p in args.parts.split(",") if p]
    unknown = [p for p in args.parts if p != "environment" and p not in PARTS]
    if unknown:
        ap.error(f"unknown parts {unknown}: choose among {','.join(PARTS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    from bench.gpu_check_parts import PARTS

    device = torch.device("cuda" if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
                          else "cpu")
    names = ["environment", *[p for p in PARTS if p in args.parts]]
    expected, most = estimate(names, device.type == "cuda")
    print(f"gpu_check: {', '.join(names)} on {device}; estimate about {expected / 60:.1f} min, at most "
          f"{most / 60:.1f} min (the parts' limits)", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {"check": "bench/gpu_check.py", "argv": sys.argv[1:] if argv is None else argv,
              "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "torch": torch.__version__, "estimate_s": {"expected": expected, "most": most},
              "json": str(out / "gpu_check.json"), "parts": {}}
    t0 = time.perf_counter()
    table = GPU_SECONDS if device.type == "cuda" else CPU_SECONDS
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as work:
        ck = Check(device, args.scale or ("gpu" if device.type == "cuda" else "cpu"), Path(work),
                   Path(args.wheels) if args.wheels else None)
        for name in names:
            fn = environment if name == "environment" else PARTS[name]
            print(f"gpu_check: {name} (limit {table[name][1]} s) ...", flush=True)
            rec = run_part(name, fn, ck, table[name][1])
            report["parts"][name] = rec
            if name == "environment":
                report["device"], report["versions"] = rec.get("device", {}), rec.get("versions", {})
                print("  " + json.dumps(report["versions"]) + "\n  " + json.dumps(report["device"]), flush=True)
                if rec.get("requirements_missing_at_start"):
                    print(f"  missing at start: {sorted(rec['requirements_missing_at_start'])}; "
                          f"after install: {rec.get('requirements_missing')}", flush=True)
            print(f"  {name}: {rec['status']} in {rec['seconds']} s"
                  + (f": {rec['error']}" if "error" in rec else "")
                  + (f": {'; '.join(rec['failures'])[:600]}" if rec.get("failures") else ""), flush=True)
            report["seconds"] = round(time.perf_counter() - t0, 1)
            report["notes"] = ck.notes
            (out / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str))
    print(summary_line(report), flush=True)
    return 0 if all(p["status"] == "passed" for p in report["parts"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
