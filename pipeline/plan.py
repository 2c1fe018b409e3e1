"""The run's plan, computed once before anything is loaded: who is where, which layers, which inputs.

:func:`make_plan` is pure apart from reading ``config.json`` and listing input files: it starts no
process and loads no weights, so every mistake in the flags fails here, on every rank alike, with
a message that says what to change (tests/test_plan.py).
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass, field
from pathlib import Path

from comm.dist import resolve_layout

from .loading import CheckpointError, read_config
from .models import DecoderSpec
from .models.backends import ModelShape, stage_shape
from .options import RunOptions, UsageError
from .partition import stage_ranges


@dataclass(frozen=True)
class RunPlan:
    rank: int
    world: int
    local_world: int
    pipeline: int  # stages per pipeline (P)
    data: int  # pipelines (D)
    model_dir: str
    model_name: str  # the "model" of every result
    config: dict
    spec: DecoderSpec | ModelShape  # num_layers, vocab_size, max_positions of either backend
    ranges: list[tuple[int, int]]  # layers of each stage
    inputs: list[str]  # request files (rank 0 of each pipeline only)
    threads: int  # CPU threads of this process
    slots: int  # micro-batches in flight
    warnings: list[str] = field(default_factory=list)

    @property
    def stage(self) -> int:
        return self.rank % self.pipeline

    @property
    def layers(self) -> tuple[int, int]:
        return self.ranges[self.stage]


def make_plan(opts: RunOptions, env: dict[str, str] | None = None, cpu_count: int | None = None) -> RunPlan:
    """The plan of this process (``env``: torchrun's variables; default ``os.environ``)."""
    env = os.environ if env is None else env
    try:
        rank, world, _, local_world, pipeline, data = resolve_layout(
            opts.rank, opts.world_size, opts.pipeline_group_size, opts.data_group_size, env)
        model_dir = opts.model_name or _default_model_dir()
        config = read_config(model_dir)
        spec = stage_shape(config, opts.model_type, opts.backend)
        if opts.batch_invariant and not isinstance(spec, DecoderSpec):
            raise UsageError(f"--batch-invariant needs a native family; {spec.family} runs on transformers' own "
                             "layers (--backend auto/transformers): drop --batch-invariant")
        ranges = stage_ranges(spec.num_layers, pipeline, opts.num_layers, opts.max_layers)
        inputs = resolve_inputs(opts, env) if rank % pipeline == 0 else []
    except (ValueError, CheckpointError) as e:
        raise UsageError(str(e)) from None
    threads = opts.num_threads or max(1, (cpu_count or os.cpu_count() or 1) // max(1, local_world))
    slots = opts.num_micro_batches or pipeline
    warnings = []
    if slots < pipeline:
        warnings.append(f"--num-micro-batches {slots} is fewer than the {pipeline} stages: some stage is always "
                        f"idle; use at least {pipeline}")
    name = Path(opts.model_name).name if opts.model_name else _default_model_name()
    return RunPlan(rank, world, local_world, pipeline, data, model_dir, name, config, spec, ranges, inputs, threads,
                   slots, warnings)


def _default_model_dir() -> str:
    from examples.default_model import default_model_dir

    return default_model_dir()


def _default_model_name() -> str:
    from examples.default_model import DEFAULT_MODEL_NAME

    return DEFAULT_MODEL_NAME


def resolve_inputs(opts: RunOptions, env: dict[str, str]) -> list[str]:
    """--infer-data as given (files, globs, directories), or the PATH of a NAME#PATH job name."""
    specs = opts.infer_data
    if not specs:
        job = opts.job_name or env.get("LSB_JOBNAME") or env.get("SLURM_JOB_NAME") or ""
        if "#" in job:
            specs = [job.split("#", 1)[1]]
    files: list[str] = []
    for spec in specs or []:
        p = Path(spec)
        if p.is_dir():
            found = sorted(str(x) for x in p.glob("*.jsonl") if not x.name.startswith("output_"))
        elif any(c in spec for c in "*?["):
            found = sorted(x for x in glob.glob(spec) if not Path(x).name.startswith("output_"))
        elif p.is_file():
            found = [spec]
        else:
            raise UsageError(f"--infer-data {spec}: no such file or directory")
        if not found:
            raise UsageError(f"--infer-data {spec}: matches no .jsonl files")
        files += found
    return files


def output_for(input_path: str, output_path: str | None, several: bool) -> str:
    """``output_<input name>`` beside the input, or in/at ``--output-path``."""
    name = "output_" + Path(input_path).name
    if output_path is None:
        return str(Path(input_path).with_name(name))
    return str(Path(output_path) / name) if several else output_path
