"""Reliability: every line answered, kill-and-resume, failing ranks, signals, existing outputs."""

import json
import signal
import subprocess
import sys
import time

import pytest

from tests.utils import (DATA, RUNNER, _env, _kill_group, assert_identical_results, free_port, read_jsonl, run_single,
                         run_torchrun)


@pytest.fixture(scope="module")
def model_dir(make_llama):
    return make_llama(num_hidden_layers=3, max_position_embeddings=256)


@pytest.fixture(scope="module")
def work_file(tmp_path_factory):
    """Enough requests that a run spans many passes."""
    path = tmp_path_factory.mktemp("work") / "work.jsonl"
    lines = [{"prompt": f"Request number {i}: the garden is", "max_tokens": 6 + i % 5, "temperature": 0.7,
              "logprobs": 1} for i in range(40)]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


@pytest.fixture(scope="module")
def clean_output(model_dir, work_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("clean") / "clean.jsonl"
    p = run_torchrun(["--model-name", model_dir, "--infer-data", str(work_file), "--output-path", str(out),
                      "--budget", "400", "--batch-invariant"], 2)
    assert p.returncode == 0, p.stderr[-3000:]
    return read_jsonl(out)


def test_bad_lines_each_get_an_error_in_place(model_dir, tmp_path):
    src = tmp_path / "bad.jsonl"
    src.write_bytes((DATA / "bad_lines.jsonl").read_bytes())
    raw_lines = [l for l in src.read_text().split("\n") if l.strip()]
    p = run_single(["--model-name", model_dir, "--infer-data", str(src), "--budget", "4096", "--batch-invariant"])
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
    p = run_single(["--model-name", model_dir, "--infer-data", str(clean), "--budget", "4096", "--batch-invariant"])
    assert p.returncode == 0, p.stderr[-3000:]
    ref = read_jsonl(tmp_path / "output_clean.jsonl")
    assert_identical_results([out[i] for i in valid], [ref[i] for i in valid])
    summary = json.loads((tmp_path / "output_bad.jsonl.summary.json").read_text())
    assert summary["requests"] == 25 and summary["errors"] == 20 and summary["answered"] == 5


def test_truncate_prompts_and_strict(model_dir, tmp_path):
    src = tmp_path / "long.jsonl"
    src.write_text(json.dumps({"prompt": "far too long " * 200, "max_tokens": 4}) + "\n"
                   + json.dumps({"prompt": "fine", "max_tokens": 1}) + "\n")
    p = run_single(["--model-name", model_dir, "--infer-data", str(src), "--strict"])
    assert p.returncode == 1 and "1 errors" in p.stderr
    p = run_single(["--model-name", model_dir, "--infer-data", str(src), "--truncate-prompts", "--overwrite"])
    assert p.returncode == 0, p.stderr[-2000:]
    first = read_jsonl(tmp_path / "output_long.jsonl")[0]["result"]
    assert first["usage"]["prompt_tokens"] == 252 and "left-truncated" in first["warnings"][0]


@pytest.mark.parametrize("stages, point, rank", [
    (1, "load", 0), (1, "prefill", 0), (1, "midgen", 0), (1, "finalize", 0),  # the whole job killed
    (2, "midgen", 1), (2, "drive", 0),  # one rank of two killed; the other stops by itself
])
def test_kill_and_resume_equals_clean_run(model_dir, work_file, clean_output, tmp_path, stages, point, rank):
    out = tmp_path / "out.jsonl"
    args = ["--model-name", model_dir, "--infer-data", str(work_file), "--output-path", str(out), "--budget", "400",
            "--batch-invariant"]  # a resumed run's micro-batches differ from the clean run's
    fault = {"DIST_INFER_FAULT": point, "DIST_INFER_FAULT_RANK": str(rank)}
    run = (lambda a, env=None: run_single(a, env=env)) if stages == 1 else (lambda a, env=None: run_torchrun(a, 2, env=env))
    p = run(args, env=fault)
    assert p.returncode != 0
    assert not out.exists(), "the output must appear only complete"
    if point in ("midgen", "finalize"):
        assert (tmp_path / "out.jsonl.partial").exists()
    p = run(args)
    assert p.returncode == 0, p.stderr[-3000:]
    if point == "midgen":
        assert "resuming after" in p.stderr
    assert_identical_results(read_jsonl(out), clean_output)
    assert not (tmp_path / "out.jsonl.partial").exists()


def _legacy(args, nproc, env=None):
    url = f"tcp://127.0.0.1:{free_port()}"
    return [subprocess.Popen([sys.executable, str(RUNNER), *args, "--rank", str(i), "--world-size", str(nproc),
                              "--dist-url", url, "--num-threads", "1"], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=_env(env), start_new_session=True)
            for i in range(nproc)]


def test_killing_a_middle_rank_stops_every_rank_quickly(model_dir, work_file, tmp_path):
    out = tmp_path / "out.jsonl"
    procs = _legacy(["--model-name", model_dir, "--infer-data", str(work_file), "--output-path", str(out)], 3,
                    env={"DIST_INFER_FAULT": "load", "DIST_INFER_FAULT_RANK": "1"})
    try:
        t0 = time.monotonic()
        results = [p.communicate(timeout=60) for p in procs]
        assert time.monotonic() - t0 < 60
    finally:
        for p in procs:
            _kill_group(p)
    codes = [p.returncode for p in procs]
    assert codes[1] == -signal.SIGKILL and codes[0] != 0 and codes[2] != 0
    # rank 1 died loading: the others hear of it in the barrier where every stage has loaded before
    # --budget auto measures the memory left (pipeline.config.budget), or on a link
    said = results[0][1] + results[2][1]
    assert "lost contact with rank 1" in said or "lost contact with another rank while the stages agreed" in said


def test_sigterm_stops_cleanly_and_resume_completes(model_dir, work_file, clean_output, tmp_path):
    out = tmp_path / "out.jsonl"
    args = ["--model-name", model_dir, "--infer-data", str(work_file), "--output-path", str(out), "--budget", "400",
            "--batch-invariant"]  # a resumed run's micro-batches differ from the clean run's
    procs = _legacy(args, 2)
    try:
        journal = tmp_path / "out.jsonl.partial"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not (journal.exists() and journal.stat().st_size > 0):
            time.sleep(0.05)
        for p in procs:
            p.send_signal(signal.SIGTERM)
        results = [p.communicate(timeout=30) for p in procs]
    finally:
        for p in procs:
            _kill_group(p)
    assert all(p.returncode == 128 + signal.SIGTERM for p in procs), [r[1][-500:] for r in results]
    assert "SIGTERM received" in results[0][1]
    p = run_torchrun(args, 2)
    assert p.returncode == 0, p.stderr[-3000:]
    assert_identical_results(read_jsonl(out), clean_output)


def test_complete_output_is_skipped_and_foreign_journal_refused(model_dir, make_llama, tmp_path):
    src = tmp_path / "r.jsonl"
    src.write_text('{"prompt": "x", "max_tokens": 1}\n')
    out = tmp_path / "output_r.jsonl"
    p = run_single(["--model-name", model_dir, "--infer-data", str(src)])
    assert p.returncode == 0, p.stderr[-3000:]
    done = out.read_bytes()
    # the same model and settings: skipped before anything loads
    p = run_single(["--model-name", model_dir, "--infer-data", str(src)])
    assert p.returncode == 0 and "skipped, output already complete" in p.stderr and out.read_bytes() == done
    assert "stage 0/1" not in p.stderr
    # another model or other settings: refused with the difference and the way out, exit 2, nothing loads
    other = make_llama(num_hidden_layers=2)
    for flags, difference in ((["--model-name", other], f"model: '{model_dir}' there, '{other}' now"),
                              (["--model-name", model_dir, "--seed", "7"], "seed: 42 there, 7 now")):
        p = run_single([*flags, "--infer-data", str(src)])
        assert p.returncode == 2, p.stderr[-3000:]
        assert f"error: {out} is complete but was written by another run ({difference})" in p.stderr
        assert "--overwrite" in p.stderr and "--output-path" in p.stderr and "stage 0/1" not in p.stderr
        assert "Traceback" not in p.stderr and out.read_bytes() == done
    # an output nobody recorded (by hand, or an older version): refused too
    out.write_text("already done\n")
    (tmp_path / "output_r.jsonl.summary.json").unlink()
    p = run_single(["--model-name", model_dir, "--infer-data", str(src)])
    assert p.returncode == 2 and "does not record which model and settings wrote it" in p.stderr
    p = run_single(["--model-name", model_dir, "--infer-data", str(src), "--overwrite"])
    assert p.returncode == 0 and len(read_jsonl(out)) == 1
    out.unlink()
    (tmp_path / "output_r.jsonl.partial").write_text("")
    (tmp_path / "output_r.jsonl.partial.json").write_text(json.dumps({"model": "/some/other/model"}))
    p = run_single(["--model-name", model_dir, "--infer-data", str(src)])
    assert p.returncode == 2 and "different settings" in p.stderr and "--overwrite" in p.stderr
    assert "model: '/some/other/model' there" in p.stderr and "Traceback" not in p.stderr


def test_a_refused_output_under_torchrun_is_reported_once(model_dir, tmp_path):
    """What a user sees for a flag problem under torchrun: the message once (rank 0), before the ranks
    meet (torchrun's own failure report may quote it again, in its own format); the shell sees
    torchrun's 1."""
    src = tmp_path / "r.jsonl"
    src.write_text('{"prompt": "x", "max_tokens": 1}\n')
    p = run_single(["--model-name", model_dir, "--infer-data", str(src)])
    assert p.returncode == 0, p.stderr[-3000:]
    p = run_torchrun(["--model-name", model_dir, "--infer-data", str(src), "--seed", "7"], 2)
    message = "error: " + str(tmp_path / "output_r.jsonl") + " is complete but was written by another run"
    assert p.returncode == 1, p.stderr[-3000:]
    assert [line.startswith("dist_inference_runner.py: " + message) for line in p.stderr.splitlines()].count(True) == 1
    assert "process group up" not in p.stderr
    p = run_torchrun(["--model-name", model_dir, "--infer-data", str(src), "--budget", "0"], 2)
    own = [line for line in p.stderr.splitlines() if line.startswith("dist_inference_runner.py: ")]
    assert p.returncode == 1 and len(own) == 1 and "--budget must be a positive number" in own[0], p.stderr[-3000:]


def test_large_file_driver_memory_is_bounded(model_dir, tmp_path):
    """Input is streamed: peak memory barely grows from 1k to 9k requests (not proportional)."""
    peaks = []
    for n in (1000, 9000):
        src = tmp_path / f"big{n}.jsonl"
        with open(src, "w") as f:
            for i in range(n):
                f.write(json.dumps({"prompt": [5 + i % 50, 6, 7], "max_tokens": 1, "temperature": 0,
                                    "metadata": {"padding": "x" * 4000}}) + "\n")
        p = run_single(["--model-name", model_dir, "--infer-data", str(src), "--budget", "4096",
                        "--max-micro-batch-size", "64", "--no-progress"], timeout=600)
        assert p.returncode == 0, p.stderr[-2000:]
        assert sum(1 for _ in open(tmp_path / f"output_big{n}.jsonl")) == n
        peaks.append(json.loads((tmp_path / f"output_big{n}.jsonl.summary.json").read_text())["last_rank_peak_rss_mb"])
    # 8k more requests would hold 8k x (4 KB input + 4 KB output line) = 64 MB if anything accumulated
    assert peaks[1] - peaks[0] < 40, peaks


# -- file mode's smaller guarantees, without processes ---------------------------------------------

def test_two_inputs_of_one_name_under_one_output_folder_are_refused(llama_2l, tmp_path):
    """`--output-path DIR` names each output after its input's file name: two inputs of one name would
    overwrite (or resume) one another, so the plan refuses before anything loads."""
    from pipeline.config.options import UsageError, parse_options
    from pipeline.config.plan import make_plan

    for sub in ("a", "b"):
        (tmp_path / sub).mkdir()
        (tmp_path / sub / "q.jsonl").write_text('{"prompt": "x"}\n')
    env = {"RANK": "0", "WORLD_SIZE": "1"}
    with pytest.raises(UsageError, match=r"a/q.jsonl and .*b/q.jsonl would both write"):
        make_plan(parse_options(["--model-name", llama_2l, "--infer-data", str(tmp_path / "a" / "q.jsonl"),
                                 str(tmp_path / "b" / "q.jsonl"), "--output-path", str(tmp_path / "out")]), env=env)
    with pytest.raises(UsageError, match="would both write"):  # one file given twice
        make_plan(parse_options(["--model-name", llama_2l, "--infer-data", str(tmp_path / "a" / "q.jsonl"),
                                 str(tmp_path / "a" / "q.jsonl")]), env=env)
    # beside each input (no --output-path) they do not collide
    make_plan(parse_options(["--model-name", llama_2l, "--infer-data", str(tmp_path / "a" / "q.jsonl"),
                             str(tmp_path / "b" / "q.jsonl")]), env=env)


def test_fingerprint_covers_the_whole_input(tmp_path):
    """An edit after the first MiB (same size) is another input: its journal is not resumed."""
    from tasks.files import input_fingerprint

    path = tmp_path / "big.jsonl"
    data = bytearray(b"x" * (3 << 20))
    path.write_bytes(data)
    before = input_fingerprint(path)
    data[(2 << 20) + 5] = ord("y")
    path.write_bytes(data)
    assert input_fingerprint(path) != before and input_fingerprint(path) == input_fingerprint(path)


def test_atomic_writes_are_synced_before_the_rename(tmp_path, monkeypatch):
    """write_atomic syncs the new file before it replaces the old one, then the folder (a power loss
    leaves the old or the new content, never an empty file); the journal's fingerprint is written so too."""
    import os

    from tasks import files

    calls = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (calls.append("fsync"), real_fsync(fd))[1])
    monkeypatch.setattr(os, "replace", lambda a, b: (calls.append("replace"), real_replace(a, b))[1])
    files.write_atomic(tmp_path / "f.json", "{}", mode=0o600)
    assert calls == ["fsync", "replace", "fsync"]
    assert (tmp_path / "f.json").stat().st_mode & 0o777 == 0o600


def test_journal_is_synced_while_it_runs(tmp_path, monkeypatch):
    """Lines reach the disk within JOURNAL_SYNC_S of being written, not only when the file closes."""
    import os

    from tasks import writer as w

    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd))[1])
    monkeypatch.setattr(w, "JOURNAL_SYNC_S", 0.0)
    ow = w.OrderedWriter(tmp_path / "out.jsonl", {"a": 1})
    assert ow.open() == 0
    synced.clear()
    ow.put(0, {"i": 0})
    assert ow.flush() == 1 and synced, "the journal was not fsynced after a write"
    assert ow.close(1)


def test_a_full_disk_keeps_the_journal_a_prefix_and_loses_nothing(tmp_path, monkeypatch):
    """ENOSPC while journaling: the torn write is cut back, the lines wait and go out once space is
    back; if the disk stays full beyond DISK_FULL_HOLD_BYTES the file gives up (close says incomplete),
    and the journal still holds every line written before. Never an exception out of the writer."""
    import errno

    from tasks import writer as w

    ow = w.OrderedWriter(tmp_path / "out.jsonl", {"a": 1})
    ow.open()
    ow.put(0, {"i": 0})
    ow.flush()
    real = ow._file

    class Full:
        def __init__(self, room):
            self.room = room

        def write(self, data):  # writes what fits, then fails like a full disk
            n = min(self.room, len(data))
            self.room -= n
            if n == 0:
                raise OSError(errno.ENOSPC, "No space left on device")
            return real.write(bytes(data[:n]))

        def fileno(self):
            return real.fileno()

        def close(self):
            real.close()

    ow._file = Full(room=5)
    ow.put(1, {"i": 1})
    ow.put(2, {"i": 2})
    assert ow.flush() == 0 and ow.write_error == "the disk is full"
    assert (tmp_path / "out.jsonl.partial").read_bytes() == b'{"i":0}\n'  # no torn line
    ow._file = real  # space is back
    assert ow.flush() == 2 and ow.write_error is None
    ow._file = Full(room=0)
    monkeypatch.setattr(w, "DISK_FULL_HOLD_BYTES", 10)
    ow.put(3, {"i": 3, "pad": "x" * 20})
    assert ow.flush() == 0 and ow.gave_up
    assert not ow.close(4)
    assert (tmp_path / "out.jsonl.partial").read_text().splitlines() == ['{"i":0}', '{"i":1}', '{"i":2}']


def test_outputs_and_journals_of_the_earlier_fingerprint_are_still_this_input(tmp_path):
    """Recorded by a version that hashed size + first MiB: while that still matches the file the old id
    is kept (a job started before an upgrade resumes or is skipped after it); a changed file is not."""
    from tasks.files import input_fingerprint, legacy_input_fingerprint
    from tasks.writer import input_id

    src = tmp_path / "a.jsonl"
    src.write_text('{"prompt": "x"}\n')
    out = tmp_path / "output_a.jsonl"
    assert input_id(src, out) == input_fingerprint(src)
    old = legacy_input_fingerprint(src)
    (tmp_path / "output_a.jsonl.partial.json").write_text(json.dumps({"input": old, "seed": 1}))
    assert input_id(src, out) == old
    (tmp_path / "output_a.jsonl.partial.json").unlink()
    (tmp_path / "output_a.jsonl.summary.json").write_text(json.dumps({"run": {"input": old}}))
    assert input_id(src, out) == old
    src.write_text('{"prompt": "y"}\n')
    assert input_id(src, out) == input_fingerprint(src)
