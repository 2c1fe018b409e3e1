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
    assert crashed_runs(rec.path, 2) == 0  # run 2 died with a line alone: its culprit is known, not a loop
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


def test_a_crash_loop_counts_the_runs_that_narrowed_nothing(tmp_path):
    """A batch fails after MAX_CRASHES runs in a row that ended the server without journaling a line;
    runs that probed suspects or had one alone in flight moved the isolation on (about log2(k) of them
    corner a line among k) and break the count."""
    from tasks.inflight import InFlight, crashed_runs

    journal = tmp_path / "out.jsonl.partial"
    for _ in range(2):  # died before admitting anything, twice
        rec = InFlight(journal)
        rec.open(0)
        rec._file.close()
    assert crashed_runs(rec.path, 0) == 2
    rec = InFlight(journal)
    rec.open(0)
    rec.admitted([0, 1, 2, 3], [])  # died with four lines in flight: suspects, not narrowed yet
    rec._file.close()
    assert crashed_runs(rec.path, 0) == 3
    for probe in ([0, 1], [1]):
        rec = InFlight(journal)
        suspects, _ = rec.open(0)
        rec.admitted(suspects, [], probe=probe, group=1)
        rec._file.close()
        assert crashed_runs(rec.path, 0) == 0  # the suspects halved
    rec = InFlight(journal)
    assert rec.open(0) == ([1], [])
    rec.admitted([], [1])
    rec._file.close()
    assert crashed_runs(rec.path, 0) == 0 and InFlight(journal).open(0) == ([], [1])
