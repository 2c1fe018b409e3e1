"""pipeline.config.estimate's pure parts: shared-prefix blocks, the calibration's sample and flags, scaling."""

from __future__ import annotations

import json

from pipeline.config.estimate import RUNNER
from pipeline.config.estimate import (FileCount, calibration_args, calibration_command, count_file, from_status,
                                      sample_lines, shared_blocks, work)
from pipeline.loading.default_model import default_model_dir
from pipeline.loading.tokenizer import load_tokenizer
from pipeline.scheduling.intake import chat_ids
from tasks.requests import parse_line


def test_shared_blocks_counts_leading_blocks_seen_before():
    seen: set[bytes] = set()
    a = list(range(40))
    assert shared_blocks(a, 16, seen) == 0
    assert shared_blocks(a[:32] + [99] * 8, 16, seen) == 2  # the same first two blocks
    assert shared_blocks([7] + a[1:], 16, seen) == 0  # chained: a different first block changes every digest
    assert shared_blocks(a[:10], 16, seen) == 0  # no whole block


def test_a_file_counts_chat_and_completion_lines_as_the_run_tokenizes_them(tmp_path):
    """--dry-run's counts: each line's prompt tokens as the driver would encode them (chat lines with their
    chat_template_kwargs), lines the run answers with an error counted as bad."""
    tok = load_tokenizer(default_model_dir())
    chats = [{"messages": [{"role": "user", "content": "Hi there"}], "max_tokens": 3},
             {"messages": [{"role": "user", "content": "Think"}], "chat_template_kwargs": {"enable_thinking": True},
              "max_tokens": 2, "n": 2}]
    lines = [*({"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}
               for i, body in enumerate(chats)),
             {"prompt": "Once upon a time", "max_tokens": 4},
             {"prompt": [5, 6, 7], "max_tokens": 1},
             {"prompt": 3}, {"prompt": [1] * 2040, "max_tokens": 9}, {"prompt": [1, 1024], "max_tokens": 1}]
    path = tmp_path / "r.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines) + "not json\n")
    c = count_file(str(path), tok, 16, set(), 2048, 1024)
    ids = [chat_ids(tok, x["messages"], x.get("chat_template_kwargs")) for x in chats]
    text = list(tok("Once upon a time", add_special_tokens=True)["input_ids"])
    assert c.lines == 8 and c.bad == 4  # (beyond the context window; a token id outside the vocabulary)
    assert c.per_line == [(len(ids[0]), 3), (len(ids[1]), 4), (len(text), 4), (3, 1), (0, 0), (0, 0), (0, 0), (0, 0)]
    assert count_file(str(path), tok, 16, set(), 2048, 1024, truncate=True).per_line[5] == (2039, 9)  # left-truncated
    assert parse_line(json.dumps(lines[1]).encode(), 1).template_kwargs == {"enable_thinking": True}


def test_sample_lines():
    assert sample_lines(10) == list(range(10))
    assert len(sample_lines(63)) == 32 and sample_lines(63)[0] == 0
    assert len(sample_lines(100_000)) == 512


def test_calibration_args_replace_inputs_and_outputs(tmp_path):
    args = calibration_args(["--model-name", "m", "--infer-data", "a.jsonl", "b.jsonl", "--dry-run", "--budget", "9",
                             "--output-path=o", "--status-file", "s", "--overwrite"], tmp_path / "x", tmp_path / "y")
    assert args[:4] == ["--model-name", "m", "--budget", "9"]
    assert args[4:] == ["--infer-data", str(tmp_path / "x"), "--output-path", str(tmp_path / "y"), "--status-file",
                        "none", "--overwrite", "--no-progress"]


def test_from_status_scales_compute_by_work():
    counts = [FileCount("f", lines=10, prompt_tokens=1000, max_new_tokens=200)]
    last = {"elapsed_seconds": 30.0, "compute_seconds": 20.0, "prompt_tokens": 500, "generated_tokens": 100}
    est = from_status(last, counts)
    done, now = work(500, 100), work(1000, 100)  # half of max_tokens generated, assumed again
    assert abs(est["seconds"] - (10.0 + 20.0 * now / done)) < 1e-9


def test_calibration_command_launches_the_run_as_the_run_would_be():
    """A process per rank through torchrun; with --in-process (kept in the flags) the runner alone, whose
    ranks are threads: torchrun would refuse --in-process."""
    assert calibration_command(["--x"], 1, False)[1:] == [str(RUNNER), "--x"]
    assert calibration_command(["--x", "--in-process"], 2, True)[1:] == [str(RUNNER), "--x", "--in-process"]
    cmd = calibration_command(["--x"], 2, False)
    assert cmd[1:5] == ["-m", "torch.distributed.run", "--nproc-per-node", "2"] and cmd[-2:] == [str(RUNNER), "--x"]
