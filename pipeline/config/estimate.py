"""``--dry-run``: the plan and the run's cost before the run, without loading weights or writing outputs.

:func:`dry_run` counts the request files' prompt tokens with the tokenizer, prints the plan (layers and
memory per stage, budget, micro-batches, shared-prefix ratio), then estimates the run's time: from the
last run's status file on the same model and P when there is one, else by running the runner itself on
an evenly spaced sample of the lines and scaling its compute time by :func:`work`.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import orjson

import torch

from comm.dist import free_port
from tasks.requests import parse_line
from tasks.status import read_status

from pipeline.config.budget import cpu_budget
from pipeline.config.options import RunOptions
from pipeline.config.partition import gib
from pipeline.config.plan import make_plan, output_for, resolve_dtype
from pipeline.config.sizing import available_ram, model_costs
from pipeline.loading.tokenizer import load_tokenizer

PROMPT_WEIGHT = 0.1  # a prompt token's compute against a generated token's (prefill is batched: measured ~0.05-0.15 on CPU)
RUNNER = Path(__file__).resolve().parents[2] / "dist_inference_runner.py"


@dataclass
class FileCount:
    """What one request file asks for, counted with the tokenizer."""

    path: str
    lines: int = 0
    bad: int = 0  # lines that will be error objects (unparseable, untokenizable)
    prompt_tokens: int = 0
    max_new_tokens: int = 0  # max_tokens x n (best_of) over every prompt: an upper bound
    shared_tokens: int = 0  # prompt tokens in blocks an earlier prompt of the run already had
    per_line: list[tuple[int, int]] = field(default_factory=list)  # (prompt tokens, max new tokens) per line


def work(prompt_tokens: int, new_tokens: float) -> float:
    """A run's compute in generated-token equivalents (the calibration's scale)."""
    return PROMPT_WEIGHT * prompt_tokens + new_tokens


def count_file(path: str, tok, block: int, seen: set[bytes], window: int, vocab: int, lenient: bool = False,
               truncate: bool = False) -> FileCount:
    """Tokens of every line of ``path``; ``seen``: prefix block digests of the run so far (updated). A line
    the driver refuses (ids outside ``vocab``, or beyond the context ``window`` without ``truncate``) is bad."""
    c = FileCount(path)
    with open(path, "rb") as f:
        for index, line in enumerate(x for x in f if x.strip()):
            c.lines += 1
            try:
                req = parse_line(line, index, lenient)
                ids = [chat_ids(tok, p, req.template_kwargs) if req.kind == "chat" else
                       (list(tok(p, add_special_tokens=True)["input_ids"]) if isinstance(p, str) else list(p))
                       for p in req.prompts]
                keep = window - req.params.max_tokens
                if any(not 0 <= t < vocab for i in ids for t in i) or (
                        any(len(i) > keep for i in ids) and (not truncate or keep < 1)):
                    raise ValueError("the run answers it with an error")
                ids = [i[-keep:] for i in ids]  # --truncate-prompts keeps a prompt's last tokens
            except Exception:  # noqa: BLE001 - the run answers it with an error object (RequestError among them)
                c.bad += 1
                c.per_line.append((0, 0))
                continue
            new = sum(req.params.max_tokens * max(req.params.n, req.params.best_of) for _ in ids)
            prompt = sum(len(i) for i in ids)
            c.prompt_tokens += prompt
            c.max_new_tokens += new
            c.per_line.append((prompt, new))
            for i in ids:
                c.shared_tokens += shared_blocks(i, block, seen) * block
    return c


def chat_ids(tok, messages: list[dict], kwargs: dict | None = None) -> list[int]:
    """A chat request's prompt ids (as pipeline.scheduling.intake.chat_ids, errors aside: counted as bad)."""
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **(kwargs or {}))
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    return list(ids[0] if ids and isinstance(ids[0], list) else ids)


def shared_blocks(ids: list[int], block: int, seen: set[bytes]) -> int:
    """Leading whole blocks of ``ids`` already in ``seen`` (chained digests, as the prefix cache keys them)."""
    h, hits, leading = hashlib.sha256(), 0, True
    for b in range(len(ids) // block):
        h.update(orjson.dumps(ids[b * block:(b + 1) * block]))
        d = h.copy().digest()
        if d in seen and leading:
            hits += 1
        else:
            leading = False
        seen.add(d)
    return hits


def plan_lines(plan, opts: RunOptions) -> list[str]:
    """Layers, memory per stage, budget, micro-batches (no weights read)."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = resolve_dtype(opts.torch_dtype_name, plan.config, device, plan.model_dir)
    most = max(b - a for a, b in plan.ranges)
    cell = 2 * most * plan.spec.kv_dim * dtype.itemsize
    if opts.budget != "auto":
        budget, how = int(opts.budget), "--budget"
    elif device.type == "cpu":
        share = available_ram() // max(1, plan.local_world)
        budget, how = cpu_budget(share, 1, cell), f"auto: {gib(share)} of RAM per process"
    else:
        budget, how = 0, "auto: what the GPU has left after loading"
    costs, first, last = model_costs(plan.config, plan.spec, opts.model_type, dtype, budget, None,
                                     opts.quantize == "int8", opts.kv_cache_dtype == "int8")
    lines = [f"model {plan.model_name} ({plan.model_dir}): {plan.spec.num_layers} layers, {dtype}, "
             f"P = {plan.pipeline}, D = {plan.data}, {plan.threads} threads per process"]
    for s, (a, b) in enumerate(plan.ranges):
        mem = sum(costs[a:b]) + (first if s == 0 else 0) + (last if s == plan.pipeline - 1 else 0)
        lines.append(f"  stage {s}: layers {a}-{b - 1} ({b - a}), {gib(mem)} (weights + KV cache of the budget)")
    lines.append(f"budget: {budget} KV-cache tokens ({how}); {plan.slots} micro-batches in flight of at most "
                 f"{opts.max_micro_batch_size} rows")
    return lines


def dry_run(opts: RunOptions, argv: list[str]) -> int:
    """Print the plan and the estimate; exit code 0 (2 for a plan that cannot work)."""
    env = dict(os.environ)
    if "WORLD_SIZE" not in env and opts.world_size is None:  # not launched: plan the pipeline the flags ask for
        world = (opts.pipeline_group_size or 1) * opts.data_group_size
        env.update(WORLD_SIZE=str(world), RANK="0", LOCAL_WORLD_SIZE=str(world))
    if int(env.get("RANK", 0)) != 0 or (opts.rank or 0) != 0:
        return 0  # one rank prints the plan
    plan = make_plan(opts, env)
    out = plan_lines(plan, opts)
    tok = load_tokenizer(plan.model_dir, opts.trust_remote_code)
    seen: set[bytes] = set()
    counts = [count_file(p, tok, opts.prefix_block_size, seen, plan.spec.max_positions, plan.spec.vocab_size,
                         opts.lenient_fields, opts.truncate_prompts) for p in plan.all_inputs]
    prompt = sum(c.prompt_tokens for c in counts)
    for c in counts:
        out.append(f"{c.path}: {c.lines} lines ({c.bad} will be errors), {c.prompt_tokens} prompt tokens, at most "
                   f"{c.max_new_tokens} new tokens")
    shared = sum(c.shared_tokens for c in counts)
    out.append(f"shared prefixes: {shared / prompt if prompt else 0:.1%} of the prompt tokens are in "
               f"{opts.prefix_block_size}-token blocks an earlier prompt has (prefix cache {opts.prefix_cache})")
    print("\n".join(out), flush=True)
    if not counts or not prompt and not sum(c.max_new_tokens for c in counts):
        print("estimate: nothing to compute")
        return 0
    several = len(plan.all_inputs) > 1
    last = previous_status(opts, plan, [output_for(p, opts.output_path, several) for p in plan.all_inputs])
    est = from_status(last, counts) if last else calibrate(opts, argv, plan, counts)
    print(f"estimate: {est['seconds']:.0f}s ({est['how']})", flush=True)
    return 0


def previous_status(opts, plan, outputs: list[str]) -> dict | None:
    """A finished status file of an earlier run of the same model and pipeline size: --status-file, else
    the default one (pipeline.runtime.monitor.status_path) beside the output."""
    if opts.status_file not in (None, "none"):
        path = opts.status_file
    else:
        path = outputs[0] + ".status.json" if len(outputs) == 1 else str(Path(outputs[0]).parent / "status.json")
    s = read_status(path)
    if (s and s["state"] == "finished" and s["run"].get("model") == plan.fingerprint["model"]
            and s["pipeline_size"] == plan.pipeline and s["generated_tokens"] + s["prompt_tokens"] > 0):
        return s
    return None


def from_status(s: dict, counts: list[FileCount]) -> dict:
    """Scale the earlier run's compute time by work; its share of max_tokens generated (measured against
    the files as they are now, normally the same ones) is assumed again."""
    compute = s.get("compute_seconds") or s["elapsed_seconds"]
    loading = s["elapsed_seconds"] - compute
    done = work(s["prompt_tokens"], s["generated_tokens"])
    ratio = min(1.0, s["generated_tokens"] / max(1, sum(c.max_new_tokens for c in counts)))
    now = work(sum(c.prompt_tokens for c in counts), ratio * sum(c.max_new_tokens for c in counts))
    compute = compute * now / max(done, 1e-9)
    return {"seconds": loading + compute, "how": "scaled from the last run's status file, same model and P"}


def sample_lines(n: int) -> list[int]:
    """The calibration's lines: evenly spaced, enough to fill the micro-batches, a small share of a big file."""
    k = min(n, max(32, min(n // 10, 512)))
    return sorted({round(i * n / k) for i in range(k)})


def calibrate(opts: RunOptions, argv: list[str], plan, counts: list[FileCount]) -> dict:
    """Run the sample for real (the same flags, P and model), scale its compute time by work."""
    with tempfile.TemporaryDirectory(prefix="dist-infer-dryrun-") as tmp:
        sample = Path(tmp) / "sample.jsonl"
        picked: list[tuple[int, int]] = []
        with open(sample, "wb") as out:
            for c in counts:
                with open(c.path, "rb") as f:
                    lines = [x for x in f if x.strip()]
                for i in sample_lines(len(lines)):
                    out.write(lines[i].rstrip(b"\r\n") + b"\n")
                    picked.append(c.per_line[i])
        cmd = calibration_command(calibration_args(argv, sample, Path(tmp) / "out.jsonl"), plan.pipeline * plan.data,
                                  opts.in_process)
        print(f"calibrating: {len(picked)} lines on the real stages ...", flush=True)
        t0 = time.monotonic()
        p = subprocess.run(cmd, capture_output=True, text=True)
        wall = time.monotonic() - t0
        if p.returncode != 0:
            raise SystemExit(f"dist_inference_runner.py: error: the calibration run failed:\n{p.stderr[-2000:]}")
        summary = json.loads((Path(tmp) / "out.jsonl.summary.json").read_text())
    compute = summary["wall_seconds"]
    ratio = summary["completion_tokens"] / max(1, sum(new for _, new in picked))
    done = work(summary["prompt_tokens"], summary["completion_tokens"])
    total = work(sum(c.prompt_tokens for c in counts), ratio * sum(c.max_new_tokens for c in counts))
    seconds = (wall - compute) + compute * total / max(done, 1e-9)
    return {"seconds": seconds, "how": f"calibrated on {len(picked)} lines: {compute:.1f}s of compute, "
            f"{wall - compute:.1f}s start-up, {ratio:.0%} of max_tokens generated"}


def calibration_command(args: list[str], world: int, in_process: bool) -> list[str]:
    """The calibration run's command: the runner alone for one rank or ``--in-process`` (every rank in
    that one process, as the run itself would be), else torchrun with a process per rank."""
    if world == 1 or in_process:
        return [sys.executable, str(RUNNER), *args]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world), "--master-addr", "127.0.0.1",
            "--master-port", str(free_port()), str(RUNNER), *args]


DROP = {"--dry-run": 0, "--infer-data": -1, "--output-path": 1, "--status-file": 1, "--metrics-port": 1,
        "--overwrite": 0, "--job-name": 1}


def calibration_args(argv: list[str], data: Path, output: Path) -> list[str]:
    """The user's flags for the sample: its own input and output, no status file or metrics."""
    out, i = [], 0
    while i < len(argv):
        arg, i = argv[i], i + 1
        flag = arg.split("=", 1)[0]
        if flag not in DROP:
            out.append(arg)
        elif "=" not in arg and DROP[flag] == -1:  # every value up to the next flag
            while i < len(argv) and not argv[i].startswith("--"):
                i += 1
        elif "=" not in arg:
            i += DROP[flag]
    return [*out, "--infer-data", str(data), "--output-path", str(output), "--status-file", "none", "--overwrite",
            "--no-progress"]
