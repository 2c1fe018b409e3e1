"""The shared request files give the results recorded in tests/data/golden (tests/golden.py) at P = 1, 2
and 3, in one process (``--in-process``), up to float rounding: a refactor of the pipeline must not
change what users get. Through torchrun: tests/integration/test_launch.py (launch/local_torchrun.sh)."""

import pytest

from tests.golden import FILES, recorded, run_files
from tests.utils import assert_consistent_results


@pytest.mark.parametrize("stages", [1, 2, 3])
def test_shared_files_match_recorded_outputs(tmp_path, stages):
    got, want = run_files(tmp_path, stages), recorded(stages)
    for name in FILES:
        assert_consistent_results(got[name], want[name])
