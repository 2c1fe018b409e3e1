"""Rows resumed mid-generation (issue 55): a run stopped again and again (the stop an in-process caller
gives the runner, SIGTERM's path) checkpoints its rows in flight, and the next run re-prefills each
row's prompt with its tokens so far and samples on from there: the file ends as an uninterrupted run's
(tokens equal but at near-ties, logprobs within float rounding: a resumed row's later tokens come after
a prefill instead of decode steps; under --batch-invariant byte for byte), no stop is taken for a crash,
and the status file says ``stopped``."""

from __future__ import annotations

import json
import logging
import threading

import pytest
from hypothesis import HealthCheck, given, settings

from tasks.status import read_status
from tests.unit.pipeline.models.kernels.test_invariant_files import requests as generated_requests
from tests.utils import (assert_consistent_results, assert_identical_results, read_jsonl, run_local, tiny_llama,
                         write_jsonl)

REQUESTS = [{"prompt": f"Once upon a time {i}", "max_tokens": 40 + (i % 4) * 15, "temperature": 0 if i % 2 else 0.9,
             "seed": i, "logprobs": 2, **({"stop": ["zzz"]} if i % 3 == 0 else {}),
             # penalties over the prompt's and the tokens so far (issue 58): a resumed row counts them again
             **({"repetition_penalty": 1.3, "min_tokens": 20, "min_p": 0.05} if i % 4 == 1 else {})}
            for i in range(16)]


class StopAfter(threading.Event):
    """Set (as SIGTERM sets the runner's stop) ``steps`` steps of the engine's loop after ``journal`` holds
    ``lines`` more lines than at the start (lines finished meanwhile wait in the checkpoint behind a row
    still in flight). The engine asks at each step, so where a run stops depends on its progress alone,
    not on how soon a watcher would see the file on a loaded machine."""

    def __init__(self, journal, lines: int, steps: int = 4):
        super().__init__()
        self.journal, self.lines, self.steps = journal, lines, steps
        self.start = self.count()

    def count(self) -> int:
        return self.journal.read_bytes().count(b"\n") if self.journal.exists() else 0

    def is_set(self) -> bool:
        if not super().is_set() and self.count() >= self.start + self.lines:
            self.steps -= 1
            if self.steps < 0:
                self.set()
        return super().is_set()


def stopped_run(args: list[str], stages: int, journal, lines: int):
    """A run whose engine is told to stop (as SIGTERM would) once ``journal`` holds ``lines`` more lines
    than when it started."""
    import dist_inference_runner

    argv = [*args, "--in-process", "--pipeline-group-size", str(stages)]
    return dist_inference_runner.main(argv, signals=False, stopping=StopAfter(journal, lines))


@pytest.mark.parametrize("stages", [1, 2])
def test_a_stopped_run_resumes_its_rows_where_they_stopped(tmp_path, stages, caplog):
    src = write_jsonl(tmp_path / "r.jsonl", REQUESTS)
    flags = ["--infer-data", src, "--no-progress", "--num-threads", "1", "--max-micro-batch-size", "4",
             "--checkpoint-interval", "0"]
    assert run_local([*flags, "--output-path", str(tmp_path / "clean.jsonl")], stages).returncode == 0
    out = tmp_path / "cut.jsonl"
    runs, resumed, kept = 0, 0, 0
    caplog.set_level(logging.INFO)
    while not out.exists():
        caplog.clear()
        code = stopped_run([*flags, "--output-path", str(out)], stages, tmp_path / "cut.jsonl.partial", 1)
        runs += 1
        assert runs < 30
        assert "an earlier run ended" not in caplog.text  # a stop is never taken for a crash
        resumed += caplog.text.count("rows where they stopped")
        kept += caplog.text.count("kept by the last checkpoint")  # answered, waiting for an earlier line
        if not out.exists():
            assert code == 143 and read_status(str(out) + ".status.json")["state"] == "stopped"
    assert runs > 1 and resumed > 0 and kept > 0, (runs, resumed, kept)
    assert_consistent_results(read_jsonl(tmp_path / "clean.jsonl"), read_jsonl(out), tol=1e-3)
    assert not (tmp_path / "cut.jsonl.partial.rows").exists()  # gone with the finished output


@pytest.mark.parametrize("stages, extra", [(2, []), (1, ["--dtype", "bfloat16", "--kv-cache-dtype", "int8"])],
                         ids=["P2", "P1-bf16-int8-cache"])
def test_under_batch_invariant_a_resumed_file_is_bit_identical(tmp_path, stages, extra):
    """--batch-invariant: the tokens a row generated before the stop are computed again, in its prefill, one
    query at a time with the keys a decode step reads (from the cache, as the decode step read them), so the
    file stopped again and again ends byte for byte as the uninterrupted run's (ids and timing aside),
    logprobs too. Fails if the resumed tokens go through the prompt's attention (last bits differ)."""
    src = write_jsonl(tmp_path / "r.jsonl", REQUESTS)
    flags = ["--infer-data", src, "--no-progress", "--num-threads", "1", "--max-micro-batch-size", "4",
             "--checkpoint-interval", "0", "--batch-invariant", *extra]
    assert run_local([*flags, "--output-path", str(tmp_path / "clean.jsonl")], stages).returncode == 0
    out, runs = tmp_path / "cut.jsonl", 0
    while not out.exists():
        stopped_run([*flags, "--output-path", str(out)], stages, tmp_path / "cut.jsonl.partial", 3)
        runs += 1
        assert runs < 30
    assert runs > 1
    assert_identical_results(read_jsonl(tmp_path / "clean.jsonl"), read_jsonl(out))


def run_to_the_end(flags: list[str], out, stages: int, lines: int) -> int:
    """Runs stopped every ``lines`` journaled lines until ``out`` is written; returns how many it took."""
    runs = 0
    while not out.exists():
        stopped_run([*flags, "--output-path", str(out)], stages, out.with_name(out.name + ".partial"), lines)
        runs += 1
        assert runs < 40
    return runs


@settings(max_examples=2, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(reqs=generated_requests())
def test_generated_files_stopped_mid_run_end_bit_identical_under_batch_invariant(tmp_path_factory, caplog, reqs):
    """Request files drawn by Hypothesis (prompt lengths, temperatures, top_p, top_k, logprobs, seeds, n, echo,
    penalties), stopped after every journaled line and resumed, end byte for byte as the uninterrupted run."""
    tmp = tmp_path_factory.mktemp("generated")
    # a first line answered at once stops the first run with a plain row beside it in flight (resumed for sure),
    # the drawn rows long enough to be cut mid-way by the later stops
    long_row = {"prompt": "Once upon a time", "max_tokens": 120, "ignore_eos": True}
    reqs = [{"prompt": "Hi", "max_tokens": 1}, long_row] + [
        r | {"max_tokens": 24 + 8 * r["max_tokens"]} if r["max_tokens"] else r for r in reqs]
    src = write_jsonl(tmp / "r.jsonl", reqs)
    flags = ["--infer-data", src, "--no-progress", "--num-threads", "1", "--max-micro-batch-size", "3",
             "--checkpoint-interval", "0", "--batch-invariant"]
    assert run_local([*flags, "--output-path", str(tmp / "clean.jsonl")], 1).returncode == 0
    caplog.clear()
    caplog.set_level(logging.INFO)
    assert run_to_the_end(flags, tmp / "cut.jsonl", 1, 1) > 1 and "rows where they stopped" in caplog.text
    clean = read_jsonl(tmp / "clean.jsonl")
    assert all("result" in line for line in clean), [line.get("error") for line in clean]
    assert_identical_results(clean, read_jsonl(tmp / "cut.jsonl"))


def test_rows_of_lora_adapters_resume_under_their_adapter(tmp_path, caplog):
    """Half the rows name a LoRA adapter: a resumed row's prefill (prompt and tokens so far) runs under its
    adapter, so the file stopped again and again ends as the uninterrupted run's (P = 2)."""
    from tests.unit.pipeline.models.test_lora import make_adapter

    model = tiny_llama(tmp_path / "m")
    adapter = make_adapter(model, tmp_path / "adapter", ["q_proj", "v_proj", "down_proj"], seed=3)
    src = write_jsonl(tmp_path / "r.jsonl", [r | {"model": "ad"} if i % 2 else r for i, r in enumerate(REQUESTS)])
    flags = ["--model-name", model, "--lora", f"ad={adapter}", "--infer-data", src, "--no-progress",
             "--num-threads", "1", "--max-micro-batch-size", "4", "--checkpoint-interval", "0"]
    assert run_local([*flags, "--output-path", str(tmp_path / "clean.jsonl")], 2).returncode == 0
    caplog.set_level(logging.INFO)
    assert run_to_the_end(flags, tmp_path / "cut.jsonl", 2, 2) > 1 and "rows where they stopped" in caplog.text
    clean = read_jsonl(tmp_path / "clean.jsonl")
    assert [line["result"]["model"] for line in clean] == ["ad" if i % 2 else clean[0]["result"]["model"]
                                                           for i in range(len(REQUESTS))]
    assert_consistent_results(clean, read_jsonl(tmp_path / "cut.jsonl"), tol=1e-3)


def test_the_checkpoint_holds_the_rows_in_flight_and_only_those(tmp_path):
    src = write_jsonl(tmp_path / "r.jsonl", REQUESTS[:4] + [{"prompt": "x", "max_tokens": 30, "n": 2},
                                                              {"prompt": "y", "max_tokens": 30, "echo": True}])
    out = tmp_path / "o.jsonl"
    code = stopped_run(["--infer-data", src, "--output-path", str(out), "--no-progress", "--num-threads", "1",
                        "--checkpoint-interval", "0"], 1, tmp_path / "o.jsonl.partial", 1)
    assert code == 143
    rows = json.loads((tmp_path / "o.jsonl.partial.rows").read_text())
    answered = rows.pop("answered")  # lines answered, waiting for an earlier one to be journaled
    assert set(rows) <= {"0", "1", "2", "3"}  # not the n = 2 or echo lines: those run again from the start
    assert not set(rows) & set(answered) and all(json.loads(x)["request"] for x in answered.values())
    for r in rows.values():
        assert len(r["ids"]) == len(r["logprobs"]) == len(r["top"]) and r["ids"]


def test_thinking_rows_start_again_after_a_stop(tmp_path):
    """A reasoning model's rows are not checkpointed mid-generation (the thinking's phases, its budget and
    the grammar held back for the answer are not replayed): after a stop they run again from their first
    token, and the file ends as an uninterrupted run's, the rows that do not think resumed as usual."""
    from tests.reasoning_models import tiny_thinking_model

    model = tiny_thinking_model(tmp_path / "deepseek", "deepseek", seed=1)
    lines = [{"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"messages": [{"role": "user", "content": f"Question {i}"}], "temperature": 0,
                       "max_tokens": 24, "thinking_token_budget": 6, "logprobs": True}} for i in range(6)]
    lines += [{"prompt": f"Plain {i}", "max_tokens": 30, "temperature": 0} for i in range(4)]
    src = write_jsonl(tmp_path / "r.jsonl", lines)
    flags = ["--model-name", model, "--infer-data", src, "--no-progress", "--num-threads", "1",
             "--max-micro-batch-size", "4", "--checkpoint-interval", "0", "--batch-invariant"]  # whoever shares a pass
    assert run_local([*flags, "--output-path", str(tmp_path / "clean.jsonl")], 1).returncode == 0
    out, runs = tmp_path / "cut.jsonl", 0
    while not out.exists():
        code = stopped_run([*flags, "--output-path", str(out)], 1, tmp_path / "cut.jsonl.partial", 2)
        runs += 1
        assert runs < 20
        rows = tmp_path / "cut.jsonl.partial.rows"
        if not out.exists():
            assert code == 143
            if rows.exists():  # only the completions, lines 6-9
                assert all(int(k) >= 6 for k in json.loads(rows.read_text()) if k.isdigit()), rows.read_text()
    assert runs > 1
    clean, cut = read_jsonl(tmp_path / "clean.jsonl"), read_jsonl(out)
    for a, b in zip(clean[:6], cut[:6], strict=True):  # thinking rows: run whole again, bit for bit
        assert a["response"]["body"]["choices"] == b["response"]["body"]["choices"]
    assert_consistent_results(clean[6:], cut[6:], tol=1e-3)
