"""File mode's guarantees, in one process (``--in-process``): every line answered in place (bad lines get
an error and the valid ones a clean file's answers), --truncate-prompts and --strict, a complete output
skipped and another run's refused, input streamed (memory bounded whatever the file's length), the
live status file. What only processes show (kill -9 and resume, signals, a dying peer):
tests/integration/test_reliability.py."""

import json
import threading
import time
import tracemalloc
from pathlib import Path

import pytest

from tasks.status import describe, is_stale, read_status
from tests.utils import DATA, assert_identical_results, read_jsonl, run_inprocess, run_local, write_jsonl


@pytest.fixture(scope="module")
def model_dir(make_llama):
    return make_llama(num_hidden_layers=3, max_position_embeddings=256)


def test_bad_lines_each_get_an_error_in_place(model_dir, tmp_path):
    src = tmp_path / "bad.jsonl"
    src.write_bytes((DATA / "bad_lines.jsonl").read_bytes())
    raw_lines = [l for l in src.read_text().split("\n") if l.strip()]
    p = run_local(["--model-name", model_dir, "--infer-data", str(src), "--budget", "4096", "--batch-invariant"])
    assert p.returncode == 0, p.stderr[-3000:]
    out = read_jsonl(tmp_path / "output_bad.jsonl")
    assert len(out) == len(raw_lines)
    errors = {i: x["error"] for i, x in enumerate(out) if "error" in x}
    expect = {1: None, 2: None, 3: None, 4: "prompt", 5: "prompt", 6: "max_tokens", 7: "max_tokens",
              8: "temperature", 9: "top_p", 10: "n", 11: "best_of", 12: "stop", 13: "logprobs", 16: "prompt",
              17: "prompt", 20: "logit_bias", 21: "logit_bias", 22: "logit_bias", 23: "prompt", 24: "seed"}
    assert {i: e["param"] for i, e in errors.items()} == expect
    assert out[1]["request"] == raw_lines[1] and out[2]["request"] == "not json at all"
    # the runner's own words, whatever the JSON parser's release says
    assert errors[1]["message"] == "the line is not valid JSON: unexpected ':' at column 45"
    assert errors[2]["message"] == "the line is not valid JSON: unexpected 'n' at column 1"
    assert "140002 tokens" in errors[16]["message"] and "2048" not in errors[16]["message"]
    assert "256 tokens" in errors[16]["message"]
    assert all(e["type"] == "invalid_request_error" and e["message"] for e in errors.values())
    # the valid lines give the same results as a clean file (bad lines replaced by valid ones, so that
    # positions, which seed the sampling of requests without a seed, stay the same)
    valid = [i for i in range(len(raw_lines)) if i not in errors]
    clean = tmp_path / "clean.jsonl"
    clean.write_text("".join((raw_lines[i] if i in valid else '{"prompt": "placeholder", "max_tokens": 1}') + "\n"
                             for i in range(len(raw_lines))))
    p = run_local(["--model-name", model_dir, "--infer-data", str(clean), "--budget", "4096", "--batch-invariant"])
    assert p.returncode == 0, p.stderr[-3000:]
    ref = read_jsonl(tmp_path / "output_clean.jsonl")
    assert_identical_results([out[i] for i in valid], [ref[i] for i in valid])
    summary = json.loads((tmp_path / "output_bad.jsonl.summary.json").read_text())
    assert summary["requests"] == 25 and summary["errors"] == 20 and summary["answered"] == 5


def test_truncate_prompts_and_strict(model_dir, tmp_path):
    src = tmp_path / "long.jsonl"
    src.write_text(json.dumps({"prompt": "far too long " * 200, "max_tokens": 4}) + "\n"
                   + json.dumps({"prompt": "fine", "max_tokens": 1}) + "\n")
    p = run_local(["--model-name", model_dir, "--infer-data", str(src), "--strict"])
    assert p.returncode == 1 and "1 errors" in p.stderr
    p = run_local(["--model-name", model_dir, "--infer-data", str(src), "--truncate-prompts", "--overwrite"])
    assert p.returncode == 0, p.stderr[-2000:]
    first = read_jsonl(tmp_path / "output_long.jsonl")[0]["result"]
    assert first["usage"]["prompt_tokens"] == 252 and "left-truncated" in first["warnings"][0]


def test_complete_output_is_skipped_and_foreign_journal_refused(model_dir, make_llama, tmp_path):
    src = tmp_path / "r.jsonl"
    src.write_text('{"prompt": "x", "max_tokens": 1}\n')
    out = tmp_path / "output_r.jsonl"
    p = run_local(["--model-name", model_dir, "--infer-data", str(src)])
    assert p.returncode == 0, p.stderr[-3000:]
    done = out.read_bytes()
    # the same model and settings: skipped before anything loads
    p = run_local(["--model-name", model_dir, "--infer-data", str(src)])
    assert p.returncode == 0 and "skipped, output already complete" in p.stderr and out.read_bytes() == done
    assert "stage 0/1" not in p.stderr
    # another model or other settings: refused with the difference and the way out, exit 2, nothing loads
    other = make_llama(num_hidden_layers=2)
    for flags, difference in ((["--model-name", other], f"model: '{model_dir}' there, '{other}' now"),
                              (["--model-name", model_dir, "--seed", "7"], "seed: 42 there, 7 now")):
        p = run_local([*flags, "--infer-data", str(src)])
        assert p.returncode == 2, p.stderr[-3000:]
        assert f"error: {out} is complete but was written by another run ({difference})" in p.stderr
        assert "--overwrite" in p.stderr and "--output-path" in p.stderr and "stage 0/1" not in p.stderr
        assert "Traceback" not in p.stderr and out.read_bytes() == done
    # an output nobody recorded (by hand, or an older version): refused too
    out.write_text("already done\n")
    (tmp_path / "output_r.jsonl.summary.json").unlink()
    p = run_local(["--model-name", model_dir, "--infer-data", str(src)])
    assert p.returncode == 2 and "does not record which model and settings wrote it" in p.stderr
    p = run_local(["--model-name", model_dir, "--infer-data", str(src), "--overwrite"])
    assert p.returncode == 0 and len(read_jsonl(out)) == 1
    out.unlink()
    (tmp_path / "output_r.jsonl.partial").write_text("")
    (tmp_path / "output_r.jsonl.partial.json").write_text(json.dumps({"model": "/some/other/model"}))
    p = run_local(["--model-name", model_dir, "--infer-data", str(src)])
    assert p.returncode == 2 and "different settings" in p.stderr and "--overwrite" in p.stderr
    assert "model: '/some/other/model' there" in p.stderr and "Traceback" not in p.stderr


def test_large_file_driver_memory_is_bounded(model_dir, tmp_path):
    """Input is streamed: the Python objects a run holds at its peak (every thread's, tracemalloc) do not
    grow with the file (200 -> 1400 lines of 4 KB each: 1200 more lines would hold 1200 x (4 KB input +
    4 KB output line) = 9.6 MB if anything accumulated; measured ~0.1 MB either way)."""
    def run(n: int, traced: bool) -> int:
        src = tmp_path / f"big{n}.jsonl"
        with open(src, "w") as f:
            for i in range(n):
                f.write(json.dumps({"prompt": [5 + i % 50, 6, 7], "max_tokens": 1, "temperature": 0,
                                    "metadata": {"padding": "x" * 4000}}) + "\n")
        tracemalloc.start() if traced else None
        try:
            p = run_local(["--model-name", model_dir, "--infer-data", str(src), "--budget", "4096",
                           "--max-micro-batch-size", "64", "--no-progress", "--overwrite"])
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert p.returncode == 0, p.stderr[-2000:]
        assert sum(1 for _ in open(tmp_path / f"output_big{n}.jsonl")) == n
        return peak

    run(200, traced=False)  # what a first run allocates once (imports, caches) is not the file's
    small, big = run(200, traced=True), run(1400, traced=True)
    assert big - small < 3 * 2**20, (small, big)


def test_status_file_advances_adds_up_and_finishes(llama_2l, tmp_path, monkeypatch):
    """The live status file (--status-file) of a two-stage run, read while it runs: it advances, its
    counts add up, both stages' figures reach it, it ends ``finished``. Each stage's pass takes 5 ms
    more than it computes, so that the run lasts a few of the status file's 1 s heartbeats on any
    machine. (After a rank is killed it ends ``failed`` or goes stale: tests/integration/test_reliability.py.)"""
    from pipeline.runtime.stage import Stage

    step = Stage.step
    monkeypatch.setattr(Stage, "step", lambda self, *a, **k: (time.sleep(0.005), step(self, *a, **k))[1])
    n = 24
    data = write_jsonl(tmp_path / "req.jsonl", [{"prompt": f"Request {i}: the pipeline keeps every stage busy while",
                                                 "max_tokens": 24, "temperature": 0.0} for i in range(n)])
    status = tmp_path / "run.status.json"
    args = ["--model-name", llama_2l, "--infer-data", data, "--status-file", str(status), "--status-interval", "1",
            "--max-micro-batch-size", "2", "--budget", "4096", "--no-progress", "--timeout", "60"]
    done = threading.Event()
    result = []
    runner = threading.Thread(target=lambda: (result.append(run_inprocess(args, stages=2)), done.set()))
    runner.start()
    seen = []
    while not done.is_set():
        s = read_status(status)
        if s is not None and (not seen or s["updated_at"] != seen[-1]["updated_at"]):
            seen.append(s)
        time.sleep(0.05)
    runner.join()
    assert result == [0]
    seen.append(read_status(status))
    print("\n".join(describe(s, s["updated_at"]) for s in seen))
    final = seen[-1]
    assert final["state"] == "finished", final
    assert final["lines_total"] == final["lines_done"] == n
    lines_done = [s["lines_done"] for s in seen]
    assert lines_done == sorted(lines_done), lines_done  # never goes back
    assert any(0 < d < n for d in lines_done) or len({s["updated_at"] for s in seen}) >= 3, lines_done  # it advanced
    assert seen[0]["state"] in ("loading", "running")
    assert not is_stale(final)
    out = read_jsonl(tmp_path / "output_req.jsonl")
    assert final["generated_tokens"] == sum(o["result"]["usage"]["completion_tokens"] for o in out)
    assert final["prompt_tokens"] == sum(o["result"]["usage"]["prompt_tokens"] for o in out)
    assert final["errors"] == 0 and final["files"][0]["state"] == "finished"
    assert final["run"]["model"] == str(Path(llama_2l).resolve())
    assert final["run"]["flags"]["status_interval"] == 1
    staged = [s for s in seen if s["stages"]]
    assert staged and all(len(s["stages"]) == 2 for s in staged)  # both stages' figures reached the writer
    assert all(0 <= st["busy_fraction"] <= 1 and st["peak_memory_mb"] > 0 for s in staged for st in s["stages"])
    assert final["eta_seconds"] == 0.0 and final["heartbeat_seconds"] == 1.0
