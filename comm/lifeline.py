"""Ranks end with their launcher: a rank whose torchrun (or legacy launch script) is gone exits, by the
kernel's parent-death signal and a watchdog thread (:func:`watch_launcher`); a rank started by hand has
no launcher (:func:`launcher_pid`) and is left alone (docs/usage/recovery.md, "A launcher killed").
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Mapping

log = logging.getLogger(__name__)

LAUNCHER_ENV = "DIST_INFER_LAUNCHER_PID"
PR_SET_PDEATHSIG = 1
POLL_S = 1.0


def launcher_pid(env: Mapping[str, str], start_ppid: int) -> int | None:
    """The launcher this rank must not outlive: ``DIST_INFER_LAUNCHER_PID`` (launch/legacy_per_rank.sh's),
    else under torchrun the parent this process had when it started (``start_ppid``), else None (by hand)."""
    pid = env.get(LAUNCHER_ENV, "")
    if pid.isdigit():
        return int(pid)
    if "TORCHELASTIC_RUN_ID" in env or "TORCHELASTIC_RESTART_COUNT" in env:
        return start_ppid
    return None


def set_parent_death_signal() -> bool:
    """Linux: the kernel sends SIGTERM to this process when its parent exits. False where unavailable."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def watch_launcher(expected: int, poll_s: float = POLL_S, kernel: bool = True) -> None:
    """Exit (by SIGTERM to this process) once the parent is no longer ``expected``: the kernel's
    parent-death signal where there is one (``kernel``), then a check (the launcher may have died
    already), and a watchdog thread polling the parent every ``poll_s`` seconds."""
    if kernel:
        set_parent_death_signal()
    if os.getppid() != expected:
        _orphaned(expected)
        return

    def watch() -> None:
        while os.getppid() == expected:
            time.sleep(poll_s)
        _orphaned(expected)

    threading.Thread(target=watch, name="launcher-watch", daemon=True).start()


def _orphaned(expected: int) -> None:
    log.error("the launcher (pid %d) is gone: this rank stops", expected)
    os.kill(os.getpid(), signal.SIGTERM)
