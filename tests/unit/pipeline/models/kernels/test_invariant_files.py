"""--batch-invariant end to end, in this process: generated request files (prompt lengths, temperatures,
top_p, top_k, logprobs, seeds, n, echo, penalties drawn by Hypothesis) give byte-identical output files
(ids and timing aside) with 1, 2 and 3 threads and at every budget and micro-batch size. The vocabulary
is wider than ATen's reduction grain (32768), where a reduction to one value splits among threads.
P = 2 and 3 with real processes: tests/integration/test_runner_e2e.py; the stages in one process with
1-3 threads: test_invariant.py."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from tests.utils import assert_identical_results, read_jsonl, run_inprocess, tiny_llama, write_jsonl

WORDS = "the quick brown fox jumps over a lazy dog once upon time there was king who had three sons and".split()


@pytest.fixture(scope="module")
def wide_vocab(tmp_path_factory) -> str:
    return tiny_llama(tmp_path_factory.mktemp("wide"), num_hidden_layers=2, num_key_value_heads=2, vocab_size=40000)


@st.composite
def requests(draw) -> list[dict]:
    """4-7 completion requests: text or token-id prompts of 1-200 tokens, greedy or sampled."""
    out = []
    for i in range(draw(st.integers(4, 7))):
        n = draw(st.integers(1, 200))
        words = [WORDS[(i * 7 + j * draw(st.integers(1, 5))) % len(WORDS)] for j in range(max(1, n // 2))]
        prompt = draw(st.sampled_from([" ".join(words), [1 + (i * 31 + j * 17) % 1000 for j in range(n)]]))
        req = {"prompt": prompt, "max_tokens": draw(st.integers(0 if i else 1, 8)),
               "temperature": draw(st.sampled_from([0, 0.3, 0.8, 1.0, 1.7])),
               "top_p": draw(st.sampled_from([1.0, 0.95, 0.5, 0.1])), "seed": draw(st.integers(0, 2**31))}
        for key, values in (("logprobs", [0, 1, 5]), ("top_k", [1, 40]), ("n", [2]), ("echo", [True]),
                            ("presence_penalty", [0.5, -1.0]), ("frequency_penalty", [0.3])):
            if draw(st.booleans()) and draw(st.booleans()):
                req[key] = draw(st.sampled_from(values))
        if req["max_tokens"] == 0:
            req["echo"] = True
        out.append(req)
    return out


# threads, flags: the budget fits the largest request ((200 + 8) tokens x n = 2) and little else
LAYOUTS = [(1, []), (2, []), (3, []), (2, ["--budget", "420", "--max-micro-batch-size", "3"])]


@settings(max_examples=2, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(reqs=requests())
def test_files_are_byte_identical_across_threads_and_budgets(wide_vocab, tmp_path, reqs):
    before = torch.get_num_threads()
    data = write_jsonl(tmp_path / "req.jsonl", reqs)
    outs = []
    try:
        for i, (threads, flags) in enumerate(LAYOUTS):
            out = tmp_path / f"out{i}.jsonl"
            assert run_inprocess(["--model-name", wide_vocab, "--infer-data", data, "--output-path", str(out),
                                  "--no-progress", "--overwrite", "--batch-invariant", "--num-threads", str(threads),
                                  *flags]) == 0
            outs.append(read_jsonl(out))
    finally:
        torch.set_num_threads(before)
    assert all("result" in line for line in outs[0]), [line.get("error") for line in outs[0]]
    for layout, got in zip(LAYOUTS[1:], outs[1:], strict=True):
        assert_identical_results(got, outs[0]), layout
