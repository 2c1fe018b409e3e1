"""Runs in this process (``--in-process``) must leave the process as they found it: a run that changes
a process-wide setting (torch's thread count, the umask, logging, signal handling, the environment,
the working folder, a patched library function), leaves a rank's thread behind or a run's status file
or in-flight record open would change what the next test computes. Each test here is checked for that."""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time

import pytest
import torch
from torch import nn

import dist_inference_runner  # noqa: F401 (importing it sets OMP_WAIT_POLICY once per process: before any snapshot)
import tasks.inflight
import tasks.status


# set by pytest for each test, and by torch's inductor the first time it is imported (its cache folder)
SET_ONCE = {"PYTEST_CURRENT_TEST", "TORCHINDUCTOR_CACHE_DIR"}


def _state() -> dict:
    umask = os.umask(0o22)
    os.umask(umask)
    root = logging.getLogger()
    return {
        "torch threads": torch.get_num_threads(),
        "torch default dtype": torch.get_default_dtype(),
        "torch deterministic algorithms": torch.are_deterministic_algorithms_enabled(),
        "umask": umask,
        "logging level": root.level,
        "logging handlers": list(root.handlers),
        "SIGTERM handler": signal.getsignal(signal.SIGTERM),
        "SIGINT handler": signal.getsignal(signal.SIGINT),
        "blocked signals": signal.pthread_sigmask(signal.SIG_BLOCK, []),
        "environment": {k: v for k, v in os.environ.items() if k not in SET_ONCE},
        "working folder": os.getcwd(),
        "stdout": sys.stdout,
        "stderr": sys.stderr,
        "nn.Module.register_parameter": nn.Module.register_parameter,
        "running status files": list(tasks.status._ACTIVE),  # a run's, still "running" in this process
        "open in-flight records": list(tasks.inflight._OPEN),  # a run's record of its lines in flight
    }


def _rank_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("rank ")}


@pytest.fixture(autouse=True)
def leaves_the_process_as_it_found_it():
    before, ranks = _state(), _rank_threads()  # (a module's open LLM or server keeps its ranks: not this test's)
    yield
    deadline = time.monotonic() + 5
    while _rank_threads() - ranks and time.monotonic() < deadline:  # a failed run's ranks wind down
        time.sleep(0.05)
    assert sorted(t.name for t in _rank_threads() - ranks) == [], "a run left rank threads behind"
    after = _state()
    changed = {k: (before[k], after[k]) for k in before if before[k] != after[k]}
    if "environment" in changed:
        a, b = changed["environment"]
        changed["environment"] = {k: (a.get(k), b.get(k)) for k in a.keys() | b.keys() if a.get(k) != b.get(k)}
    assert not changed, f"the test changed process-wide state: {changed}"
