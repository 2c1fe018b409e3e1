"""Which lines were being computed when a run ended, so a line that kills a process does not kill every
rerun at the same place (docs/usage/recovery.md, "No crash loops"). The last rank appends to
``<journal>.inflight`` the lines each pass admits, before they are computed:

    {"open": 12}                 a run starts (12 of this share's lines already journaled)
    {"in": [40, 41, 42]}         lines admitted (with others)
    {"alone": [43]}              a suspect line admitted with nothing else in flight
    {"probe": [7, 9], "group": 2}  suspects probed together (pipeline.scheduling.isolation)
    {"stopped": 1}               the run ended or was stopped (SIGTERM/SIGINT): it did not crash

Of each earlier run that crashed, the lines not journaled that were in flight: one *alone* is the
culprit (answered with :func:`crash_error`, not run again); a probe group holds the poison by itself;
otherwise they are all suspects. The file goes when the output is complete.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import orjson

from tasks.shards import position_of, share_of

_OPEN: list["InFlight"] = []  # records of this process, told when a signal stops the run


def inflight_path(journal: str | os.PathLike) -> Path:
    journal = Path(journal)
    return journal.with_name(journal.name + ".inflight")


def crash_error(index: int) -> dict:
    """The error object of a line that was alone in flight when a process died."""
    return {"message": f"line {index} was being computed, alone, when the process ended, after an earlier run "
                       "had ended while computing it too; it is answered with this error instead of being run "
                       "again (check the request; delete the output's .partial.inflight file to retry it)",
            "type": "server_error", "param": None}


class InFlight:
    def __init__(self, journal: str | os.PathLike, share: int = 0, shares: int = 1):
        self.path = inflight_path(journal)
        self.share, self.shares = share, shares
        self._file = None

    def open(self, written: int) -> tuple[list[int], list[int]]:
        """Start a run with ``written`` lines journaled; returns (suspects, culprits) from earlier runs."""
        suspects, culprits = replay(self.path, written, self.share, self.shares)
        self._file = open(self.path, "ab")
        self._write({"open": written})
        _OPEN.append(self)
        return sorted(suspects), sorted(culprits)

    def admitted(self, indices: list[int], alone: list[int], probe: list[int] = (), group: int = 0) -> None:
        """Lines that enter the pipeline, before they run: ``alone``, suspects with nothing else in flight;
        ``probe``, suspects probed together as probe ``group`` (pipeline.scheduling.isolation)."""
        if indices:
            self._write({"in": indices})
        if alone:
            self._write({"alone": alone})
        if probe:
            self._write({"probe": list(probe), "group": group})

    def stopped(self) -> None:
        """The run is stopped on purpose (a signal): its lines in flight are not suspects."""
        if self._file is not None:
            self._write({"stopped": 1})

    def close(self, complete: bool) -> None:
        """The run ended normally; the record goes with the journal once the output is complete."""
        if self._file is not None:
            self._write({"stopped": 1})
            self._file.close()
            self._file = None
        if self in _OPEN:
            _OPEN.remove(self)
        if complete:
            self.path.unlink(missing_ok=True)

    def _write(self, rec: dict) -> None:
        self._file.write(orjson.dumps(rec) + b"\n")
        self._file.flush()  # in the page cache: a killed process loses nothing


def _records(path: Path) -> Iterator[dict]:
    """The records in ``path`` (none where there is no such file), a torn last one left out."""
    if not path.exists():
        return
    for line in path.read_bytes().split(b"\n"):
        try:
            rec = orjson.loads(line)
        except orjson.JSONDecodeError:
            continue  # a torn last record
        if isinstance(rec, dict):
            yield rec


def replay(path: Path, written: int, share: int = 0, shares: int = 1) -> tuple[set[int], set[int]]:
    """(suspects, culprits) not journaled yet, from the runs recorded in ``path``."""
    runs: list[dict] = []
    for rec in _records(path):
        if "open" in rec:
            runs.append({"in": set(), "alone": set(), "probe": {}, "stopped": False})
        elif runs:
            run = runs[-1]
            run["stopped"] |= bool(rec.get("stopped"))
            for key in ("in", "alone"):
                run[key].update(i for i in rec.get(key, []) if isinstance(i, int))
            if isinstance(rec.get("group"), int):
                run["probe"].setdefault(rec["group"], set()).update(i for i in rec.get("probe", []) if isinstance(i, int))
    suspects, culprits = set(), set()
    for run in runs:  # what each run that crashed says, in order
        if run["stopped"]:
            continue
        if run["alone"]:  # a line alone in flight ended the process: the culprit
            culprits |= run["alone"]
            suspects -= run["alone"]
        elif run["probe"]:  # a probe group was in flight: it holds the poison (the lines beside it ran as usual)
            suspects = set(run["probe"][max(run["probe"])])
        else:
            suspects |= run["in"]
    def pending(i: int) -> bool:  # not journaled: this share's line at or after position `written`
        return share_of(i, shares) == share and position_of(i, shares) >= written

    culprits = {i for i in culprits if pending(i)}
    return {i for i in suspects if pending(i)} - culprits, culprits


def crashed_runs(path: Path, written: int) -> int:
    """How many of the last runs recorded in ``path`` crashed in a row without journaling a line and
    without narrowing the suspects (``written``: the lines journaled now); the runs that crashed with a
    probe group or a lone suspect in flight moved the isolation on, and are not counted."""
    opens, ended = [], []  # per run: where it started; stopped, or narrowed the suspects
    for rec in _records(path):
        if isinstance(rec.get("open"), int):
            opens.append(rec["open"])
            ended.append(False)
        elif ended and (rec.get("stopped") or rec.get("alone") or rec.get("probe")):
            ended[-1] = True
    n = 0
    for k in range(len(opens) - 1, -1, -1):
        after = opens[k + 1] if k + 1 < len(opens) else written
        if ended[k] or after > opens[k]:
            break
        n += 1
    return n


def recording() -> bool:
    """This process keeps a record (the last stage, a file open)."""
    return bool(_OPEN)


def stop_all() -> None:
    """A signal stops this process: every open record says so (called from the signal thread)."""
    for rec in list(_OPEN):
        with contextlib.suppress(OSError, ValueError):
            rec.stopped()
