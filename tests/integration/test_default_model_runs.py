"""What a fresh process imports, which only a fresh process shows: finding the embedded default model
imports neither torch nor transformers, and a file-mode run imports neither FastAPI nor uvicorn nor
llguidance's tokenizer bridge. The default model's answers: tests/runs/test_default_model_runs.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.utils import REPO


def test_finding_the_model_is_cheap_and_a_file_run_imports_no_server(tmp_path: Path) -> None:
    """A rank's start-up is paid once per shard and rank in a drain loop: a file-mode run loads neither
    FastAPI nor uvicorn (serve mode's: 0.6 s of start-up), nor llguidance's tokenizer bridge (on the
    first grammar); and the default model's folder is found without importing torch or transformers."""
    data = tmp_path / "one.jsonl"
    data.write_text('{"prompt": "Hi", "max_tokens": 2}\n')
    argv = ["dist_inference_runner.py", "--infer-data", str(data), "--output-path", str(tmp_path / "out.jsonl"),
            "--no-progress", "--num-threads", "1"]
    code = ("import atexit, runpy, sys; from pipeline.loading.default_model import default_model_dir; "
            "default_model_dir(); print('HEAVY', 'torch' in sys.modules or 'transformers' in sys.modules); "
            "atexit.register(lambda: print('LOADED', sorted(m for m in "
            "('fastapi', 'uvicorn', 'llguidance.hf') if m in sys.modules))); "
            f"sys.argv = {argv!r}; runpy.run_path('dist_inference_runner.py', run_name='__main__')")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "HEAVY False" in out.stdout and "LOADED []" in out.stdout, out.stdout
    assert (tmp_path / "out.jsonl").read_text().count("\n") == 1
