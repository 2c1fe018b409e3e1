"""--config run.yaml: keys are the long flag names, the command line overrides the file, unknown keys: the runs that start processes (the rest: tests/unit/pipeline/config/test_options.py)."""

from __future__ import annotations

import json
from tests.utils import read_jsonl, run_single
from tests.unit.pipeline.config.test_options import config  # noqa: F401 (fixtures and helpers)


def test_run_configured_by_yaml(tmp_path, llama_2l):
    model = llama_2l
    data = tmp_path / "requests.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "max_tokens": 4, "temperature": 0}) + "\n"
                            for p in ("hello", "Once upon a time", "The kitchen is north of")))
    out = tmp_path / "results" / "out.jsonl"
    out.parent.mkdir()
    cfg = config(tmp_path, f"model-name: {model}\ninfer-data: {data}\noutput-path: {out}\n"
                           "num-threads: 1\nno-progress: true\nbudget: 100\nmax-micro-batch-size: 1\n")
    p = run_single(["--config", cfg, "--max-micro-batch-size", "2"])
    assert p.returncode == 0, p.stderr[-3000:]
    lines = read_jsonl(out)
    assert [x["request"]["prompt"] for x in lines] == ["hello", "Once upon a time", "The kitchen is north of"]
    assert all(len(x["result"]["choices"][0]["logprobs"]["tokens"]) == 4 for x in lines)
    assert max(x["result"]["request_time"]["batch_size"] for x in lines) == 2  # the command line's 2, not the file's 1
