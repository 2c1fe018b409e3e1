"""The journal and the files around it, without a run: an input's identity (its whole content, and the
earlier fingerprint still recognised), atomic and synced writes, a full disk that loses nothing."""

import json

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
