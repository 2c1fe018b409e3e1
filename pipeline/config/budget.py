"""``--budget auto``: the KV-cache budget from the memory left after loading.

Each stage divides its free memory, less a reserve (activations, logits, the allocator's slack), by the
bytes one token position of keys and values takes on it; every stage holds the same micro-batches, so
the run's budget is the least answer over stages. A GPU's free memory is the device's; on the CPU it is
the node's available RAM shared by its processes, within [:data:`CPU_BUDGET`, :data:`CPU_MAX_BUDGET`].
The budget is a ceiling, not an allocation: a micro-batch takes only the cells its rows need.
"""

from __future__ import annotations

import torch

from comm.dist import agree_min
from comm.p2p import PeerLost

from pipeline.cache.kv_cache import int8_layer_bytes
from pipeline.models.hf_stage import kv_dim
from pipeline.models.spec import DecoderSpec
from pipeline.config.sizing import CPU_BUDGET, available_ram

CPU_MAX_BUDGET = 1 << 16
GiB = 1 << 30


def kv_cell_bytes(model) -> int:
    """Bytes of keys + values one token position takes on this stage (0: a stage without layers)."""
    itemsize = next(model.parameters()).element_size()
    spec = getattr(model, "spec", None)
    if isinstance(spec, DecoderSpec) and getattr(model, "kv_int8", False):  # --kv-cache-dtype int8 records
        return len(model.layers) * int8_layer_bytes(spec)
    width = spec.kv_dim if isinstance(spec, DecoderSpec) else kv_dim(model.config)  # else the generic stage
    return 2 * len(model.layers) * width * itemsize


def budget_from_memory(free: int, total: int, cell_bytes: int) -> int:
    """KV-cache tokens that fit in ``free`` bytes after a reserve of max(1 GiB, 10% of the device)."""
    if cell_bytes == 0:
        return 1 << 62  # no layers here: this stage does not limit the budget
    return max(0, (free - max(GiB, total // 10)) // cell_bytes)


def cpu_budget(available: int, local_world: int, cell_bytes: int) -> int:
    """``auto`` on the CPU: this process's share of the available RAM, as on a GPU, within
    [CPU_BUDGET, CPU_MAX_BUDGET]."""
    share = available // max(1, local_world)
    return min(CPU_MAX_BUDGET, max(CPU_BUDGET, budget_from_memory(share, share, cell_bytes)))


def _agree_min(value: int, cpu_group) -> int:
    """The least ``value`` over the ranks of ``cpu_group`` (a collective every rank calls; alone: itself)."""
    try:
        return agree_min(value, cpu_group)
    except PeerLost as e:
        raise RuntimeError(f"lost contact with another rank while the stages agreed on --budget auto "
                           f"({str(e).splitlines()[0][:200]}); see the other ranks' logs") from None


def resolve_budget(value: int | str, model, device: torch.device, cpu_group=None, local_world: int = 1,
                   most_layers: int = 0, gpu_sharers: int = 1) -> int:
    """The run's budget in tokens: ``value`` itself, or for ``auto`` the minimum over stages of what
    fits in the memory left after every stage has loaded, agreed by a collective every rank calls
    (GPU: each device's free memory, split evenly among the ``gpu_sharers`` ranks placed on it, measured
    once all have loaded; CPU: :func:`cpu_budget`, the node's available RAM shared by its local stages,
    sized for the stage with ``most_layers`` layers, measured once all have loaded)."""
    if value != "auto":
        return int(value)
    if device.type != "cuda":

        cell = kv_cell_bytes(model)
        layers = len(getattr(model, "layers", ()))
        if most_layers and layers:
            cell = cell // layers * most_layers
        _agree_min(0, cpu_group)  # a barrier: every stage of the node has loaded before anyone measures
        return _agree_min(cpu_budget(available_ram(), local_world, cell), cpu_group)
    torch.cuda.synchronize(device)
    _agree_min(0, cpu_group)  # a barrier: ranks sharing a GPU (--dist-backend gloo) have all loaded before measuring
    free, total = torch.cuda.mem_get_info(device)
    free, total = free // gpu_sharers, total // gpu_sharers
    budget = _agree_min(budget_from_memory(free, total, kv_cell_bytes(model)), cpu_group)
    if budget < 1:
        raise ValueError(f"--budget auto: no GPU memory is left for the KV cache after loading ({free / GiB:.1f} "
                         f"GiB free of {total / GiB:.1f} on this stage, 1 GiB or 10% reserved); use more stages "
                         "(--pipeline-group-size), a smaller --dtype, or pass --budget N explicitly")
    return budget
