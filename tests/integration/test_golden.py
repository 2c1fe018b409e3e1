"""The shared request files through torchrun (a process per rank, gloo links) at P = 2 give the results
recorded in tests/data/golden (tests/golden.py), up to float rounding: the in-process runs of
tests/runs/test_golden_runs.py (P = 1, 2, 3) compute what real processes compute."""

from tests.golden import FILES, recorded, run_files
from tests.utils import assert_consistent_results


def test_shared_files_through_torchrun_match_recorded_outputs(tmp_path):
    got, want = run_files(tmp_path, 2, torchrun=True), recorded(2)
    for name in FILES:
        assert_consistent_results(got[name], want[name])
