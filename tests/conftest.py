"""Shared test fixtures: tiny models built once per test run, free ports, no stray processes; the
``multiprocess`` marker on every test that starts processes (``pytest -m "not multiprocess"``: the fast tier).

The repository root is importable through ``pytest.ini`` (``pythonpath = .``); helpers live in
tests/utils.py.
"""

from __future__ import annotations

import gc
import inspect
import os
import signal
import types
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


from tests.serve_cases import serve_reference  # noqa: E402,F401 (file mode's answers to the serve tests' requests)
from tests.servers import servers  # noqa: E402,F401 (the shared in-process servers: tests/servers.py)


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


# -- the multiprocess marker -------------------------------------------------------------------
# A test is marked when it, a fixture it uses, or a helper of the tests' own modules they call
# (transitively: tests.utils.run_torchrun -> run_cmd -> subprocess) names one of these.
_SPAWNS = frozenset({"subprocess", "Popen", "multiprocessing", "fork", "spawn", "init_process_group"})


def _names(code: types.CodeType) -> set[str]:
    """Global and attribute names a function's code (and the functions nested in it) uses."""
    names, stack = set(), [code]
    while stack:
        c = stack.pop()
        names.update(c.co_names)
        stack.extend(k for k in c.co_consts if isinstance(k, types.CodeType))
    return names


def _starts_processes(obj, seen: set) -> bool:
    if inspect.isclass(obj):
        return any(_starts_processes(f, seen) for f in vars(obj).values() if inspect.isfunction(f))
    code = getattr(obj, "__code__", None)
    if code is None or code in seen:
        return False
    seen.add(code)
    names = _names(code)
    if names & _SPAWNS:
        return True
    helpers = (obj.__globals__.get(n) for n in names)
    return any(_starts_processes(h, seen) for h in helpers
               if (inspect.isfunction(h) or inspect.isclass(h)) and h.__module__.split(".")[0] == "tests")


UNIT = Path(__file__).resolve().parent / "unit"
INTEGRATION = Path(__file__).resolve().parent / "integration"  # every test there counts as starting processes


def pytest_collection_modifyitems(config, items):
    config.unit_tests_starting_processes = []  # read by tests/unit/test_layout.py: unit/ starts none
    for item in items:
        fixtures = getattr(item, "_fixtureinfo", None)
        funcs = [getattr(item, "function", None)]
        funcs += [d.func for defs in (fixtures.name2fixturedefs.values() if fixtures else ()) for d in defs]
        seen: set = set()
        if INTEGRATION in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.multiprocess)  # processes started through the project's own code too
        elif any(f is not None and _starts_processes(f, seen) for f in funcs):
            item.add_marker(pytest.mark.multiprocess)
            if UNIT in Path(str(item.fspath)).resolve().parents:
                config.unit_tests_starting_processes.append(item.nodeid)
    # the fast tier first (its order kept): a full run with -x stops on a unit failure in minutes
    items.sort(key=lambda item: item.get_closest_marker("multiprocess") is not None)


def pytest_runtestloop(session):
    """Before the first test: what collection built (every module, Hypothesis' strategies) moved out of the
    garbage collector's sight (``gc.freeze``), and young objects collected less often. A full collection in
    this process walks every live object, and the suite keeps models, servers and tokenizers alive: the
    fast tier spent 10 s of its 195 in collections, 6 s after this (2-core AMD EPYC). Returns None: pytest's
    own loop runs the tests."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(20_000, 20, 50)


# the suite's own figures in docs/testing.md, rewritten at the end of a full run that passed
from tests.suite_figures import pytest_collection_finish, pytest_sessionfinish, pytest_sessionstart  # noqa: E402,F401
