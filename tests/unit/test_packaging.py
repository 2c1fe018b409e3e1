"""``pip install .`` installs what the checkout runs with: pyproject.toml's dependencies are
requirements.txt's (tests/integration/test_install.py installs the wheel in a fresh environment)."""

from __future__ import annotations

import tomllib

from tests.utils import REPO


def test_pyproject_dependencies_are_the_requirements():
    lines = [line.split("#")[0].strip() for line in (REPO / "requirements.txt").read_text().splitlines()]
    wanted = sorted(line for line in lines if line)
    declared = sorted(tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"])
    assert declared == wanted
