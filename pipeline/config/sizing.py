"""``--stage-memory``: what each layer, the embedding and the head take, and how much each stage has.

Nothing is loaded: parameter shapes come from the stage model built on the meta device (from
config.json), KV-cache bytes from the config and ``--budget``, adapter bytes from the adapters'
safetensors headers. :func:`pipeline.config.partition.memory_sizes` turns these into layers per stage.
"""

from __future__ import annotations

import os

import torch

from pipeline.cache.kv_cache import int8_layer_bytes
from pipeline.loading.quantized import checkpoint_format, quantize_projections, quantized_bytes
from pipeline.loading.stage_weights import embed_side
from pipeline.models.families import DecoderSpec, family_for
from pipeline.config.partition import gib, memory_sizes, parse_stage_memory
from pipeline.models.hf_stage import HFStageModel, hf_config
from pipeline.models.decoder import StageModel
from pipeline.models.kernels.int8 import quantize_linears

CPU_BUDGET = 8192  # the CPU's floor, and what --stage-memory sets aside for the cache when sizing


def model_costs(config: dict, spec, model_type: str | None, dtype: torch.dtype, budget: int,
                adapter_layers: list[int] | None = None, int8: bool = False,
                kv_int8: bool = False) -> tuple[list[int], int, int]:
    """(bytes per layer, embedding-side bytes, head-side bytes) in the run's dtype: a layer's weights (int8
    or a pre-quantized checkpoint's: their packed sizes), its keys and values for ``--budget`` cells (int8
    records with ``kv_int8``) and its adapters' factors."""
    weights, kv, first, last = model_parts(config, spec, model_type, dtype, budget, adapter_layers, int8, kv_int8)
    return [w + k for w, k in zip(weights, kv)], first, last


def model_parts(config: dict, spec, model_type: str | None, dtype: torch.dtype, budget: int,
                adapter_layers: list[int] | None = None, int8: bool = False,
                kv_int8: bool = False) -> tuple[list[int], list[int], int, int]:
    """(weights and adapters per layer, KV cache per layer, embedding-side, head-side bytes): the parts
    of :func:`model_costs`, apart for the memory check (:mod:`pipeline.config.fit`)."""
    size = dtype.itemsize
    layers = [0] * spec.num_layers
    first = last = 0
    for name, numel, part, nbytes in _parameters(config, spec, model_type, int8):
        nbytes = numel * size if nbytes is None else nbytes
        if part == "layer":
            layers[int(name.split(".")[1])] += nbytes
        elif part == "embs":
            first += nbytes
        else:
            last += nbytes
    kv = 2 * budget * spec.kv_dim * size
    if kv_int8:  # the plan allows it only for native families (a DecoderSpec)
        kv = budget * int8_layer_bytes(spec)
    extra = adapter_layers or [0] * spec.num_layers
    return [w + a for w, a in zip(layers, extra)], [kv] * spec.num_layers, first, last


def _parameters(config: dict, spec, model_type: str | None, int8: bool = False):
    """(name, elements, 'layer' | 'embs' | 'head', bytes or None: in the run's dtype) of every
    parameter of the whole model, on meta."""
    if isinstance(spec, DecoderSpec):
        fmt = checkpoint_format(config)  # pre-quantized: the projections at their packed sizes
        embs = embed_side(spec)
        with torch.device("meta"):
            model = StageModel(spec, 0, spec.num_layers, True, True)
            if int8:
                quantize_linears(model)
            if fmt is not None:
                quantize_projections(model, family_for(config, model_type), spec, fmt)
        for name, p in model.named_parameters(remove_duplicate=False):
            part = "layer" if name.startswith("layers.") else "embs" if name in embs else "head"
            yield name, p.numel(), part, p.numel() + 4 * p.shape[0] if p.dtype == torch.int8 else None
        for name, nbytes in (quantized_bytes(model) if fmt is not None else {}).items():
            bias = model.get_submodule(name).bias  # counted above, in the run's dtype
            yield name + ".packed", 0, "layer", nbytes - (0 if bias is None else bias.numel() * bias.element_size())
        return

    model = HFStageModel(hf_config(config, model_type), 0, spec.num_layers, True, True)
    params = dict(model.named_parameters(remove_duplicate=False))
    for name, (_, part) in model.checkpoint_names().items():
        if name in params:
            yield name, params[name].numel(), part, None
    if "lm_head.weight" not in model.checkpoint_names():  # tied: the head stage holds its own copy
        yield "lm_head.weight", params["lm_head.weight"].numel(), "head", None


def stage_memory(value: str, pipeline: int, local_world: int, device: torch.device) -> tuple[list[int], str]:
    """Bytes per stage from ``--stage-memory`` (one size for all, one per stage, or auto), and how
    auto measured them."""
    sizes = parse_stage_memory(value)
    if sizes is not None:
        if len(sizes) == 1:
            return sizes * pipeline, ""
        if len(sizes) != pipeline:
            raise ValueError(f"--stage-memory {value} has {len(sizes)} sizes for {pipeline} pipeline stages: give one "
                             "per stage, or one for every stage")
        return sizes, ""
    if device.type == "cuda":
        count = torch.cuda.device_count()
        free = [torch.cuda.mem_get_info(s % count)[0] for s in range(pipeline)]
        return free, (f"auto: free memory of local CUDA devices 0..{min(pipeline, count) - 1} (stage s on device "
                      f"s mod {count}); pass sizes for pipelines that span nodes")
    available = available_ram()
    share = available // max(1, local_world)
    return [share] * pipeline, (f"auto on CPU: available RAM {gib(available)} divided among {local_world} local "
                                f"process(es) = {gib(share)} per stage")


def available_ram() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def planned_budget(budget: int | str, device: torch.device) -> int:
    """KV-cache cells to set aside per stage when sizing: ``--budget N`` itself; with ``auto`` the CPU's
    fixed budget, and nothing on a GPU (there the cache takes what the layers leave, after loading)."""
    if budget != "auto":
        return int(budget)
    return 0 if device.type == "cuda" else CPU_BUDGET


def memory_layout(value: str, config: dict, spec, opts, pipeline: int, local_world: int, depth: int,
                  dtype: torch.dtype, device: torch.device, adapter_layers: list[int] | None = None
                  ) -> tuple[list[int], str]:
    """Layers per stage for ``--stage-memory`` and the plan as text (printed before loading)."""
    memory, how = stage_memory(value, pipeline, local_world, device)
    budget = planned_budget(opts.budget, device)
    costs, first, last = model_costs(config, spec, opts.model_type, dtype, budget, adapter_layers,
                                     opts.quantize == "int8", opts.kv_cache_dtype == "int8")
    costs = costs[:depth]
    sizes = memory_sizes(costs, first, last, memory)
    lines, i = [f"stage sizes from --stage-memory {value}" + (f" ({how})" if how else "") + ":"], 0
    for s, (n, mem) in enumerate(zip(sizes, memory)):
        used = sum(costs[i : i + n]) + (first if s == 0 else 0) + (last if s == pipeline - 1 else 0)
        lines.append(f"  stage {s}: layers {i}-{i + n - 1} ({n}), {gib(used)} of {gib(mem)}")
        i += n
    return sizes, "\n".join(lines)
