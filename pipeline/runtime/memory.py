"""What a stage holds, measured: the run summary's per-stage memory breakdown (``stage_memory_mb``).

Each stage keeps a :class:`MemoryLedger`: the process's RSS right before it loads, its weights' bytes
as loaded and the most KV bytes it held; :meth:`MemoryLedger.breakdown` adds the kernels' copies, the
tables and buffers, and the peak RSS, whose rest is ``other`` (every field: docs/usage/scale.md,
"Memory per stage"). Tensor bytes count per storage: a tied table or two views of one buffer count once.
"""

from __future__ import annotations

import os
import types
from collections.abc import Iterable

import torch
from torch import nn

from tasks.status import peak_rss_bytes

MIB = 2**20
_WALK_DEPTH = 3  # attribute levels searched for tensors below a module (kernel objects, tables, lists)
# not searched: modules (walked on their own), scalars, and what only refers to code (a Python module's
# globals are not the stage's)
_OPAQUE = (nn.Module, str, bytes, int, float, bool, type, types.ModuleType, types.FunctionType, types.MethodType)


def rss_bytes() -> int:
    """This process's resident memory now (Linux: /proc/self/statm; elsewhere its peak so far)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return peak_rss_bytes()


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of memory the tensors hold, each storage once: tensors sharing a storage (a tied table,
    views) count the union of the byte ranges they cover. Tensors without a storage (oneDNN's
    prepacked weights, other opaque layouts) count their ``nbytes`` once per tensor object."""
    ranges: dict[tuple[str, int], list[tuple[int, int]]] = {}
    opaque: dict[int, int] = {}
    for t in tensors:
        if t.device.type == "meta":
            continue
        try:
            storage = t.untyped_storage()
            base = storage.data_ptr()
        except (RuntimeError, NotImplementedError):  # no storage: count the tensor itself, once
            opaque[id(t)] = t.nbytes
            continue
        if t.numel() == 0:
            continue
        size = t.element_size()
        extent = (sum((n - 1) * s for n, s in zip(t.shape, t.stride())) + 1) * size  # first to last byte read
        start = t.storage_offset() * size
        ranges.setdefault((str(t.device), base), []).append((start, start + extent))
    total = sum(opaque.values())
    for spans in ranges.values():
        end = -1
        for a, b in sorted(spans):  # the union of the spans
            if b > end:
                total += b - max(a, end)
                end = b
    return total


def reachable_tensors(obj, depth: int = _WALK_DEPTH, seen: set[int] | None = None) -> list[torch.Tensor]:
    """Tensors held by ``obj``: itself, the items of a list / tuple / dict, and the attributes of a
    plain object, ``depth`` levels down (modules are not entered: :func:`model_tensors` walks them)."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return []
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        return [obj]
    if depth <= 0 or obj is None or isinstance(obj, _OPAQUE):
        return []
    if isinstance(obj, dict):
        items = obj.values()
    elif isinstance(obj, (list, tuple, set, frozenset)):
        items = obj
    elif hasattr(obj, "__dict__"):
        items = vars(obj).values()
    else:
        return []
    return [t for item in items for t in reachable_tensors(item, depth - 1, seen)]


def model_tensors(model: nn.Module, skip: tuple[str, ...] = ("rotary", "adapters")) -> dict[str, list[torch.Tensor]]:
    """The model's tensors by kind: ``weights`` (parameters and persistent buffers: what a checkpoint
    holds), ``tables`` (non-persistent buffers such as ALiBi slopes), ``kernel`` (tensors the
    modules keep as plain attributes: prepacked weights, quantization scales in float32, ...).
    Attributes named in ``skip`` are counted elsewhere (rotary tables, LoRA adapters)."""
    out: dict[str, list[torch.Tensor]] = {"weights": [], "tables": [], "kernel": []}
    seen: set[int] = set()
    for module in model.modules():
        out["weights"] += [p for p in module._parameters.values() if p is not None]
        transient = module._non_persistent_buffers_set
        for name, b in module._buffers.items():
            if b is not None:
                out["tables" if name in transient else "weights"].append(b)
        for name, value in vars(module).items():
            if not name.startswith("_") and name not in skip:
                out["kernel"] += reachable_tensors(value, seen=seen)
    return out


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters and persistent buffers, a shared (tied) tensor once."""
    return tensor_bytes(model_tensors(model)["weights"])


def cache_bytes(caches: Iterable) -> int:
    """Bytes of the KV caches' tensors (keys, values, per-row flags), as allocated (pipeline.cache.kv_cache)."""
    return tensor_bytes(t for c in caches for t in reachable_tensors(c))


class MemoryLedger:
    """One stage's memory account. Made right before the stage loads (``process``: the RSS of Python,
    torch and the libraries then); :meth:`loaded` after the weights are in, :meth:`ready` once the
    kernels have packed them; :meth:`note_kv` after a pass or an allocation that changed the KV
    cells; :meth:`breakdown` at a file's close."""

    def __init__(self) -> None:
        self.process = rss_bytes()
        self.weights = 0  # parameters and persistent buffers as loaded, shared tensors once
        self.rss_ready = 0  # RSS once the stage was loaded and packed, before any pass
        self.kv_peak = 0  # most bytes of micro-batch caches + prefix pool held at once (process lifetime)
        self.kv_at_peak = (0, 0)  # (micro-batch caches, prefix pool) at that moment

    def loaded(self, model: nn.Module) -> None:
        self.weights = weight_bytes(model)

    def ready(self) -> None:
        self.rss_ready = rss_bytes()

    def note_kv(self, caches: Iterable, prefix) -> None:
        """Record the KV bytes held now if they are the most so far (``caches``: KVCache objects,
        ``prefix``: the stage's PrefixStore or None)."""
        kv = cache_bytes(caches)
        pool = tensor_bytes(reachable_tensors(prefix)) if prefix is not None else 0
        if kv + pool > self.kv_peak:
            self.kv_peak, self.kv_at_peak = kv + pool, (kv, pool)

    def breakdown(self, model: nn.Module, device: torch.device, extra_buffers: int = 0) -> dict:
        """The stage's memory in MiB: ``rss_peak`` = ``process`` + ``weights`` + ``packed`` +
        ``adapters`` + ``kv_cache`` + ``prefix_pool`` + ``buffers`` + ``other`` (on CUDA the device
        parts add up to ``device_peak`` with ``device_other``; ``other`` is the host's rest)."""
        held = model_tensors(model)
        now = tensor_bytes(held["weights"] + held["kernel"])
        adapters = getattr(model, "adapters", None)
        parts = {
            "weights": self.weights,
            "packed": now - self.weights,  # kernels' copies beyond the loaded weights (a copy replacing its original: 0)
            "adapters": adapters.nbytes() if adapters is not None else 0,
            "kv_cache": self.kv_at_peak[0],
            "prefix_pool": self.kv_at_peak[1],
            "buffers": tensor_bytes(held["tables"] + reachable_tensors(getattr(model, "rotary", None))) + extra_buffers,
        }
        # the high-water mark is updated lazily by the kernel: now or at ready may read higher
        peak = max(peak_rss_bytes(), rss_bytes(), self.rss_ready)
        out = {"device": str(device), "rss_peak": peak, "rss_ready": self.rss_ready, "process": self.process}
        if device.type == "cuda":
            device_peak = torch.cuda.max_memory_allocated(device)
            out |= parts | {"other": peak - self.process, "device_peak": device_peak,
                            "device_other": device_peak - sum(parts.values())}
        else:
            out |= parts | {"other": peak - self.process - sum(parts.values())}
        return {k: v if isinstance(v, str) else round(v / MIB, 1) for k, v in out.items()}
