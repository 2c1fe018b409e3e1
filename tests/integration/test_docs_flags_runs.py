"""The flags reference (docs/usage/flags.md) and the README's table of the most used flags say what: the runs that start processes (the rest: tests/unit/test_docs_flags.py)."""

from __future__ import annotations

import re
import subprocess
import sys
from tests.utils import REPO, RUNNER
from tests.unit.test_docs_flags import parser_actions  # noqa: F401 (fixtures and helpers)


def test_entry_script_help_lists_the_parser_flags():
    out = subprocess.run([sys.executable, str(RUNNER), "--help"], capture_output=True, text=True, timeout=120,
                         cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    listed = set(re.findall(r"^  (--[a-z][a-z0-9-]*)", out.stdout, flags=re.M)) - {"--help"}
    assert listed == set(parser_actions())
