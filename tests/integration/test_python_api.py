"""The Python API under torchrun: rank 0's process runs the script, the other ranks serve its passes
(the API in process at P = 1 and 2: tests/runs/test_python_api_runs.py)."""

from __future__ import annotations

import json
import sys

from dist_inference_runner import LLM, SamplingParams
from tests.utils import REPO, free_port, run_cmd

FLAGS = {"budget": 8192, "no_progress": True}
SCRIPT = """
import json, sys
from dist_inference_runner import LLM, SamplingParams
llm = LLM(pipeline_size=2, budget=8192, no_progress=True)
results = llm.generate({prompts!r}, SamplingParams(max_tokens=6, temperature=0))
print("RESULTS " + json.dumps([r.text for r in results]), flush=True)
llm.close()
"""


def test_torchrun_two_ranks(tmp_path):
    prompts = ["Once upon a time", "The cat", "Passage: The kitchen is north of the hallway.\nAnswer:"]
    script = tmp_path / "two_ranks.py"
    script.write_text(SCRIPT.format(prompts=prompts))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), str(script)]
    r = run_cmd(cmd, timeout=600, env={"PYTHONPATH": str(REPO)})
    assert r.returncode == 0, r.stderr[-3000:]
    printed = [x for x in r.stdout.splitlines() if x.startswith("RESULTS ")]
    assert len(printed) == 1, r.stdout  # rank 0 only
    with LLM(**FLAGS) as one:
        expected = [x.text for x in one.generate(prompts, SamplingParams(max_tokens=6, temperature=0))]
    assert json.loads(printed[0][len("RESULTS "):]) == expected
