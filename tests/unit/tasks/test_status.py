"""tasks.status without processes: the figures, rates, ETA, staleness, the final states, the reader's exit codes."""

from __future__ import annotations

import time

import pytest

from tasks import status as st
from tasks.status import RunStatus, describe, is_stale, read_status


def make(tmp_path, interval: float = 0.2) -> RunStatus:
    return RunStatus(tmp_path / "s.json", {"model": "m"}, [("in.jsonl", "out.jsonl", 10)], interval, 2)


def test_counts_rates_and_finish(tmp_path):
    s = make(tmp_path)
    s.start()
    try:
        assert read_status(s.path)["state"] == "loading"
        s.open_file("in.jsonl", "out.jsonl", 10, 2)  # two lines from an earlier run
        s.progress(4, 1, 100, 40, 30, [[0.5, 128, 10.0], [0.25, 64, 12.0]])
        time.sleep(0.05)
        s.progress(6, 1, 150, 40, 50)
        snap = s.snapshot()
        assert snap["state"] == "running" and snap["lines_done"] == 6 and snap["lines_total"] == 10
        assert snap["errors"] == 1 and snap["prompt_tokens"] == 150 and snap["generated_tokens"] == 50
        assert snap["prefix_hit_rate"] == round(40 / 150, 4)
        assert snap["generated_tokens_per_second_last_minute"] > 0 and snap["eta_seconds"] > 0
        assert [x["kv_cells"] for x in snap["stages"]] == [128, 64] and snap["kv_cells_in_use"] == 192
        assert all(0 <= x["busy_fraction"] <= 1 for x in snap["stages"])
        time.sleep(0.5)  # the heartbeat rewrote the file
        assert read_status(s.path)["updated_at"] > snap["updated_at"] - 0.01
        s.progress(10, 1, 200, 40, 70)
        s.close_file(True)
        s.finish("finished")
    finally:
        s.finish("finished")
    final = read_status(s.path)
    assert final["state"] == "finished" and final["files"][0]["state"] == "finished"
    assert final["eta_seconds"] == 0.0 and final["generated_tokens"] == 70 and not is_stale(final)


def test_failed_keeps_the_first_reason_and_stale_detection(tmp_path):
    s = make(tmp_path)
    s.start()
    st.activate(s)
    st.fail_active("PeerLost: rank 0")
    s.finish("finished")  # a later clean-up does not hide the failure
    st.activate(None)
    got = read_status(s.path)
    assert got["state"] == "failed: PeerLost: rank 0" and not is_stale(got)
    running = dict(got, state="running")
    assert is_stale(running, now=got["updated_at"] + 4 * got["heartbeat_seconds"])
    assert not is_stale(running, now=got["updated_at"] + 1 * got["heartbeat_seconds"])
    assert describe(running, now=got["updated_at"] + 100).startswith("stale (running")


def test_a_stopped_run_has_no_eta(tmp_path):
    s = make(tmp_path)
    s.start()
    s.open_file("in.jsonl", "out.jsonl", 10, 0)
    s.progress(4, 0, 100, 0, 30)
    s.finish("stopped")
    got = read_status(s.path)
    assert got["state"] == "stopped" and got["eta_seconds"] is None and "ETA" not in describe(got)


def test_a_finished_status_is_not_failed_by_a_later_run_of_the_process(tmp_path):
    """Runs in one process (--in-process, the Python API): a run that fails marks its own running status
    files failed, not an earlier run's finished one (it used to rewrite it as failed)."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "c").mkdir()
    done, one, two = make(tmp_path / "a"), make(tmp_path / "b"), make(tmp_path / "c")
    for s in (done, one, two):
        s.start()
        st.activate(s)
    done.finish("finished")
    st.fail_active("PeerLost: rank 1")  # both writers of a two-pipeline run in this process
    assert read_status(done.path)["state"] == "finished"
    assert read_status(one.path)["state"] == read_status(two.path)["state"] == "failed: PeerLost: rank 1"
    assert st._ACTIVE == []


@pytest.mark.parametrize("state, code", [("finished", 0), ("failed: x", 1), ("running", 3)])
def test_reader_exit_codes(tmp_path, capsys, state, code):
    s = make(tmp_path)
    s.state = state
    s.write()
    assert st.main([str(s.path)]) == code
    assert capsys.readouterr().out.startswith(state)
    assert st.main([str(tmp_path / "missing.json")]) == 3
    (tmp_path / "out.jsonl").write_text('{"request": {}, "result": {}}\n{"request": {}, "result": {}}\n')
    (tmp_path / "one.jsonl").write_text('{"request": {}, "result": {}}\n')
    for wrong in ("out.jsonl", "one.jsonl", "."):  # an output file or a folder by mistake: not "running" forever
        assert st.main([str(tmp_path / wrong)]) == 2 and "not a status file" in capsys.readouterr().err


def test_skipped_files_count_as_done(tmp_path):
    s = RunStatus(tmp_path / "s.json", {}, [("a", "oa", 5), ("b", "ob", 7)], 1.0)
    s.skip_file("oa")
    snap = s.snapshot()
    assert snap["lines_done"] == 5 and snap["lines_total"] == 12 and snap["files"][0]["state"] == "skipped"
