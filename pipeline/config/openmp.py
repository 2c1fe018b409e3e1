"""How the OpenMP threads of a CPU stage wait between parallel regions: set in the environment before
torch loads its OpenMP runtime (the runner calls :func:`passive_waits` before its first torch import;
libgomp reads it once). Imports nothing but the standard library.

Why: torch, MKL, oneDNN and the C loops share one libgomp pool whose idle threads spin before they
sleep; with another process on one of its cores, the spinning thread is never favoured on wake-up and
every region's barrier waits a time slice for it. Passive waiting avoids that (bench/contention.py,
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
    if not any(name in environ for name in WAIT_VARIABLES):
        environ["OMP_WAIT_POLICY"] = DEFAULT_POLICY
    return wait_note(environ)


def wait_note(environ: MutableMapping[str, str] = os.environ) -> str:
    """The wait settings in force, for the log: ``OMP_WAIT_POLICY=PASSIVE`` (or the user's), else
    ``OpenMP's default waits`` (a process that did not start from the runner's entry script)."""
    own = [f"{name}={environ[name]}" for name in WAIT_VARIABLES if name in environ]
    return " ".join(own) or "OpenMP's default waits"
