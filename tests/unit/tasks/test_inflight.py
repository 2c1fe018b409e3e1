"""The record of the lines in flight (tasks.inflight): suspects and culprits of the runs that crashed,
a stopped run's lines innocent, a data-parallel share's own lines. Crash loops end to end:
tests/integration/test_reliability.py."""

def test_the_inflight_record_names_suspects_and_culprits(tmp_path):
    """What a resumed run learns from the record of the runs before it."""
    from tasks.inflight import InFlight, crashed_runs

    journal = tmp_path / "out.jsonl.partial"
    rec = InFlight(journal)
    assert rec.open(0) == ([], [])
    rec.admitted([0, 1, 2, 3], [])
    rec._file.close()  # run 1 dies with 0..3 in flight; 0 and 1 were journaled
    rec = InFlight(journal)
    assert rec.open(2) == ([2, 3], [])
    rec.admitted([], [2])
    rec._file.close()  # run 2 dies with 2 alone
    assert crashed_runs(rec.path, 2) == 1  # run 1 journaled lines 0 and 1: only run 2 counts
    rec = InFlight(journal)
    assert rec.open(2) == ([3], [2])
    rec.admitted([], [3])
    rec.stopped()  # run 3 is stopped by a signal: 3 was not the cause
    rec._file.close()
    assert crashed_runs(rec.path, 2) == 0
    rec = InFlight(journal)
    assert rec.open(2) == ([3], [2])
    rec.close(complete=True)
    assert not rec.path.exists()
    # data parallelism: share 1 of 2 holds lines 64..127, 192..; 3 journaled means 64, 65, 66
    rec = InFlight(tmp_path / "o.partial-1-of-2", share=1, shares=2)
    rec.open(0)
    rec.admitted([64, 66, 67, 192], [])
    rec._file.close()
    assert InFlight(tmp_path / "o.partial-1-of-2", share=1, shares=2).open(3) == ([67, 192], [])
