"""stage_ranges: a table of layouts, and the errors that say what to change."""

import pytest

from pipeline.config.partition import stage_ranges


@pytest.mark.parametrize("layers, stages, num_layers, max_layers, expected", [
    (4, 1, None, None, [(0, 4)]),
    (4, 2, None, None, [(0, 2), (2, 4)]),
    (5, 2, None, None, [(0, 3), (3, 5)]),
    (7, 3, None, None, [(0, 3), (3, 5), (5, 7)]),
    (24, 8, None, None, [(i * 3, i * 3 + 3) for i in range(8)]),
    (10, 3, 4, None, [(0, 4), (4, 8), (8, 10)]),          # seed: layers per stage, last takes the rest
    (10, 2, 5, None, [(0, 5), (5, 10)]),
    (10, 2, None, 6, [(0, 3), (3, 6)]),                   # trailing layers dropped
    (10, 2, 3, 6, [(0, 3), (3, 6)]),
    (10, 1, None, 99, [(0, 10)]),                          # cap above depth is harmless
])
def test_layouts(layers, stages, num_layers, max_layers, expected):
    assert stage_ranges(layers, stages, num_layers, max_layers) == expected


@pytest.mark.parametrize("args, message", [
    ((4, 5, None, None), "only 4 layers"),
    ((10, 2, 4, None), "pass --max-layers 8"),
    ((10, 4, 4, None), "leaves the last of 4 stages without layers"),
    ((10, 2, 0, None), "--num-layers must be at least 1"),
    ((10, 2, None, 0), "--max-layers must be at least 1"),
    ((10, 0, None, None), "at least 1"),
])
def test_errors_say_what_to_change(args, message):
    with pytest.raises(ValueError, match=message):
        stage_ranges(*args)
