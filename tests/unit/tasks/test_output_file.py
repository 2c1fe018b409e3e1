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
