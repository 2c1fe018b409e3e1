"""pipeline.config.estimate's pure parts: shared-prefix blocks, the calibration's sample and flags, scaling."""

from __future__ import annotations

from pipeline.config.estimate import RUNNER
from pipeline.config.estimate import (FileCount, calibration_args, calibration_command, from_status, sample_lines,
                                      shared_blocks, work)


def test_shared_blocks_counts_leading_blocks_seen_before():
    seen: set[bytes] = set()
    a = list(range(40))
    assert shared_blocks(a, 16, seen) == 0
    assert shared_blocks(a[:32] + [99] * 8, 16, seen) == 2  # the same first two blocks
    assert shared_blocks([7] + a[1:], 16, seen) == 0  # chained: a different first block changes every digest
    assert shared_blocks(a[:10], 16, seen) == 0  # no whole block


def test_sample_lines():
    assert sample_lines(10) == list(range(10))
    assert len(sample_lines(63)) == 32 and sample_lines(63)[0] == 0
    assert len(sample_lines(100_000)) == 512


def test_calibration_args_replace_inputs_and_outputs(tmp_path):
    args = calibration_args(["--model-name", "m", "--infer-data", "a.jsonl", "b.jsonl", "--dry-run", "--budget", "9",
                             "--output-path=o", "--status-file", "s", "--overwrite"], tmp_path / "x", tmp_path / "y")
    assert args[:4] == ["--model-name", "m", "--budget", "9"]
    assert args[4:] == ["--infer-data", str(tmp_path / "x"), "--output-path", str(tmp_path / "y"), "--status-file",
                        "none", "--overwrite", "--no-progress"]


def test_from_status_scales_compute_by_work():
    counts = [FileCount("f", lines=10, prompt_tokens=1000, max_new_tokens=200)]
    last = {"elapsed_seconds": 30.0, "compute_seconds": 20.0, "prompt_tokens": 500, "generated_tokens": 100}
    est = from_status(last, counts)
    done, now = work(500, 100), work(1000, 100)  # half of max_tokens generated, assumed again
    assert abs(est["seconds"] - (10.0 + 20.0 * now / done)) < 1e-9


def test_calibration_command_launches_the_run_as_the_run_would_be():
    """A process per rank through torchrun; with --in-process (kept in the flags) the runner alone, whose
    ranks are threads: torchrun would refuse --in-process."""
    assert calibration_command(["--x"], 1, False)[1:] == [str(RUNNER), "--x"]
    assert calibration_command(["--x", "--in-process"], 2, True)[1:] == [str(RUNNER), "--x", "--in-process"]
    cmd = calibration_command(["--x"], 2, False)
    assert cmd[1:5] == ["-m", "torch.distributed.run", "--nproc-per-node", "2"] and cmd[-2:] == [str(RUNNER), "--x"]
