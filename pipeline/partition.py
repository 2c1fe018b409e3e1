"""Which layers each pipeline stage holds. Pure, table-tested (tests/test_partition.py)."""

from __future__ import annotations


def stage_ranges(
    total_layers: int,
    stages: int,
    num_layers: int | None = None,
    max_layers: int | None = None,
) -> list[tuple[int, int]]:
    """Half-open layer ranges ``[(first, last), ...]``, one per stage.

    ``max_layers`` caps the model's depth (trailing layers are dropped). ``num_layers`` is the
    seed's "layers per stage": stage i holds ``[i*num_layers, min((i+1)*num_layers, depth))``.
    Without it layers are split as evenly as possible, earlier stages taking the extra ones.
    Raises ValueError with what to change when the combination cannot work.
    """
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
    if num_layers is None:
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
    ranges, first = [], 0
    for size in sizes:
        ranges.append((first, first + size))
        first += size
    return ranges
