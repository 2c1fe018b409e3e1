"""--prompts / --prompts-file on the default model: the same completions as file mode for the same
requests, printed with each prompt, then the latency report, at P = 1 and P = 2."""

from __future__ import annotations

import re

import pytest

from tests.utils import read_jsonl, run_single, run_torchrun, write_jsonl

PROMPTS = ["Passage: The kitchen is north of the hallway.\nThe garden is west of the kitchen.\n"
           "Question: How do you go from the hallway to the garden?\nAnswer:",
           "Q: 12 + 7 =",
           "Once upon a time",
           "Reverse: cat sun tree ->"]
FLAGS = ["--max-tokens", "12", "--temperature", "0", "--stop", r"\n", "--num-threads", "1", "--no-progress"]
ENV = {"DIST_INFER_LOG": "WARNING"}


@pytest.fixture(scope="module")
def file_mode(tmp_path_factory) -> list[str]:
    """File mode's completions of the same requests (P = 1)."""
    d = tmp_path_factory.mktemp("prompts_ref")
    src = write_jsonl(d / "r.jsonl", [{"prompt": p, "max_tokens": 12, "temperature": 0, "stop": ["\n"]}
                                      for p in PROMPTS])
    res = run_single(["--infer-data", src, "--num-threads", "1", "--no-progress"], timeout=400, env=ENV)
    assert res.returncode == 0, res.stderr[-3000:]
    return [line["result"]["choices"][0]["text"] for line in read_jsonl(d / "output_r.jsonl")]


def check_printed(out: str, completions: list[str]) -> None:
    for i, (p, text) in enumerate(zip(PROMPTS, completions, strict=True), 1):
        block = f"---- prompt {i} ----\n{p}\n---- completion {i} (finish_reason: "
        assert block in out, out
        after = out.split(block, 1)[1]
        assert after.split(" ----\n", 1)[1].startswith(text + "\n"), (i, text, after[:200])
    assert completions[0] == " north west"  # what the default model answers (docs/usage/default-model.md)
    report = out.split("---- latency ----\n", 1)[1]
    assert re.search(r"^bs: 4, input tokens: \[\d+, \d+, \d+, \d+\], output tokens: \[\d+, \d+, \d+, \d+\]$",
                     report, re.M), report
    for name in ("encode latency", "generate latency", "decode latency", "total latency",
                 "latency per output token", "output tokens/s"):
        assert re.search(rf"{name}: [0-9.]+", report), (name, report)


def test_prompts_p1_equal_file_mode(file_mode):
    res = run_single(["--prompts", *PROMPTS, *FLAGS], timeout=400, env=ENV)
    assert res.returncode == 0, res.stderr[-3000:]
    check_printed(res.stdout, file_mode)


def test_prompts_file_p2_equal_file_mode(file_mode, tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text("".join(p.replace("\n", "\\n") + "\n\n" for p in PROMPTS))  # blank lines are skipped
    res = run_torchrun(["--prompts-file", str(path), *FLAGS], nproc=2, timeout=600, env=ENV)
    assert res.returncode == 0, res.stderr[-3000:]
    check_printed(res.stdout, file_mode)


def test_prompts_refused_with_infer_data(tmp_path):
    res = run_single(["--prompts", "hi", "--infer-data", str(tmp_path / "x.jsonl")], timeout=120)
    assert res.returncode == 2
    assert "--prompts takes its prompts from the terminal" in res.stderr
