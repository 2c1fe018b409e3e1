"""Operations, in one process (``--in-process``): data parallelism (two pipelines, one ordered output and
one merged summary), progress lines and the run summary, per-stage busy fractions and profiling
traces on one clock, dummy-data mode's latency figures, and the terminal's --prompts / --prompts-file
(the same completions as file mode, then the latency report) at P = 1 and 2."""

import json
import re

import pytest

from tests.utils import assert_identical_results, read_jsonl, run_local, write_jsonl


@pytest.fixture(scope="module")
def model_dir(llama_2l):
    return llama_2l


@pytest.fixture(scope="module")
def requests(tmp_path_factory):
    reqs = [{"prompt": f"Line {i} says", "max_tokens": 3 + i % 4, "temperature": 0.8, "logprobs": 1}
            for i in range(11)]
    reqs.insert(4, {"prompt": "bad", "max_tokens": -1})
    return write_jsonl(tmp_path_factory.mktemp("ops_req") / "req.jsonl", reqs)


@pytest.fixture(scope="module")
def dp_requests(tmp_path_factory):
    """More than two runs of 64 lines (tasks/shards.py): both pipelines answer, interleaved."""
    reqs = [{"prompt": f"Line {i} says", "max_tokens": 1 + i % 3, "temperature": 0.8, "logprobs": 1}
            for i in range(139)]
    reqs.insert(4, {"prompt": "bad", "max_tokens": -1})
    return write_jsonl(tmp_path_factory.mktemp("dp_req") / "req.jsonl", reqs)


def test_data_parallel_two_pipelines_give_one_ordered_output(model_dir, dp_requests, tmp_path):
    requests = dp_requests
    one, two = tmp_path / "one.jsonl", tmp_path / "two.jsonl"
    exact = "--batch-invariant"  # each pipeline's micro-batches hold other neighbours than the single run's
    p = run_local(["--model-name", model_dir, "--infer-data", requests, "--output-path", str(one), exact])
    assert p.returncode == 0, p.stderr[-3000:]
    p = run_local(["--model-name", model_dir, "--infer-data", requests, "--output-path", str(two), exact], data=2)
    assert p.returncode == 0, p.stderr[-3000:]
    assert_identical_results(read_jsonl(one), read_jsonl(two))
    status = sorted(f.name for f in tmp_path.iterdir() if ".status" in f.name)  # each data group's, kept
    assert status == ["one.jsonl.status.json", "two.jsonl.status-0-of-2.json", "two.jsonl.status-1-of-2.json"]
    assert all(json.loads((tmp_path / n).read_text())["state"] == "finished" for n in status)
    leftovers = [f.name for f in tmp_path.iterdir()
                 if (".partial" in f.name or "merge" in f.name or "-of-" in f.name) and ".status" not in f.name]
    assert leftovers == []
    # one summary, like the output: the totals, and each data group's figures
    merged, single = (json.loads((tmp_path / f"{n}.jsonl.summary.json").read_text()) for n in ("two", "one"))
    for key in ("requests", "errors", "answered", "error_kinds", "prompt_tokens", "completion_tokens"):
        assert merged[key] == single[key], key
    assert merged["requests"] == 140 and merged["errors"] == 1 and merged["data_group_size"] == 2
    assert [g["data_rank"] for g in merged["data_groups"]] == [0, 1]
    assert [g["requests"] for g in merged["data_groups"]] == [64 + 12, 64]  # runs 0 and 2; run 1
    assert merged["run"] == dict(single["run"], data_group_size=2)
    # the merged output counts as this run's for a rerun with or without data parallelism
    p = run_local(["--model-name", model_dir, "--infer-data", requests, "--output-path", str(two), exact])
    assert p.returncode == 0 and "skipped, output already complete" in p.stderr, p.stderr[-3000:]


def test_progress_lines_summary_and_no_progress(model_dir, requests, tmp_path, monkeypatch):
    import tasks.progress

    monkeypatch.setattr(tasks.progress, "LOG_EVERY", 0.0)  # what DIST_INFER_PROGRESS_SECONDS=0 sets in a process
    out = tmp_path / "o.jsonl"
    p = run_local(["--model-name", model_dir, "--infer-data", requests, "--output-path", str(out)])
    assert p.returncode == 0, p.stderr[-3000:]
    assert "/12 requests" in p.stderr and "generated tok/s" in p.stderr and "ETA" in p.stderr
    counts = [int(n) for n in re.findall(r"(\d+)/12 requests", p.stderr)]
    assert counts == sorted(counts) and counts[-1] <= 12, counts  # the lines answered, not a sum of the counts
    assert "12 requests, 11 answered, 1 errors (max_tokens: 1)" in p.stderr
    # a request larger than the budget is counted as such, not under its OpenAI param (max_tokens)
    p = run_local(["--model-name", model_dir, "--infer-data", requests, "--output-path", str(tmp_path / "b.jsonl"),
                   "--budget", "5", "--no-progress"])
    assert p.returncode == 0 and "errors (budget: 11, max_tokens: 1)" in p.stderr, p.stderr[-3000:]
    summary = json.loads((tmp_path / "o.jsonl.summary.json").read_text())
    for key in ("requests", "errors", "prompt_tokens", "completion_tokens", "wall_seconds",
                "completion_tokens_per_second", "stage_busy", "padding_waste"):
        assert key in summary
    assert summary["completion_tokens"] == sum(len(x["result"]["choices"][0]["logprobs"]["tokens"])
                                               for x in read_jsonl(out) if "result" in x)
    assert len(summary["stage_busy"]) == 1 and 0 < summary["stage_busy"][0] <= 1
    p = run_local(["--model-name", model_dir, "--infer-data", requests, "--output-path", str(out),
                   "--overwrite", "--no-progress"])
    assert p.returncode == 0 and "/12 requests" not in p.stderr


def test_two_stage_summary_has_a_busy_fraction_per_stage_and_profiling_traces(model_dir, requests, tmp_path):
    out = tmp_path / "o.jsonl"
    p = run_local(["--model-name", model_dir, "--infer-data", requests, "--output-path", str(out), "--profiling"], 2)
    assert p.returncode == 0, p.stderr[-3000:]
    summary = json.loads((tmp_path / "o.jsonl.summary.json").read_text())
    assert len(summary["stage_busy"]) == 2 and all(0 < b <= 1 for b in summary["stage_busy"])
    forwards = []
    for rank in (0, 1):
        trace = json.loads((tmp_path / f"o.jsonl.trace-rank{rank}.json").read_text())
        names = {e["name"] for e in trace["traceEvents"]}
        assert "forward" in names and "recv" in names
        assert all(e["dur"] >= 0 for e in trace["traceEvents"] if e["ph"] == "X")
        forwards.append([e for e in trace["traceEvents"] if e["name"] == "forward"])
    # one clock for both ranks: rank 1 computes a pass only after rank 0 has finished it
    first0, first1 = min(forwards[0], key=lambda e: e["ts"]), min(forwards[1], key=lambda e: e["ts"])
    assert first0["ts"] + first0["dur"] <= first1["ts"]


def test_dummy_data_mode_prints_latency_figures(model_dir):
    p = run_local(["--model-name", model_dir, "--batch-size", "3", "--input-seq-length", "8",
                   "--generate-seq-length", "4"])
    assert p.returncode == 0, p.stderr[-3000:]
    for figure in ("encode latency", "generation latency", "decode latency", "latency per output token",
                   "output tokens/s"):
        assert figure in p.stdout
    assert "batch 3 x 8 prompt tokens, 4 new tokens each" in p.stdout


# -- the terminal: --prompts / --prompts-file on the default model -----------------------------------

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
    res = run_local(["--infer-data", src, "--num-threads", "1", "--no-progress"], env=ENV)
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
    res = run_local(["--prompts", *PROMPTS, *FLAGS], env=ENV)
    assert res.returncode == 0, res.stderr[-3000:]
    check_printed(res.stdout, file_mode)


def test_prompts_file_p2_equal_file_mode(file_mode, tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text("".join(p.replace("\n", "\\n") + "\n\n" for p in PROMPTS))  # blank lines are skipped
    res = run_local(["--prompts-file", str(path), *FLAGS], 2, env=ENV)
    assert res.returncode == 0, res.stderr[-3000:]
    check_printed(res.stdout, file_mode)


def test_prompts_refused_with_infer_data(tmp_path):
    res = run_local(["--prompts", "hi", "--infer-data", str(tmp_path / "x.jsonl")])
    assert res.returncode == 2
    assert "--prompts takes its prompts from the terminal" in res.stderr
