"""Stage sizes: --layers-per-stage (explicit, unequal) and --stage-memory (layers in proportion to each: the runs that start processes (the rest: tests/unit/pipeline/config/test_sizing.py)."""

from __future__ import annotations

from tests.utils import run_single


def test_mistakes_exit_2_before_loading(llama_2l):
    for flags, message in [(["--layers-per-stage", "3"], "adds up to 3, but the sizes must add up to 2"),
                           (["--layers-per-stage", "1,x"], "expected layer counts separated by commas"),
                           (["--stage-memory", "10KiB"], "short"),
                           (["--num-layers", "1", "--layers-per-stage", "2"], "pass only one of them")]:
        res = run_single(["--model-name", llama_2l, *flags], timeout=120)
        assert res.returncode == 2 and message in res.stderr, res.stderr[-2000:]
        assert "loaded" not in res.stderr
