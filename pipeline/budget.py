"""``--budget auto``: the KV-cache budget from the memory left after loading.

Each stage divides its free memory, less a reserve for activations, logits and the allocator's
slack, by the bytes one token position of keys and values takes on it (all its layers); the run's
budget is the smallest answer over every stage (a min-reduction on the CPU group), since every
stage holds the same micro-batches. On a GPU the free memory is the device's; on the CPU it is the
machine's available RAM divided among the node's processes, and the budget is at most
:data:`CPU_MAX_BUDGET` and at least :data:`CPU_BUDGET` (when RAM is that tight, pass ``--budget N``).

The budget is a ceiling, not an allocation: a micro-batch takes the cells its rows need (at most
``--max-micro-batch-size`` rows), so a large budget costs nothing while requests are few or short.
On the CPU it is what lets a micro-batch hold its 32 rows: the old fixed 8192 cells held ~13 rows of
600 positions, and the benchmark's generation file measured 1.09x (float32) and 1.19x (bfloat16)
faster with 32768 (bench/throughput.py's model, 2 threads).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .models.spec import DecoderSpec

CPU_BUDGET = 8192  # the CPU's floor, and what --stage-memory sets aside for the cache when sizing
CPU_MAX_BUDGET = 1 << 16
GiB = 1 << 30


def kv_cell_bytes(model) -> int:
    """Bytes of keys + values one token position takes on this stage (0: a stage without layers)."""
    itemsize = next(model.parameters()).element_size()
    spec = getattr(model, "spec", None)
    if isinstance(spec, DecoderSpec):
        kv_dim = spec.kv_dim
    else:  # the generic stage: transformers' config
        cfg = model.config
        heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        kv_dim = heads * (getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
    return 2 * len(model.layers) * kv_dim * itemsize


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


def resolve_budget(value: int | str, model, device: torch.device, cpu_group=None, local_world: int = 1) -> int:
    """The run's budget in tokens: ``value`` itself, or for ``auto`` the minimum over stages of what
    fits in the memory left (GPU: the device's; CPU: :func:`cpu_budget`). Every rank must call it
    (a collective)."""
    if value != "auto":
        return int(value)
    if device.type != "cuda":
        from .sizing import available_ram

        mine = torch.tensor([cpu_budget(available_ram(), local_world, kv_cell_bytes(model))], dtype=torch.int64)
        if cpu_group is not None:
            dist.all_reduce(mine, op=dist.ReduceOp.MIN, group=cpu_group)
        return int(mine)
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    mine = torch.tensor([budget_from_memory(free, total, kv_cell_bytes(model))], dtype=torch.int64)
    if cpu_group is not None:
        dist.all_reduce(mine, op=dist.ReduceOp.MIN, group=cpu_group)
    budget = int(mine)
    if budget < 1:
        raise ValueError(f"--budget auto: no GPU memory is left for the KV cache after loading ({free / GiB:.1f} "
                         f"GiB free of {total / GiB:.1f} on this stage, 1 GiB or 10% reserved); use more stages "
                         "(--pipeline-group-size), a smaller --dtype, or pass --budget N explicitly")
    return budget
