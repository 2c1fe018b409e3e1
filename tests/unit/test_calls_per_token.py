"""The glue per generated token stays where issue 54 put it: bench/calls.py's count of calls between the
project's modules (model code excluded) over one greedy request of 64 tokens, at P = 1 and P = 2 in
process. The count depends on the code and the workload only, never on the machine's speed."""

import pytest

import bench.calls as calls


@pytest.mark.parametrize("stages, most", [(1, 45), (2, 70)])
def test_calls_between_modules_per_generated_token(stages, most):
    counter, generated = calls.measure(stages, requests=1, max_tokens=64)
    assert generated == 64
    per_token = counter.total / generated
    top = ", ".join(f"{a} -> {b} {n / generated:.1f}" for (a, b), n in counter.functions.most_common(8))
    assert per_token <= most, f"{per_token:.1f} calls per generated token at P = {stages} (at most {most}): {top}"
