"""The ordered, resumable writer (tasks/writer.py) in one process: lines in input order whatever order
they arrive in, a journal that is always a prefix of the output, resume after a kill (a torn line cut),
refusal of another run's journal, shares merged in input order, and a full disk that loses nothing."""

from __future__ import annotations

import errno
import json

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tasks import writer as w

FP = {"model": "m", "input": "abc", "seed": 1}


def line(i: int) -> dict:
    return {"request": {"prompt": f"p{i}"}, "result": {"i": i}}


def lines_of(path) -> list[int]:
    return [orjson.loads(x)["result"]["i"] for x in path.read_bytes().splitlines()]


@settings(max_examples=40, deadline=None)
@given(order=st.integers(1, 40).flatmap(lambda n: st.permutations(list(range(n)))),
       cut=st.floats(0, 1))
def test_any_arrival_order_writes_input_order_and_resumes(tmp_path_factory, order, cut):
    out = tmp_path_factory.mktemp("w") / "out.jsonl"
    n = len(order)
    first = order[: int(cut * n)]
    wr = w.OrderedWriter(out, FP)
    assert wr.open() == 0
    for i in first:  # a run that is killed after these arrived
        wr.put(i, line(i))
        wr.flush()
        assert lines_of(wr.journal) == list(range(wr.written))  # always a prefix, in order
    wr._file.close()
    done = wr.written
    resumed = w.OrderedWriter(out, FP)
    assert resumed.open() == done  # the rerun starts after the journal's lines
    for i in order:
        if i >= done:
            resumed.put(i, line(i))
    assert resumed.close(n)
    resumed.publish()
    assert lines_of(out) == list(range(n)) and not resumed.journal.exists()


def test_a_torn_last_line_is_cut_on_resume(tmp_path):
    out = tmp_path / "out.jsonl"
    wr = w.OrderedWriter(out, FP)
    wr.open()
    for i in range(3):
        wr.put(i, line(i))
    wr.flush()
    wr._file.write(b'{"request": {"pro')  # killed mid-write
    wr._file.close()
    again = w.OrderedWriter(out, FP)
    assert again.open() == 3
    assert lines_of(again.journal) == [0, 1, 2]


def test_another_runs_journal_or_output_is_refused_with_the_difference(tmp_path):
    out = tmp_path / "out.jsonl"
    wr = w.OrderedWriter(out, FP)
    wr.open()
    wr.put(0, line(0))
    wr.flush()
    wr._file.close()
    with pytest.raises(w.JournalMismatch, match=r"seed: 1 there, 2 now"):
        w.OrderedWriter(out, {**FP, "seed": 2}).open()
    assert w.OrderedWriter(out, {**FP, "seed": 2}).open(overwrite=True) == 0  # --overwrite starts over
    out.write_text("{}\n")
    with pytest.raises(w.JournalMismatch, match="does not record"):
        w.OrderedWriter(out, FP).open()
    w.record_path(out).write_text(json.dumps({"run": FP}))
    assert w.OrderedWriter(out, FP).open() is None  # complete and this run's: skipped
    assert w.output_problem(out, FP) == (True, None)
    complete, problem = w.output_problem(out, {**FP, "input": "other"})
    assert not complete and "the request file changed" in problem


@pytest.mark.parametrize("shares", [2, 3])
def test_shares_merge_in_input_order(tmp_path, shares):
    out, total = tmp_path / "out.jsonl", 10
    writers = [w.OrderedWriter(out, FP, d, shares) for d in range(shares)]
    for wr in writers:
        wr.open()
    for i in reversed(range(total)):
        writers[w.share_of(i, shares)].put(i, line(i))
    merged = []
    for wr in writers:
        assert wr.close(total)
        wr.publish()
        merged.append(w.try_merge_shares(out, shares, total))
    assert merged.count(True) == 1 and merged[-1]  # the last share to finish merges
    assert lines_of(out) == list(range(total))


class FullDisk:
    """A journal file whose writes fail with ENOSPC while ``full`` is set."""

    def __init__(self, f):
        self.f, self.full = f, True

    def write(self, data):
        if self.full:
            raise OSError(errno.ENOSPC, "No space left on device")
        return self.f.write(data)

    def __getattr__(self, name):
        return getattr(self.f, name)


def test_a_full_disk_keeps_lines_waiting_then_writes_them(tmp_path):
    out = tmp_path / "out.jsonl"
    wr = w.OrderedWriter(out, FP)
    wr.open()
    wr._file = disk = FullDisk(wr._file)
    for i in range(4):
        wr.put(i, line(i))
        assert wr.flush() == 0
    assert wr.write_error == "the disk is full" and wr.journal.read_bytes() == b""
    disk.full = False
    wr.put(4, line(4))
    assert wr.flush() == 5 and wr.write_error is None
    assert wr.close(5)
    assert lines_of(wr.journal) == list(range(5))


def test_a_disk_that_stays_full_gives_up_the_file_not_the_run(tmp_path, monkeypatch):
    monkeypatch.setattr(w, "DISK_FULL_HOLD_BYTES", 200)
    out = tmp_path / "out.jsonl"
    wr = w.OrderedWriter(out, FP)
    wr.open()
    wr.put(0, line(0))
    wr.flush()
    wr._file = FullDisk(wr._file)
    for i in range(1, 10):
        wr.put(i, line(i))
        wr.flush()
    assert wr.gave_up and not wr.pending
    assert not wr.close(10)  # incomplete: the journal keeps what was written before
    assert lines_of(wr.journal) == [0]
