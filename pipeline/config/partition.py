"""Which layers each pipeline stage holds. Pure, table-tested (tests/unit/pipeline/config/test_partition.py)."""

from __future__ import annotations

import itertools
import re


def stage_ranges(
    total_layers: int,
    stages: int,
    num_layers: int | None = None,
    max_layers: int | None = None,
    sizes: list[int] | None = None,
) -> list[tuple[int, int]]:
    """Half-open layer ranges ``[(first, last), ...]``, one per stage. ``max_layers`` caps the depth
    (trailing layers dropped); ``num_layers`` is the seed's layers per stage (the last takes the rest);
    ``sizes`` (``--layers-per-stage``) gives each stage's count; else an even split, earlier stages taking
    the extra ones. ValueError saying what to change when the combination cannot work."""
    if stages < 1:
        raise ValueError(f"pipeline size must be at least 1, got {stages}")
    if total_layers < 1:
        raise ValueError(f"the model has no layers ({total_layers})")
    depth = total_layers
    if max_layers is not None:
        if max_layers < 1:
            raise ValueError(f"--max-layers must be at least 1, got {max_layers}")
        depth = min(max_layers, total_layers)
    if stages > depth:
        raise ValueError(
            f"{stages} pipeline stages but only {depth} layers to place: use at most {depth} "
            f"processes per pipeline (--nproc-per-node / --pipeline-group-size) or raise --max-layers"
        )
    if sizes is not None:
        check_sizes(sizes, stages, depth, total_layers)
    elif num_layers is None:
        base, extra = divmod(depth, stages)
        sizes = [base + (1 if i < extra else 0) for i in range(stages)]
    else:
        if num_layers < 1:
            raise ValueError(f"--num-layers must be at least 1, got {num_layers}")
        if num_layers * stages < depth:
            raise ValueError(
                f"--num-layers {num_layers} x {stages} stages = {num_layers * stages} layers, but the "
                f"model has {depth}: raise --num-layers to {-(-depth // stages)}, or pass "
                f"--max-layers {num_layers * stages} to drop the trailing layers deliberately"
            )
        if num_layers * (stages - 1) >= depth:
            raise ValueError(
                f"--num-layers {num_layers} leaves the last of {stages} stages without layers "
                f"(the model has {depth}): lower --num-layers to {-(-depth // stages)} or use fewer stages"
            )
        sizes = [min(num_layers, depth - i * num_layers) for i in range(stages)]
    return [(end - size, end) for size, end in zip(sizes, itertools.accumulate(sizes))]


def check_sizes(sizes: list[int], stages: int, depth: int, total_layers: int) -> None:
    """``--layers-per-stage``: one count of at least 1 per stage, adding up to the layers to place."""
    given = ",".join(map(str, sizes))
    if len(sizes) != stages:
        raise ValueError(f"--layers-per-stage {given} has {len(sizes)} sizes for {stages} pipeline stage{'s' * (stages != 1)}: "
                         f"give one per stage (--nproc-per-node / --pipeline-group-size sets the stages)")
    if min(sizes) < 1:
        raise ValueError(f"--layers-per-stage {given}: every stage needs at least 1 layer")
    if sum(sizes) != depth:
        of = f"--max-layers {depth}" if depth != total_layers else f"the model's {depth} layers"
        raise ValueError(f"--layers-per-stage {given} adds up to {sum(sizes)}, but the sizes must add up to "
                         f"{depth} ({of})")


def parse_layers_per_stage(value: str) -> list[int]:
    """"10,14,14,10" -> [10, 14, 14, 10]."""
    try:
        sizes = [int(x) for x in value.split(",")]
    except ValueError:
        raise ValueError(f"--layers-per-stage {value}: expected layer counts separated by commas, e.g. 10,14,14,10") from None
    if min(sizes) < 1:
        raise ValueError(f"--layers-per-stage {value}: every stage needs at least 1 layer")
    return sizes


_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20,
          "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40}


def parse_size(text: str) -> int:
    """"20GiB" -> bytes (KB/MB/GB/TB decimal, KiB/MiB/GiB/TiB binary, plain numbers are bytes)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", text)
    if m is None or m.group(2).lower() not in _UNITS:
        raise ValueError(f"--stage-memory: {text!r} is not a size; write e.g. 20GiB, 512MiB or 16GB")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def parse_stage_memory(value: str) -> list[int] | None:
    """"20GiB,40GiB" -> bytes per stage; "auto" -> None (measured on each device)."""
    if value.strip().lower() == "auto":
        return None
    sizes = [parse_size(x) for x in value.split(",")]
    if min(sizes) <= 0:
        raise ValueError(f"--stage-memory {value}: every stage needs some memory")
    return sizes


def gib(n: float) -> str:
    """Bytes as GiB, or MiB / KiB for small figures."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size or unit == "KiB":
            return f"{n / size:.2f} {unit}"


def memory_sizes(layer_cost: list[int], first_cost: int, last_cost: int, memory: list[int]) -> list[int]:
    """Layers per stage in proportion to each stage's memory left after its fixed costs.

    ``layer_cost[i]``: bytes layer i needs where it runs (weights, its share of the KV cache, its
    adapters); ``first_cost`` / ``last_cost``: the embedding side and the head; ``memory``: bytes of
    each stage. Layers stay in order, every stage gets at least one, and no stage is given more than
    it holds. Raises ValueError saying by how much the model does not fit.
    """
    stages, n = len(memory), len(layer_cost)
    if stages > n:
        raise ValueError(f"{stages} pipeline stages but only {n} layers to place")
    fixed = [0] * stages
    fixed[0] += first_cost
    fixed[-1] += last_cost
    room = [m - f for m, f in zip(memory, fixed)]
    need = sum(layer_cost) + sum(fixed)
    if need > sum(memory):
        raise ValueError(f"the model needs {gib(need)} ({gib(sum(layer_cost))} of layers, {gib(first_cost)} embedding, "
                         f"{gib(last_cost)} head, KV cache and adapters included) but the stages have "
                         f"{gib(sum(memory))}: {gib(need - sum(memory))} short; add memory or stages, "
                         "or lower --budget / --max-layers")
    share = [max(r, 0) for r in room]
    cum = list(itertools.accumulate(layer_cost, initial=0))
    sizes, i, target = [], 0, 0.0
    for s in range(stages - 1):  # cut where the layers so far best match the memory so far
        target += cum[n] * share[s] / max(1, sum(share))
        last_cut = n - (stages - s - 1)  # leave a layer for each later stage
        j = min(range(i + 1, last_cut + 1), key=lambda j: abs(cum[j] - target))
        sizes.append(j - i)
        i = j
    sizes.append(n - i)
    if not _fits(sizes, layer_cost, room):
        sizes = _first_fit(layer_cost, room)
    return sizes


def _fits(sizes: list[int], cost: list[int], room: list[int]) -> bool:
    i = 0
    for size, r in zip(sizes, room):
        if sum(cost[i : i + size]) > r:
            return False
        i += size
    return True


def _first_fit(cost: list[int], room: list[int]) -> list[int]:
    """Each stage takes as many layers as it holds, leaving one for every later stage."""
    stages, n = len(room), len(cost)
    sizes, i = [], 0
    for s, r in enumerate(room):
        j, used = i, 0
        while j < n - (stages - s - 1) and (used + cost[j] <= r or j == i):
            used += cost[j]
            j += 1
        if s == stages - 1:
            j = n
        used = sum(cost[i:j])
        if used > r:
            raise ValueError(f"stage {s} needs {gib(used)} for layers {i}-{j - 1} but has {gib(r)} left"
                             f"{' after the embedding' if s == 0 else ' after the head' if s == stages - 1 else ''}: "
                             f"{gib(used - r)} short, though the total fits; give stage {s} more memory, "
                             "or use --layers-per-stage")
        sizes.append(j - i)
        i = j
    return sizes
