"""The CPU cores this process may use, which is not the machine's count: a Slurm or LSF job step,
``taskset`` and ``numactl`` narrow the affinity mask, and a container's CPU quota caps the time its
processes get. The default ``--num-threads`` divides these among the host's ranks (counting the node's
cores would start too many OpenMP threads, whose barriers wait on descheduled workers). Imports
nothing of the project."""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP = Path("/sys/fs/cgroup")
# a layer with fewer matmul weights runs on one thread by default: its products take a few microseconds a
# pass, less than waking a second thread (bench/contention.py; docs/benchmarks.md#threads-on-a-shared-machine)
SMALL_LAYER_WEIGHTS = 400_000


def default_threads(cores: int, local_ranks: int, layer_weights: int | None = None) -> int:
    """``--num-threads 0``: ``cores`` divided among the host's ranks, one for a model whose layers hold
    fewer than ``SMALL_LAYER_WEIGHTS`` matmul weights (None: unknown, no such limit)."""
    share = max(1, cores // max(1, local_ranks))
    return 1 if layer_weights is not None and layer_weights < SMALL_LAYER_WEIGHTS else share


def layer_weights(config: dict) -> int | None:
    """About how many matmul weights a decoder layer of an HF ``config`` holds (4 h^2 for attention, 3 h i
    for a gated MLP), or None where the config names no hidden size."""
    h = config.get("hidden_size") or config.get("n_embd") or config.get("d_model")
    if not isinstance(h, int):
        return None
    inter = config.get("intermediate_size") or config.get("ffn_dim") or config.get("n_inner") or 4 * h
    return 4 * h * h + 3 * h * int(inter)


def usable_cores(cgroup: Path = CGROUP, proc_cgroup: Path = Path("/proc/self/cgroup")) -> int:
    """min(cores in this process's affinity mask, its cgroup's CPU quota rounded up), at least 1."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cores = os.cpu_count() or 1
    quota = cgroup_cpu_quota(cgroup, proc_cgroup)
    return max(1, min(cores, math.ceil(quota)) if quota is not None else cores)


def cgroup_cpu_quota(cgroup: Path = CGROUP, proc_cgroup: Path = Path("/proc/self/cgroup")) -> float | None:
    """CPUs' worth of time the process's cgroup may use (quota / period), or None where none is set or
    none can be read. cgroup v2: ``cpu.max`` (``max 100000`` or ``200000 100000``); v1: ``cpu.cfs_quota_us``
    (-1: none) over ``cpu.cfs_period_us``. Looked up at the process's own cgroup and at the root a
    container sees; the smallest wins."""
    found = []
    for v2, v1 in _places(cgroup, proc_cgroup):
        try:
            if v2 is not None and (v2 / "cpu.max").is_file():
                quota, period = (v2 / "cpu.max").read_text().split()[:2]
                if quota != "max":
                    found.append(int(quota) / int(period))
            elif v1 is not None and (v1 / "cpu.cfs_quota_us").is_file():
                quota = int((v1 / "cpu.cfs_quota_us").read_text())
                if quota > 0:
                    found.append(quota / int((v1 / "cpu.cfs_period_us").read_text()))
        except (OSError, ValueError, ZeroDivisionError):
            continue
    return min(found) if found else None


def _places(cgroup: Path, proc_cgroup: Path) -> list[tuple[Path | None, Path | None]]:
    """(v2 folder, v1 cpu-controller folder) pairs to read: the process's own, then the mount's root."""
    places = []
    try:
        for line in proc_cgroup.read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            rel = path.lstrip("/")
            if controllers == "":  # the v2 unified hierarchy
                places.append((cgroup / rel, None))
            elif "cpu" in controllers.split(","):
                places.append((None, cgroup / controllers / rel))
    except (OSError, ValueError):
        pass
    places.append((cgroup, cgroup / "cpu"))
    return [p for i, p in enumerate(places) if p not in places[:i]]
