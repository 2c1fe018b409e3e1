"""The README's examples: every family's tiny model runs the example request file end to end."""

import pytest

from examples.tiny_family import CONFIGS, build
from tests.utils import REPO, read_jsonl, run_inprocess


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_each_family_runs_the_example_requests(family, tmp_path):
    model = build(family, str(tmp_path / family))
    out = tmp_path / "out.jsonl"
    assert run_inprocess(["--model-name", model, "--infer-data", str(REPO / "examples" / "requests.jsonl"),
                          "--output-path", str(out), "--no-progress"]) == 0
    lines = read_jsonl(out)
    assert len(lines) == 6 and all("result" in x for x in lines)
    scored = lines[2]["result"]["choices"][0]
    assert scored["text"] == "The quick brown fox jumps over the lazy dog." and scored["logprobs"]["token_logprobs"][0] is None
