"""The suite's own figures in docs/testing.md: how many tests each tier holds, and the last full run's
time on which machine. A pytest plugin (tests/conftest.py loads it): at the end of a full run
(``python -m pytest tests``, no ``-k``/``-m``, no test deselected) it rewrites the block between the
markers below: the counts from the collection, and the time when the run passed (a failed run keeps the
last passing run's time).
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

from bench.machine import cpu_model

DOC = Path(__file__).resolve().parents[1] / "docs" / "testing.md"
BEGIN = "<!-- suite-figures: written by tests/suite_figures.py at the end of a full run that passed -->"
END = "<!-- /suite-figures -->"
_STARTED = [0.0]


def full_run(config) -> bool:
    """The whole suite was asked for: no keyword or marker filter, every path under tests/ (or none)."""
    if config.option.keyword or config.option.markexpr or getattr(config.option, "collectonly", False):
        return False
    tests = Path(__file__).resolve().parent
    paths = [Path(a.split("::")[0]).resolve() for a in config.args] or [tests]
    return all(p == tests for p in paths)


def counts(items) -> dict[str, int]:
    process = sum(1 for i in items if i.get_closest_marker("multiprocess") is not None)
    return {"tests": len(items), "fast": len(items) - process, "processes": process}


def counts_text(c: dict[str, int]) -> str:
    return (f"{c['tests']} tests: {c['fast']} in one process (the fast tier), {c['processes']} that start "
            "processes (the `multiprocess` marker).")


def time_text(seconds: float) -> str:
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    return (f"The last full run that passed: {seconds / 60:.1f} minutes on {time.strftime('%Y-%m-%d')}, {cpu_model()}, "
            f"{os.cpu_count()} cores (load {load:.1f} at its end).")


def read() -> dict[str, int] | None:
    """The counts docs/testing.md states (None: no block)."""
    m = re.search(r"(\d+) tests: (\d+) in one process \(the fast tier\), (\d+) that start processes", DOC.read_text())
    return None if m is None else {"tests": int(m[1]), "fast": int(m[2]), "processes": int(m[3])}


def pytest_sessionstart(session) -> None:
    _STARTED[0] = time.monotonic()


def pytest_collection_finish(session) -> None:
    session.config.suite_counts = counts(session.items) if full_run(session.config) else None


def pytest_sessionfinish(session, exitstatus) -> None:
    c = getattr(session.config, "suite_counts", None)
    if c is None or not DOC.exists():
        return
    text = DOC.read_text()
    if BEGIN not in text or END not in text:
        return
    head, rest = text.split(BEGIN, 1)
    old, tail = rest.split(END, 1)
    passed = exitstatus == 0 and not session.testsfailed
    kept = re.search(r"The last full run that passed: [^\n]*", old)
    when = time_text(time.monotonic() - _STARTED[0]) if passed else (kept[0] if kept else "No full run has passed yet.")
    DOC.write_text(f"{head}{BEGIN}\n{counts_text(c)} {when}\n{END}{tail}")
