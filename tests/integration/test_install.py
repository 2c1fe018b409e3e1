"""``pip install .`` into a fresh virtual environment, then the Python API from outside the checkout:
the installed modules, the default model's files inside the wheel, and worker processes started from
the installed runner. The new environment sees this one's packages (a ``.pth`` file), so pip finds the
dependencies installed and builds and installs only the project: installing the requirements into a
fresh environment is what ``.ci/run`` does, and tests/unit/test_packaging.py holds pyproject.toml's
dependencies to requirements.txt. Slow (a venv, a build)."""

from __future__ import annotations

import shutil
import site
import subprocess
import sys
from pathlib import Path

import pytest

from tests.utils import REPO

pytestmark = pytest.mark.slow

SCRIPT = """
import dist_inference_runner, pipeline.loading.default_model as dm
from dist_inference_runner import LLM, SamplingParams
print("MODULE", dist_inference_runner.__file__)
print("MODEL", dm.default_model_dir())
with LLM(pipeline_size=2, no_progress=True) as llm:
    print("TEXT", llm.generate("Once upon a time", SamplingParams(max_tokens=6, temperature=0))[0].text)
"""


def _run(cmd, cwd, timeout=1800):
    r = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, start_new_session=True)
    assert r.returncode == 0, f"{cmd}: {r.stderr[-3000:]}"
    return r.stdout


def test_pip_install_then_api_outside_the_checkout(tmp_path):
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], tmp_path)
    py = venv / "bin" / "python"
    packages = _run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], tmp_path).strip()
    (Path(packages) / "this_environment.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    src = tmp_path / "src"  # a copy: building writes build/ and *.egg-info beside the sources, not in the checkout
    shutil.copytree(REPO, src, ignore=shutil.ignore_patterns(".git", "build", "*.egg-info", "__pycache__", ".hypothesis"))
    _run([str(py), "-m", "pip", "install", "-q", str(src)], tmp_path)
    env_free = [str(py), "-I", "-c", SCRIPT]  # -I: no PYTHONPATH, no current folder
    out = dict(line.split(" ", 1) for line in _run(env_free, tmp_path, 900).splitlines() if " " in line)
    assert out["MODULE"].startswith(str(venv)) and out["MODEL"].startswith(str(venv))
    expected = subprocess.run([sys.executable, "-c", SCRIPT.replace("pipeline_size=2", "pipeline_size=1")],
                              cwd=REPO, capture_output=True, text=True, timeout=900)
    assert out["TEXT"] == dict(x.split(" ", 1) for x in expected.stdout.splitlines() if " " in x)["TEXT"]
