"""Shared test fixtures: tiny models built once per test run, free ports, no stray processes.

The repository root is importable through ``pytest.ini`` (``pythonpath = .``); helpers live in
tests/utils.py.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from tests.utils import free_port as _free_port
from tests.utils import tiny_llama


@pytest.fixture(scope="session")
def make_llama(tmp_path_factory):
    """``make_llama(**config overrides) -> folder``: a tiny random Llama with the local tokenizer,
    built once per distinct config for the whole run (tests must not modify the folder)."""
    built: dict[tuple, str] = {}

    def make(seed: int = 0, **overrides) -> str:
        key = (seed, *sorted(overrides.items()))
        if key not in built:
            built[key] = tiny_llama(tmp_path_factory.mktemp("llama"), seed=seed, **overrides)
        return built[key]

    return make


@pytest.fixture(scope="session")
def llama_2l(make_llama) -> str:
    """The 2-layer tiny Llama most run-level tests share (one layer per stage at P = 2)."""
    return make_llama(num_hidden_layers=2)


@pytest.fixture
def free_port() -> int:
    return _free_port()


@pytest.fixture(scope="session", autouse=True)
def no_stray_processes():
    """After the run, kill whatever child processes a failed test left behind (and their groups)."""
    yield
    for pid in _children(os.getpid()):
        for kill in (lambda: os.killpg(pid, signal.SIGKILL), lambda: os.kill(pid, signal.SIGKILL)):
            try:
                kill()
            except (ProcessLookupError, PermissionError):
                pass


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        children = task / "children"
        if children.exists():
            out += [int(c) for c in children.read_text().split()]
    return out
