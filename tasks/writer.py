"""The ordered, resumable writer on the last rank (docs/usage/recovery.md, "Resume").

Results arrive out of order; lines go to the journal ``<output>.partial`` in input order as soon as
they are contiguous, so it is always a prefix of the output and a rerun with the same settings resumes
after its last whole line. The complete journal is renamed to the output. The run's fingerprint, in
``<output>.partial.json`` (a journal) or ``<output>.summary.json``'s ``"run"`` (a complete output),
keeps another model's or other settings' lines from being mixed in, or taken for this run's.
"""

from __future__ import annotations

import errno
import fcntl
import glob
import json
import logging
import os
import re
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

import orjson

from comm.faults import FINALIZE

from tasks.files import atomic_path, input_fingerprint, legacy_input_fingerprint, write_atomic
from tasks.shards import index_of, share_of, share_size


log = logging.getLogger(__name__)

JOURNAL_SYNC_S = 1.0  # the journal is fsynced at most this long after a line is written (and at close)
# a full disk: lines wait in memory for space, up to this many bytes; beyond it the file gives up (its
# journal keeps every line written before, so a rerun or the Batch API's partial output has them)
DISK_FULL_HOLD_BYTES = 64 << 20
DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


class JournalMismatch(RuntimeError):
    pass


# how the lines were shared among pipelines changes the journals' layout, not the finished lines
NOT_IN_RESULTS = ("data_group_size",)
HOW_TO_REPLACE = "pass --overwrite to recompute it, or --output-path to write this run's results elsewhere"


_LEGACY_INPUT = re.compile(r"^\d+:[0-9a-f]{16}$")


def input_id(path: str | os.PathLike, output: str | os.PathLike) -> str:
    """The input's fingerprint for ``output``'s journal and record: the whole-file hash, except that a
    journal or complete output recorded by an earlier version (size + first MiB) keeps that id while it
    still matches the file, so a job started before an upgrade resumes, or is skipped, after it."""
    record = record_path(output)
    for meta in [record, *map(Path, glob.glob(glob.escape(str(output)) + ".partial*.json"))]:
        try:
            obj = json.loads(meta.read_text())
            recorded = obj["run"]["input"] if meta == record else obj["input"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if isinstance(recorded, str) and _LEGACY_INPUT.match(recorded) and recorded == legacy_input_fingerprint(path):
            return recorded
    return input_fingerprint(path)


def record_path(output: str | os.PathLike) -> Path:
    """``<output>.summary.json``: the file's summary, with the fingerprint of the run that wrote it."""
    output = Path(output)
    return output.with_name(output.name + ".summary.json")


def differences(old: dict, new: dict, ignore: tuple[str, ...] = ()) -> str:
    """``key: old -> new`` for each setting that differs (an empty string when none does)."""
    keys = sorted(k for k in set(old) | set(new) if k not in ignore and old.get(k) != new.get(k))
    words = {"input": "the request file changed"}
    return ", ".join(words.get(k) or f"{k}: {old.get(k)!r} there, {new.get(k)!r} now" for k in keys)


def complete_output_problem(output: str | os.PathLike, fingerprint: dict) -> str | None:
    """None when the existing ``output`` was written by a run with this fingerprint (skip it);
    otherwise why it cannot be taken for this run's results, and the way out."""
    record = record_path(output)
    try:
        old = json.loads(record.read_text())["run"]
        assert isinstance(old, dict)
    except (OSError, ValueError, KeyError, TypeError, AssertionError):
        return (f"{output} exists, but {record.name} does not record which model and settings wrote it "
                f"(written by hand or by an older version); {HOW_TO_REPLACE}")
    changed = differences(old, fingerprint, NOT_IN_RESULTS)
    if not changed:
        return None
    return f"{output} is complete but was written by another run ({changed}); {HOW_TO_REPLACE}"


def journal_problem(journal: Path, fingerprint: dict) -> str | None:
    """None when ``journal`` (if any) can be resumed by a run with this fingerprint."""
    if not journal.exists():
        return None
    meta = journal.with_name(journal.name + ".json")
    try:
        old = json.loads(meta.read_text())
    except (OSError, ValueError):
        old = None
    if old == fingerprint:
        return None
    changed = differences(old, fingerprint) if isinstance(old, dict) else "no fingerprint"
    return (f"{journal} was written by a run with different settings ({changed}); "
            "rerun with the same settings to resume it, or pass --overwrite to start over")


def output_problem(output: str | os.PathLike, fingerprint: dict, shares: int = 1) -> tuple[bool, str | None]:
    """(complete, problem) for ``output`` before a run with this fingerprint opens it: complete and
    this run's (skip), or a complete output or a journal of another run (the problem says why)."""
    if Path(output).exists():
        problem = complete_output_problem(output, fingerprint)
        return problem is None, problem
    problems = (journal_problem(journal_path(output, d, shares), fingerprint) for d in range(shares))
    return False, next(filter(None, problems), None)


def journal_path(output: str | os.PathLike, share: int = 0, shares: int = 1) -> Path:
    """Where a share's lines go until the output is complete: ``<output>.partial[-d-of-D]``."""
    output = Path(output)
    return output.with_name(output.name + (".partial" if shares == 1 else f".partial-{share}-of-{shares}"))


class OrderedWriter:
    def __init__(self, output: str | os.PathLike, fingerprint: dict, share: int = 0, shares: int = 1):
        self.output = Path(output)
        self.journal = journal_path(self.output, share, shares)
        self.meta = self.journal.with_name(self.journal.name + ".json")
        self.fingerprint = fingerprint
        self.share, self.shares = share, shares
        self.pending: dict[int, bytes] = {}
        self.written = 0  # lines in the journal
        self.write_error: str | None = None  # set while the disk is full (lines wait), or for good (gave up)
        self.gave_up = False
        self._file = None
        self._size = 0  # bytes of whole lines in the journal: a failed write is cut back to it
        self._synced = 0.0

    def open(self, overwrite: bool = False) -> int | None:
        """Prepare the journal; returns how many of this share's lines are already done, or None
        when the output is already complete (and not --overwrite)."""
        if self.output.exists() and not overwrite:
            if problem := complete_output_problem(self.output, self.fingerprint):
                raise JournalMismatch(problem)
            return None
        self.output.parent.mkdir(parents=True, exist_ok=True)
        resume = self.journal.exists() and not overwrite
        self._file = open(self.journal, "a+b", buffering=0)  # unbuffered: a failed write leaves nothing behind
        try:  # one run per output: a second would write every line again (a POSIX lock: never this process's)
            fcntl.lockf(self._file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except (BlockingIOError, PermissionError):
            self._file.close()
            raise JournalMismatch(f"{self.journal} is being written by another run; wait for it to end or stop it "
                                  "(its journal resumes)") from None
        if not resume:
            self._file.truncate(0)
            write_atomic(self.meta, json.dumps(self.fingerprint, sort_keys=True))
        elif problem := journal_problem(self.journal, self.fingerprint):
            self._file.close()
            raise JournalMismatch(problem)
        else:  # its complete lines; a torn last one (killed mid-write) is cut
            self._file.seek(0)
            data = self._file.read()
            self._file.truncate(end := data.rfind(b"\n") + 1)
            self.written = data[:end].count(b"\n")
        self._size = self.journal.stat().st_size
        self._synced = time.monotonic()
        return self.written

    def put(self, index: int, line: dict) -> None:
        self.pending[index] = orjson.dumps(line) + b"\n"

    def flush(self) -> int:
        """Write every line that is now contiguous (a full disk: they wait, :meth:`_write`); how many."""
        if self.gave_up:
            self.pending.clear()
            return 0
        ready = []  # input indices of this share's next lines, while they are in
        while (i := index_of(self.share, self.written + len(ready), self.shares)) in self.pending:
            ready.append(i)
        if not ready or not self._write(b"".join(self.pending[i] for i in ready)):
            return 0
        for i in ready:
            del self.pending[i]
        self.written += len(ready)
        if time.monotonic() - self._synced >= JOURNAL_SYNC_S:
            os.fsync(self._file.fileno())
            self._synced = time.monotonic()
        return len(ready)

    def _write(self, data: bytes) -> bool:
        """Append ``data`` whole, or leave the journal as it was. On a full disk the lines stay pending
        (retried at the next flush, when space may be back) up to DISK_FULL_HOLD_BYTES, then the file
        gives up: :meth:`close` reports it incomplete and the journal holds every line written before."""
        try:
            view = memoryview(data)
            while view:
                view = view[self._file.write(view):]
        except OSError as e:
            os.ftruncate(self._file.fileno(), self._size)  # no torn line: the journal stays a prefix
            if e.errno not in DISK_FULL:
                raise
            if self.write_error is None:
                log.error("%s: the disk is full; results wait in memory until space is freed", self.journal)
            self.write_error = "the disk is full"
            if sum(map(len, self.pending.values())) > DISK_FULL_HOLD_BYTES:
                log.error("%s: the disk stayed full; this file stops here (%d lines journaled)",
                          self.journal, self.written)
                self.gave_up = True
                self.pending.clear()
            return False
        self._size += len(data)
        if self.write_error is not None:
            log.warning("%s: space is back, results are written again", self.journal)
            self.write_error = None
        return True

    def close(self, total_lines: int) -> bool:
        """Finish the journal (flushed and synced); True when every line of the share is in it.
        The caller writes the file's summary (the record of this run), then :meth:`publish`."""
        self.flush()
        expected = share_size(self.share, total_lines, self.shares)
        os.fsync(self._file.fileno())
        self._file.close()
        return self.written == expected

    def publish(self) -> None:
        """The complete journal becomes the output (one share: a rename; several: marked done)."""
        FINALIZE.tick()
        if self.shares == 1:
            os.replace(self.journal, self.output)
            self.meta.unlink(missing_ok=True)
        else:
            self.journal.with_name(self.journal.name + ".done").touch()


def merge_shares(output: Path, journals: list[Path], total_lines: int) -> None:
    """Interleave data-parallel journals (line i from share ``share_of(i)``) into the output, atomically."""
    with ExitStack() as stack:
        files = [stack.enter_context(open(j, "rb")) for j in journals]
        with atomic_path(output, fsync=True) as tmp, open(tmp, "wb") as out:
            for i in range(total_lines):
                share = share_of(i, len(journals))
                line = files[share].readline()
                if not line.endswith(b"\n"):
                    raise RuntimeError(f"{journals[share]} ends early (line {i} missing)")
                out.write(line)


def try_merge_shares(output: str | os.PathLike, shares: int, total_lines: int,
                     before: Callable[[], None] | None = None) -> bool:
    """Called by each data-parallel writer once its share is complete (``<journal>.done``): the last one
    to finish merges, under an O_EXCL lock file, after ``before`` (it writes the merged summary, the
    record of the run). True if this call produced the output."""
    output = Path(output)
    journals = [journal_path(output, d, shares) for d in range(shares)]
    if not all(j.with_name(j.name + ".done").exists() for j in journals):
        return False
    lock = output.with_name(output.name + ".merge-lock")
    try:
        os.close(os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    try:
        if before is not None:
            before()
        merge_shares(output, journals, total_lines)
        for j in journals:
            for suffix in ("", ".json", ".done"):
                j.with_name(j.name + suffix).unlink(missing_ok=True)
    finally:
        lock.unlink(missing_ok=True)
    return True
