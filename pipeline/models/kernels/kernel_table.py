"""Kernel choices kept per machine: a JSON table keyed by the kind of CPU (or GPU), torch's version and
each layer shape, so a choice made by timing is made once and every later run on that kind of machine
reads it (``--kernel-table PATH`` pins a table of one's own). Timing at load is a lottery on a busy
machine, and where candidates round differently (:mod:`.weight_only`) a different pick is a different
answer. The first run that needs a shape measures it under a lock beside the file (ranks loading at
once then read its entry); an entry whose kernel no longer runs is measured again.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import platform
import tempfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch
from torch import nn

from pipeline.models.kernels.native import cpuinfo
from pipeline.paths import cache_root

log = logging.getLogger(__name__)


def machine() -> dict[str, str]:
    """What a kernel's speed depends on besides the shape: the CPU model and its features, the
    instructions PyTorch's kernels (and so the C loops) are held to (``ATEN_CPU_CAPABILITY``), the GPU's
    name when there is one, torch's version."""
    cpu = {"model": platform.processor() or platform.machine(), "flags": ""}
    for key, _, value in (line.partition(":") for line in cpuinfo()):
        if key.strip() in ("model name", "Model"):
            cpu["model"] = value.strip()
        elif key.strip() in ("flags", "Features"):
            cpu["flags"] = value.strip()
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else ""
    return {"cpu": cpu["model"], "cpu_flags": cpu["flags"], "isa": torch.backends.cpu.get_cpu_capability(),
            "gpu": gpu, "torch": torch.__version__, "arch": platform.machine()}


def default_path() -> Path:
    """``<cache root>/kernels/kernel-table-<hash of machine()>.json``."""
    key = hashlib.sha256(json.dumps(machine(), sort_keys=True).encode()).hexdigest()[:16]
    return cache_root() / "kernels" / f"kernel-table-{key}.json"


class KernelTable:
    """Kernel choices by key (``kind/device/dtype/shape``), read from and written to one JSON file."""

    def __init__(self, path: str | os.PathLike | None = None):
        self.path = Path(path) if path else default_path()
        self.kept, self.measured = 0, 0  # this process's entries read from the file, and measured

    @contextlib.contextmanager
    def _locked(self) -> Iterator[dict]:
        """The table's entries under an exclusive lock (a file beside it); written back if changed."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path.with_name(self.path.name + ".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                entries = self._read()
                before = json.dumps(entries, sort_keys=True)
                yield entries
                if json.dumps(entries, sort_keys=True) != before:
                    self._write(entries)
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _read(self) -> dict:
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as e:
            log.warning("kernel table %s unreadable (%s): measuring again", self.path, e)
            return {}
        return data.get("entries", {}) if isinstance(data, dict) else {}

    def _write(self, entries: dict) -> None:
        fd, tmp = tempfile.mkstemp(suffix=".json", dir=self.path.parent)
        with os.fdopen(fd, "w") as f:
            json.dump({"machine": machine(), "entries": entries}, f, indent=1, sort_keys=True)
        os.replace(tmp, self.path)

    def choose(self, key: str, runs: Callable[[str], bool], measure: Callable[[], dict]) -> dict:
        """The entry for ``key`` (``{"kernel": name, ...}``): the table's when its kernel ``runs`` here,
        else ``measure()``'s, stored. The lock is held while measuring."""
        with self._locked() as entries:
            entry = entries.get(key)
            if isinstance(entry, dict) and isinstance(entry.get("kernel"), str) and runs(entry["kernel"]):
                self.kept += 1
                return entry
            if entry is not None:
                log.warning("kernel table %s: %s's kernel %r does not run here: measuring again", self.path, key,
                            entry.get("kernel") if isinstance(entry, dict) else entry)
            entry = measure()
            entries[key] = entry
            self.measured += 1
            return entry

    def summary(self) -> dict:
        """For the run summary: where the choices live and how many this stage read or measured."""
        return {"path": str(self.path), "kept": self.kept, "measured": self.measured}


def set_per_shape(layers: Iterable[nn.Module], shape: Callable[[nn.Module], tuple],
                  plan: Callable[[nn.Module], tuple[str, list[str], Callable[[], dict]]], table: KernelTable | None,
                  release: Callable[[], object] | None = None) -> dict[str, dict]:
    """Set one kernel on every layer of each ``shape`` (a tuple starting ``(in, out)``) and return
    ``{"INxOUT": entry}``. ``plan(probe)`` gives the shape's table key, the kernels that run on the probe
    and the measurement; the entry is ``table``'s when given, else measured now. ``release``: called
    after each layer's weight is repacked and at the end (the caller hands freed memory back)."""
    by_shape: dict[tuple, list[nn.Module]] = {}
    for m in layers:
        by_shape.setdefault(shape(m), []).append(m)
    chosen = {}
    for (k, n, *_), mods in by_shape.items():
        key, alive, measure = plan(mods[0])
        entry = table.choose(key, alive.__contains__, measure) if table is not None else measure()
        del measure  # what the timing holds (int8: packed copies), before the layers pack their own
        for m in mods:
            m.set_kernel(entry["kernel"])
            if release is not None and m.packed is not None:  # the plain weight's pages, before the next copy
                release()
        chosen[f"{k}x{n}"] = entry
    if release is not None:
        release()  # the timing's temporaries
    return chosen
