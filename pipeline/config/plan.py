"""The run's plan, computed once before anything is loaded: who is where, which layers, which inputs.

:func:`make_plan` is pure apart from reading ``config.json``, listing input files and looking at
their outputs: it starts no process and loads no weights, so every mistake in the flags fails here,
on every rank alike, with a message that says what to change (tests/unit/pipeline/config/test_plan.py). That includes
an output or journal written by another model or other settings (tasks/writer.py): a finished
output counts as this run's, and is skipped, only when its record matches this run's fingerprint.
"""

from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from comm.dist import resolve_layout
from tasks.writer import input_id, journal_path, output_problem

from pipeline.loading.hub import (ModelSource, ModelUnavailable, missing_tokenizer, missing_weights, resolve_adapter,
                                  resolve_model)
from pipeline.loading.quantized import checkpoint_format
from pipeline.loading.stage_weights import CheckpointError, read_config
from pipeline.loading.tensor_store import SafetensorsFile, check_weights_present
from pipeline.models.families import DecoderSpec
from pipeline.models.backends import ModelShape, stage_shape
from pipeline.config.capabilities import refusals
from pipeline.config.options import RunOptions, UsageError, parse_lora_flag
from pipeline.config.cores import default_threads, layer_weights, usable_cores
from pipeline.config.partition import gib, parse_layers_per_stage, stage_ranges
from pipeline.loading.adapters import check_adapter, layer_bytes, read_adapter
from pipeline.config.fit import fit_problem, local_stages, stage_needs, suggestions
from pipeline.config.sizing import available_ram, memory_layout, model_parts, planned_budget
from pipeline.loading.default_model import DEFAULT_MODEL_NAME, default_model_dir


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
    spec: DecoderSpec | ModelShape  # num_layers, vocab_size, max_positions, kv_dim of either backend
    ranges: list[tuple[int, int]]  # layers of each stage
    inputs: list[str]  # request files (rank 0 of each pipeline only)
    threads: int  # CPU threads of this process
    slots: int  # micro-batches in flight
    warnings: list[str] = field(default_factory=list)
    fingerprint: dict = field(default_factory=dict)  # what results depend on; journals and outputs record it
    complete: list[str] = field(default_factory=list)  # inputs whose output is complete and this run's
    all_inputs: list[str] = field(default_factory=list)  # the request files (every rank)
    adapters: list = field(default_factory=list)  # LoRA adapters (pipeline.loading.adapters.Adapter), index 1, 2, ...
    layout_note: str | None = None  # the --stage-memory plan, printed before loading
    source: ModelSource | None = None  # where the weights are: the folder, or a hub snapshot fetching on demand
    # CPU stages of several threads each that add up to more than this node's cores: they take turns with
    # the cores (--num-micro-batches 1 --num-threads <cores>), and passes that would run side by side contend
    turns: bool = False

    @property
    def nothing_to_do(self) -> bool:
        """Every input's output is finished already: no rank needs to start or load anything."""
        return bool(self.all_inputs) and len(self.complete) == len(self.all_inputs)

    @property
    def served_name(self) -> str:
        """Serve mode's default model name: the hub id as clients write it (``org/name``; the commit is in
        the log), else the results' name."""
        return self.source.repo_id if self.source and self.source.repo_id else self.model_name

    @property
    def stage(self) -> int:
        return self.rank % self.pipeline

    @property
    def layers(self) -> tuple[int, int]:
        return self.ranges[self.stage]


def _check_kv_cache_dtype(opts: RunOptions, spec) -> None:
    """--kv-cache-dtype int8 keeps a float32 scale after each head's values: head dims in whole float32 words."""
    if opts.kv_cache_dtype == "int8" and isinstance(spec, DecoderSpec) and spec.head_dim % 4:
        raise UsageError(f"--kv-cache-dtype int8 keeps a float32 scale after each head's values, which needs a head "
                         f"dimension divisible by 4 (this model's is {spec.head_dim}): drop --kv-cache-dtype")


def _check_checkpoint_format(config: dict, spec):
    """A pre-quantized checkpoint's format (None: float); one of a mixture-of-experts model is refused."""
    fmt = checkpoint_format(config)  # UnsupportedQuantization (a ValueError) names what is not understood
    if fmt is not None and isinstance(spec, DecoderSpec) and spec.moe is not None:
        raise UsageError(f"a {fmt.name} checkpoint of a mixture-of-experts model: quantized experts are not supported")
    return fmt


def make_plan(opts: RunOptions, env: dict[str, str] | None = None, cpu_count: int | None = None) -> RunPlan:
    """The plan of this process (``env``: torchrun's variables; default ``os.environ``)."""
    env = os.environ if env is None else env
    try:
        rank, world, _, local_world, pipeline, data = resolve_layout(
            opts.rank, opts.world_size, opts.pipeline_group_size, opts.data_group_size, env)
        source = resolve_model(opts.model_name, opts.revision, opts.cache_dir) if opts.model_name else \
            ModelSource(Path(default_model_dir()))
        model_dir = str(source.folder)
        config = read_config(model_dir)
        spec = stage_shape(config, opts.model_type, opts.backend)  # a model that cannot run says so first
        if source.repo_id is None:
            check_weights_present(model_dir)
        fmt = _check_checkpoint_format(config, spec)
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if opts.dist_backend == "nccl" and device.type != "cuda":
            raise UsageError("--dist-backend nccl needs CUDA GPUs and none is visible: use auto (gloo on CPUs)")
        problems = refusals(opts, None if isinstance(spec, DecoderSpec) else f"{spec.family} (--backend auto)",
                            device.type, fmt.name if fmt is not None else None)
        if problems:
            raise UsageError("; ".join(problems))
        _check_kv_cache_dtype(opts, spec)
        all_inputs = resolve_inputs(opts, env)
        check_outputs_distinct(all_inputs, opts.output_path)
        dtype = resolve_dtype(opts.torch_dtype_name, config, device, model_dir)
        adapters = load_adapters(opts, config, spec)
        ranges, layout_note = stage_layout(opts, config, spec, pipeline, local_world, dtype, device, adapters)
        missing_weights(source, ranges[-1][1])  # every shard of the plan's layers cached or fetchable
        missing_tokenizer(source)
        if not opts.no_memory_check and opts.stage_memory is None:
            check_memory(opts, config, spec, ranges, (rank, local_world, pipeline), dtype, device, adapters)
    except (ValueError, CheckpointError, ModelUnavailable) as e:
        raise UsageError(str(e)) from None
    fingerprint = _fingerprint(opts, source, dtype, data, fmt, adapters)
    complete = [] if opts.overwrite else finished_inputs(all_inputs, opts.output_path, fingerprint, data)
    cores = cpu_count or usable_cores()
    threads, slots, turns, warnings = _threads_and_micro_batches(
        opts, config, spec, ranges, (pipeline, data, world, local_world), dtype, device, cores)
    name = _results_name(opts, source, fmt)
    if opts.num_layers is not None and ranges[-1][1] - ranges[-1][0] < opts.num_layers:
        layout = ", ".join(f"stage {i}: layers {a}-{b - 1}" if b - a > 1 else f"stage {i}: layer {a}"
                           for i, (a, b) in enumerate(ranges))
        even = stage_ranges(spec.num_layers, pipeline, None, opts.max_layers)
        warnings.append(f"--num-layers {opts.num_layers} x {pipeline} stages is more than the {ranges[-1][1]} layers: "
                        f"the last stage holds only {ranges[-1][1] - ranges[-1][0]} ({layout}); omit --num-layers "
                        f"for an even split ({', '.join(str(b - a) for a, b in even)} layers)")
    inputs = all_inputs if rank % pipeline == 0 else []
    return RunPlan(rank, world, local_world, pipeline, data, model_dir, name, config, spec, ranges, inputs, threads,
                   slots, warnings, fingerprint, complete, all_inputs, adapters, layout_note, source, turns)


def _fingerprint(opts: RunOptions, source: ModelSource, dtype: torch.dtype, data: int, fmt,
                 adapters: list) -> dict:
    """What results depend on: journals and outputs record it, and a finished output counts as this
    run's only when its record matches."""
    fingerprint = {"model": source.record, "seed": opts.seed, "dtype": str(dtype),
                   "max_layers": opts.max_layers, "truncate_prompts": opts.truncate_prompts,
                   "data_group_size": data, "batch_invariant": opts.batch_invariant, "backend": opts.backend}
    # what else changes results, recorded only when set (absent: the default, as journals written before had it)
    changes = {"quantize": opts.quantize if opts.quantize != "none" else None,  # a precision change
               "checkpoint_format": fmt.name if fmt is not None else None,
               "kv_cache_dtype": opts.kv_cache_dtype if opts.kv_cache_dtype != "auto" else None,
               "reasoning_parser": opts.reasoning_parser if opts.reasoning_parser != "auto" else None,
               "retry_starved": True if opts.retry_starved else None,  # a starved row's line is its rerun's
               "lenient_fields": True if opts.lenient_fields else None,  # unknown fields: ignored, not errors
               "json_string_max_length": opts.json_string_max_length if opts.json_string_max_length != 256 else None,
               "lora": {a.name: adapter_record(a.path) for a in adapters} or None}  # resumed only with the same ones
    fingerprint.update((k, v) for k, v in changes.items() if v is not None)
    return fingerprint


def _threads_and_micro_batches(opts: RunOptions, config: dict, spec, ranges: list[tuple[int, int]],
                               where: tuple[int, int, int, int], dtype, device: torch.device,
                               cores: int) -> tuple[int, int, bool, list[str]]:
    """This process's threads, the micro-batches in flight, whether the stages take turns with the
    node's cores (``RunPlan.turns``) and the warnings about that layout."""
    pipeline, data, world, local_world = where
    stage_weights = _stage_weight_bytes(opts, config, spec, ranges, dtype)
    # big CPU stages on a node of their own take turns with a pipeline's share of its cores unless the
    # flags choose otherwise (see take_turns)
    turn_threads = take_turns(pipeline, data, world, local_world, device, max(stage_weights), cores) \
        if not opts.num_threads and opts.num_micro_batches in (0, 1) else 0
    threads = opts.num_threads or turn_threads or default_threads(
        cores, local_world, layer_weights(config) if device.type == "cpu" else None)
    slots = opts.num_micro_batches or (1 if turn_threads else default_micro_batches(pipeline, device,
                                                                                    max(stage_weights)))
    turns = device.type == "cpu" and pipeline > 1 and threads > 1 and threads * local_world > cores
    warnings = []
    note = _smaller_pipeline_note(opts, config, spec, ranges, (pipeline, world, local_world), dtype, device,
                                  stage_weights, threads, cores, turns)
    if note:
        warnings.append(note)
    if slots < pipeline and not turns:  # (stages taking turns with every core want one micro-batch)
        warnings.append(f"--num-micro-batches {slots} is fewer than the {pipeline} stages: stages wait for one "
                        f"another (only decode rows split over passes, at the end of a file); use at least {pipeline}")
    return threads, slots, turns, warnings


def _results_name(opts: RunOptions, source: ModelSource, fmt) -> str:
    """Every result's "model": the model's name, with what is quantized (``name:int8,kv-int8``)."""
    name = source.name if opts.model_name else DEFAULT_MODEL_NAME
    precision = [opts.quantize] if opts.quantize != "none" else []
    if fmt is not None:  # a pre-quantized checkpoint: its format (gptq-int4, awq-int4, ct-fp8, ...)
        precision.insert(0, fmt.name)
    if opts.kv_cache_dtype != "auto":
        precision.append(f"kv-{opts.kv_cache_dtype}")
    return f"{name}:{','.join(precision)}" if precision else name


# a stage holding more weight bytes than this reads them for longer than the ring's host work takes
# (the last stage's sampling, rank 0's scheduling: a few ms a pass), so its decode passes are bound by weight reads
BIG_STAGE_BYTES = 512 << 20


def default_micro_batches(pipeline: int, device: torch.device, stage_bytes: int) -> int:
    """``--num-micro-batches 0``: P on a GPU and for one stage. A pipeline of CPU stages keeps P + 1 in
    flight (the extra one covers the ring's host work: docs/performance-log.md), but P where a stage's
    weights pass ``BIG_STAGE_BYTES``: its decode passes read them once per micro-batch."""
    if pipeline == 1 or device.type != "cpu":
        return pipeline
    return pipeline if stage_bytes >= BIG_STAGE_BYTES else pipeline + 1


def take_turns(pipeline: int, data: int, world: int, local_world: int, device: torch.device, stage_bytes: int,
               cores: int) -> int:
    """The threads of each stage when the stages of a CPU pipeline should take turns with the cores by
    default, else 0: where every rank runs on this node and a stage's weights pass ``BIG_STAGE_BYTES``.
    Stages taking turns with every core (one micro-batch) read each weight once a step, as fast as P = 1,
    where one-thread stages side by side ran at 0.7-0.8x of it (docs/benchmarks.md)."""
    share = cores // max(1, data)
    if device.type != "cpu" or pipeline == 1 or world > local_world or stage_bytes < BIG_STAGE_BYTES or share < 2:
        return 0
    return share


def _stage_weight_bytes(opts: RunOptions, config: dict, spec, ranges: list[tuple[int, int]], dtype) -> list[int]:
    """Bytes of weights each stage of ``ranges`` holds (config.json on the meta device; 0s where the model
    cannot be sized that way)."""
    try:
        weights, _, first, last = model_parts(config, spec, opts.model_type, dtype, 0, None, opts.quantize == "int8")
    except Exception:  # noqa: BLE001 (a family the sizing does not know: no size-based defaults)
        return [0] * len(ranges)
    return [n.weights for n in stage_needs(weights, [0] * len(weights), first, last, ranges)]


def _smaller_pipeline_note(opts: RunOptions, config: dict, spec, ranges: list[tuple[int, int]],
                           where: tuple[int, int, int], dtype, device, stage_weights: list[int],
                           threads: int, cores: int, turns: bool) -> str | None:
    """A note when every stage of a CPU pipeline shares this node's cores, the stages are big (their
    decode passes bound by weight reads) and one process would fit this node's memory: P = 1 is as fast
    on a quiet node (stages taking turns match it, stages side by side re-read their weights per
    micro-batch), and it says which layout holds up when other work shares the cores."""
    pipeline, world, local_world = where
    if pipeline == 1 or device.type != "cpu" or local_world < world or max(stage_weights) < BIG_STAGE_BYTES:
        return None
    parts = model_parts(config, spec, opts.model_type, dtype, planned_budget(opts.budget, device), None,
                        opts.quantize == "int8", opts.kv_cache_dtype == "int8")
    one = stage_needs(*parts, [(ranges[0][0], ranges[-1][1])])[0]
    if one.total > available_ram():
        return None
    fits = f"one process fits this node's memory (needs {gib(one.total)} of {gib(available_ram())} available)"
    if turns:
        return (f"{pipeline} stages on one node of CPU cores take turns with its cores ({threads} threads each): "
                f"{fits}, and --nproc-per-node 1 is as fast without the stages' hand-offs. On a node shared with "
                f"other work, stages of one thread each side by side (--num-threads 1 --num-micro-batches {pipeline}) "
                "hold up better (docs/usage/scale.md)")
    return (f"{pipeline} stages on one node of CPU cores ({threads} thread(s) each, side by side): {fits}. On a node "
            "to itself each stage re-reads its weights once per micro-batch, where one process reads each once per "
            "decode step for all rows: --nproc-per-node 1, or stages taking turns with every core "
            f"(--num-micro-batches 1 --num-threads {cores * pipeline // local_world}), is as fast or faster; on a node "
            "shared with other work, stages of one thread each hold up better (docs/usage/scale.md)")


def check_memory(opts: RunOptions, config: dict, spec, ranges: list[tuple[int, int]], where: tuple[int, int, int],
                 dtype: torch.dtype, device: torch.device, adapters: list) -> None:
    """UsageError (exit 2, before loading) when the stages on this node cannot fit its memory."""
    rank, local_world, pipeline = where
    per_layer = layer_bytes(adapters, config, spec, dtype.itemsize, opts.model_type) if adapters else None
    weights, kv, first, last = model_parts(config, spec, opts.model_type, dtype, planned_budget(opts.budget, device),
                                           per_layer, opts.quantize == "int8", opts.kv_cache_dtype == "int8")
    tied = getattr(spec, "tie_embeddings", False)  # a stage with both ends shares the table (both backends)
    shared = spec.vocab_size * spec.word_dim * dtype.itemsize if tied else 0
    needs = stage_needs(weights, kv, first, last, ranges, shared)
    here = local_stages(rank, local_world, pipeline)
    free = [torch.cuda.mem_get_info(d)[0] for d in range(torch.cuda.device_count())] if device.type == "cuda" else None
    problem = fit_problem(needs, here, available_ram(), device, free)
    if problem:
        fixes = suggestions(sum(weights) + first + last, sum(kv), dtype, available_ram(), local_world)
        raise UsageError(f"the plan does not fit: {problem}. What would: " + "; ".join(fixes)
                         + " (--no-memory-check skips this check)")


def load_adapters(opts: RunOptions, config: dict, spec) -> list:
    """--lora adapters, their configs and tensor names checked against the model (nothing loaded)."""
    adapters = []
    for value in opts.lora or []:
        name, path = parse_lora_flag(value)
        adapter = read_adapter(name, resolve_adapter(path, opts.cache_dir).folder)
        check_adapter(adapter, config, spec, opts.model_type)
        adapters.append(adapter)
    return adapters


def adapter_record(folder: Path) -> str:
    """An adapter in the run record: its hub id and commit when it is a hub snapshot, else its folder."""
    parts = folder.resolve().parts
    if len(parts) > 3 and parts[-2] == "snapshots" and parts[-3].startswith("models--"):
        return "hub:" + parts[-3].removeprefix("models--").replace("--", "/") + "@" + parts[-1]
    return str(folder.resolve())


def stage_layout(opts: RunOptions, config: dict, spec, pipeline: int, local_world: int, dtype, device,
                 adapters: list) -> tuple[list[tuple[int, int]], str | None]:
    """Layers of each stage: even, --num-layers, --layers-per-stage or --stage-memory."""
    if opts.stage_memory is None:
        sizes = parse_layers_per_stage(opts.layers_per_stage) if opts.layers_per_stage else None
        return stage_ranges(spec.num_layers, pipeline, opts.num_layers, opts.max_layers, sizes), None

    depth = stage_ranges(spec.num_layers, 1, None, opts.max_layers)[0][1]
    per_layer = layer_bytes(adapters, config, spec, dtype.itemsize, opts.model_type) if adapters else None
    sizes, note = memory_layout(opts.stage_memory, config, spec, opts, pipeline, local_world, depth, dtype, device,
                                per_layer)
    return stage_ranges(spec.num_layers, pipeline, None, opts.max_layers, sizes), note


def finished_inputs(inputs: list[str], output_path: str | None, fingerprint: dict, shares: int) -> list[str]:
    """Inputs whose output is complete and was written by a run with this fingerprint. Raises
    UsageError when an output or journal was written by another model or other settings."""
    done = []
    for path in inputs:
        output = output_for(path, output_path, len(inputs) > 1)
        if not Path(output).exists() and not any(journal_path(output, d, shares).exists() for d in range(shares)):
            continue  # nothing written yet: no need to hash the input (a whole-file hash) on every rank
        complete, problem = output_problem(output, dict(fingerprint, input=input_id(path, output)), shares)
        if problem:
            raise UsageError(problem)
        if complete:
            done.append(path)
    return done


def resolve_dtype(name: str, cfg: dict, device: torch.device, model_dir: str | None = None) -> torch.dtype:
    """The run's dtype: ``auto`` = the checkpoint's on GPU, float32 on CPU. The checkpoint's: config.json's
    ``dtype`` or ``torch_dtype`` (a vision-language config's ``text_config`` too), else the dtype the
    safetensors weights are stored in, else float16."""
    table = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
    if name == "auto":
        if device.type == "cpu":
            return torch.float32
        text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else {}
        name = (cfg.get("dtype") or cfg.get("torch_dtype") or text.get("dtype") or text.get("torch_dtype")
                or (stored_dtype(model_dir) if model_dir else None) or "float16")
        if name not in table:
            raise UsageError(f"the checkpoint's dtype {name!r} is not supported; pass --dtype float16, bfloat16 or float32")
    return table[name]


def stored_dtype(model_dir: str) -> str | None:
    """The dtype of the first floating-point tensor of the safetensors weights (None: not safetensors)."""
    folder = Path(model_dir)
    index = folder / "model.safetensors.index.json"
    path = folder / json.loads(index.read_text())["weight_map"].popitem()[1] if index.is_file() else \
        folder / "model.safetensors"
    if not path.is_file():
        return None
    f = SafetensorsFile(path)
    f.close()
    names = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}
    return next((names[e["dtype"]] for e in f.entries.values() if e["dtype"] in names), None)


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


def check_outputs_distinct(inputs: list[str], output_path: str | None) -> None:
    """Two inputs whose results would go to one output file (the same file name under --output-path DIR,
    or one file given twice): refused before anything runs, since one would overwrite or resume the other; so is
    a new output in a folder this process cannot write (its nearest existing folder: the run creates the rest)."""
    if len(inputs) > 1 and output_path is not None and Path(output_path).is_file():
        raise UsageError(f"--output-path {output_path} is a file, but the {len(inputs)} inputs need a folder for their "
                         "outputs: name a folder (it is created), or run the inputs one at a time")
    seen: dict[str, str] = {}
    for path in inputs:
        output = str(Path(output_for(path, output_path, len(inputs) > 1)).resolve())
        if output in seen:
            raise UsageError(f"--infer-data: {seen[output]} and {path} would both write {output} (the output is named "
                             "after the input's file name); rename one of them, or run them separately")
        seen[output] = path
        folder = next(p for p in Path(output).parents if p.exists())
        if not Path(output).exists() and not (folder.is_dir() and os.access(folder, os.W_OK | os.X_OK)):
            raise UsageError(f"{path}: its output {output} cannot be written ({folder} is not a folder this user can "
                             "write); pass --output-path somewhere writable")


def output_for(input_path: str, output_path: str | None, several: bool) -> str:
    """``output_<input name>`` beside the input, or in/at ``--output-path`` (in it: several inputs, or a folder)."""
    name = "output_" + Path(input_path).name
    if output_path is None:
        return str(Path(input_path).with_name(name))
    return str(Path(output_path) / name) if several or Path(output_path).is_dir() else output_path
