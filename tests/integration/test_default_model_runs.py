"""The embedded default model: shipped files, offline tokenizer, and answers that are right: the runs that start processes (the rest: tests/unit/pipeline/loading/test_default_model.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
import pytest
from examples import check_default_model as check
from tests.utils import REPO
from tests.unit.pipeline.loading.test_default_model import FLOORS, N_PER_TASK, heldout_runs, model_dir, tokenizer  # noqa: F401 (fixtures and helpers)


def test_import_is_cheap() -> None:
    code = ("import sys; from pipeline.loading.default_model import default_model_dir; default_model_dir(); "
            "print('torch' in sys.modules or 'transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "False"


def test_a_file_run_imports_no_server(tmp_path: Path) -> None:
    """A rank's start-up is paid once per shard and rank in a drain loop: a file-mode run loads neither
    FastAPI nor uvicorn (serve mode's: 0.6 s of start-up), nor llguidance's tokenizer bridge (on the
    first grammar)."""
    data = tmp_path / "one.jsonl"
    data.write_text('{"prompt": "Hi", "max_tokens": 2}\n')
    argv = ["dist_inference_runner.py", "--infer-data", str(data), "--output-path", str(tmp_path / "out.jsonl"),
            "--no-progress", "--num-threads", "1"]
    code = ("import atexit, runpy, sys; atexit.register(lambda: print('LOADED', sorted(m for m in "
            "('fastapi', 'uvicorn', 'llguidance.hf') if m in sys.modules))); "
            f"sys.argv = {argv!r}; runpy.run_path('dist_inference_runner.py', run_name='__main__')")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "LOADED []" in out.stdout, out.stdout
    assert (tmp_path / "out.jsonl").read_text().count("\n") == 1


def test_training_script_is_deterministic(tmp_path: Path) -> None:
    """A few steps twice: the same files (and the tokenizer it trains is the shipped one: checked
    inside, as is that the rows' attention targets exist)."""
    outs = []
    for run in ("a", "b"):
        cmd = [sys.executable, str(REPO / "examples" / "train_default_model.py"), "--out", str(tmp_path / run),
               "--steps", "3", "--batch", "4", "--eval-every", "0", "--eval-n", "0", "--threads", "1"]
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "attention" in proc.stderr  # the supervision loss is logged
        outs.append((tmp_path / run / "model.safetensors").read_bytes())
    assert outs[0] == outs[1]


@pytest.mark.parametrize("pipeline", [1, 2])
def test_heldout_accuracy_through_the_runner(heldout_runs, pipeline: int) -> None:
    """Issue 17's targets (path questions zero- and few-shot, "who has what" generated and as lm-eval
    multiple choice >= 90%), and the same floor for sums, copy and reverse (a broken pipeline: wrong
    logits, positions or cache, falls far below it)."""
    scores = check.score(heldout_runs[pipeline])
    assert set(scores) == set(FLOORS)
    acc = {task: hit / total for task, (hit, total) in scores.items()}
    assert all(total >= N_PER_TASK for _, total in scores.values())
    low = {task: a for task, a in acc.items() if a < FLOORS[task]}
    assert not low, f"below the floor: {low} (all: {acc})"


def test_pipeline_sizes_give_the_same_greedy_answers(heldout_runs) -> None:
    assert check.greedy_texts(heldout_runs[1]) == check.greedy_texts(heldout_runs[2])
