"""The embedded default model's answers through the runner, in one process (``--in-process``): held-out
accuracy at P = 1 above each task's floor, the same answers at P = 2 (a third of the questions); the training script
deterministic. Its files and tokenizer: tests/unit/pipeline/loading/test_default_model.py; what a fresh
process imports: tests/integration/test_default_model_runs.py."""

from __future__ import annotations

from pathlib import Path

import torch

from examples import check_default_model as check
from tests.unit.pipeline.loading.test_default_model import (FLOORS, HELDOUT_P2_EVERY, N_PER_TASK,  # noqa: F401
                                                             heldout_runs, model_dir, tokenizer)
from tests.utils import assert_identical_results


def test_heldout_accuracy_through_the_runner(heldout_runs) -> None:  # noqa: F811 (the fixture)
    """Issue 17's targets (path questions zero- and few-shot, "who has what" generated and as lm-eval
    multiple choice >= 90%), and the same floor for sums, copy and reverse (a broken pipeline: wrong
    logits, positions or cache, falls far below it); P = 2 gives the same answers (below)."""
    scores = check.score(heldout_runs[1])
    assert set(scores) == set(FLOORS)
    acc = {task: hit / total for task, (hit, total) in scores.items()}
    assert all(total >= N_PER_TASK for _, total in scores.values())
    low = {task: a for task, a in acc.items() if a < FLOORS[task]}
    assert not low, f"below the floor: {low} (all: {acc})"


def test_pipeline_sizes_give_the_same_answers(heldout_runs) -> None:  # noqa: F811 (the fixture)
    """--batch-invariant: P = 2's lines (every third question, every task) equal P = 1's, logprobs too."""
    assert_identical_results(heldout_runs[2], heldout_runs[1][::HELDOUT_P2_EVERY])
    tasks = {x["custom_id"].split("=", 1)[0] if "custom_id" in x else
             "owner/choice" if "doc" in x["request"]["metadata"] else x["request"]["metadata"]["task"]
             for x in heldout_runs[2]}
    assert tasks == set(FLOORS)


def test_training_script_is_deterministic(tmp_path: Path, capsys) -> None:
    """A few steps twice: the same files (and the tokenizer it trains is the shipped one: checked
    inside, as is that the rows' attention targets exist). The script's main in this process, with
    torch's process-wide settings it changes put back."""
    from examples import train_default_model

    outs = []
    for run in ("a", "b"):
        threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
        try:
            with torch.random.fork_rng():
                train_default_model.main(["--out", str(tmp_path / run), "--steps", "3", "--batch", "4",
                                          "--eval-every", "0", "--eval-n", "0", "--threads", "1"])
        finally:
            torch.set_num_threads(threads)
            torch.use_deterministic_algorithms(deterministic)
        assert "attention" in capsys.readouterr().err  # the supervision loss is logged
        outs.append((tmp_path / run / "model.safetensors").read_bytes())
    assert outs[0] == outs[1]
