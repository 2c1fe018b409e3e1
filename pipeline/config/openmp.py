"""How the OpenMP threads of a CPU stage wait between parallel regions: set in the environment before
torch loads its OpenMP runtime (the runner calls :func:`passive_waits` before its first torch import;
libgomp reads it once, when it is loaded). Imports nothing but the standard library.

Why: torch's CPU kernels, MKL, oneDNN and the project's C loops (pipeline.models.kernels.native) share
one libgomp pool, whose idle threads spin (300,000 iterations by default) before they sleep. A stage
runs thousands of short parallel regions a second; with another process on one of its cores, the
thread that shares that core spins against it for its time slices, never sleeps, so the scheduler
never favours it on wake-up, and every region's barrier waits a time slice for it. Passive waiting
(threads sleep at once, the scheduler wakes them ahead of a busy loop) avoids that (bench/contention.py,
docs/performance-log.md). The user's own setting of any of the variables below wins.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

# what each OpenMP runtime reads: the standard policy, libgomp's spin count, Intel's block time
WAIT_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")
DEFAULT_POLICY = "PASSIVE"


def passive_waits(environ: MutableMapping[str, str] = os.environ) -> str:
    """Set ``OMP_WAIT_POLICY=PASSIVE`` unless the user set a wait variable; returns the policy in force,
    as a note for the log (``OMP_WAIT_POLICY=PASSIVE``, or the user's own settings)."""
    own = {name: environ[name] for name in WAIT_VARIABLES if name in environ}
    if own:
        return " ".join(f"{k}={v}" for k, v in own.items())
    environ["OMP_WAIT_POLICY"] = DEFAULT_POLICY
    return f"OMP_WAIT_POLICY={DEFAULT_POLICY}"


def wait_note(environ: MutableMapping[str, str] = os.environ) -> str:
    """The wait settings in force, for the log: ``OMP_WAIT_POLICY=PASSIVE`` (or the user's), else
    ``OpenMP's default waits`` (a process that did not start from the runner's entry script)."""
    own = [f"{name}={environ[name]}" for name in WAIT_VARIABLES if name in environ]
    return " ".join(own) or "OpenMP's default waits"
