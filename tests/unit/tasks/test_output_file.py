"""tasks.output_file: the summary's time to first result (process start -> file open -> first line)."""

import json

from tasks.output_file import FileStats, OutputFile, process_age_seconds


def test_time_to_first_result_is_split_into_startup_and_first_line(tmp_path):
    age = process_age_seconds()
    assert age is not None and age > 0  # Linux: read from /proc
    out = OutputFile(str(tmp_path / "out.jsonl"), {"model": "m"})
    assert out.open(2, overwrite=True, show_progress=False) == 0
    out.put(1, {"id": "b"})  # out of order: the first line put counts, whatever its index
    out.put(0, {"id": "a"})
    out.flush(0)
    complete, summary = out.close(2, FileStats(2, {}, 0.0, 0.0), [0.0], 0, 0.0, 1)
    assert complete
    assert age - 0.001 <= summary.startup_seconds <= process_age_seconds() + 0.001  # (rounded to ms)
    assert 0 <= summary.first_result_seconds <= summary.wall_seconds
    record = json.loads((tmp_path / "out.jsonl.summary.json").read_text())
    assert record["startup_seconds"] == summary.startup_seconds
    assert record["first_result_seconds"] == summary.first_result_seconds


def test_a_file_with_no_result_has_no_first_result_time(tmp_path):
    out = OutputFile(str(tmp_path / "empty.jsonl"), {"model": "m"})
    out.open(0, overwrite=True, show_progress=False)
    _, summary = out.close(0, FileStats(0, {}, 0.0, 0.0), [0.0], 0, 0.0, 1)
    assert summary.first_result_seconds is None and summary.startup_seconds >= 0


def test_a_checkpoint_keeps_the_lines_answered_out_of_order(tmp_path):
    """Lines answered while an earlier one is still computing wait out of the journal (it is written in
    input order); a checkpoint keeps them, with the rows in flight, and the next run puts them back into
    the writer instead of computing them again. The journal's own lines and another share's are left out."""
    out = OutputFile(str(tmp_path / "out.jsonl"), {"model": "m"})
    assert out.open(5, overwrite=True, show_progress=False) == 0
    out.put(0, {"id": "a"})
    out.put(2, {"id": "c"})
    out.put(4, {"id": "e"})
    out.flush(0)  # 0 is journaled; 2 and 4 wait for 1 and 3
    out.checkpoint({1: {"ids": [5, 6], "logprobs": [-1.0, -2.0], "top": None}})
    out.writer._file.close()  # the run stops here

    again = OutputFile(str(tmp_path / "out.jsonl"), {"model": "m"})
    assert again.open(5, overwrite=False, show_progress=False) == 1
    assert again.resumed_rows() == {1: {"ids": [5, 6], "logprobs": [-1.0, -2.0], "top": None}}
    assert again.restore_answered() == [2, 4] and again.resumed_lines == 3
    again.put(1, {"id": "b"})
    again.put(3, {"id": "d"})
    again.flush(0)
    complete, _ = again.close(5, FileStats(2, {}, 0.0, 0.0), [0.0], 0, 0.0, 1)
    assert complete
    assert [json.loads(x)["id"] for x in (tmp_path / "out.jsonl").read_text().splitlines()] == list("abcde")
