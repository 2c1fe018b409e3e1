"""Files that appear whole or not at all: write beside the target, sync, then rename over it."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

FINGERPRINT_CHUNK = 1 << 20  # bytes hashed per read: the whole file goes through, in 1 MiB pieces


def fsync_dir(path: str | os.PathLike) -> None:
    """Make a rename or a new entry in the folder ``path`` durable (a no-op where folders cannot be opened)."""
    with contextlib.suppress(OSError):  # some filesystems refuse fsync on a folder: the rename still happened
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@contextmanager
def atomic_path(path: str | os.PathLike, fsync: bool = True, mode: int | None = None) -> Iterator[Path]:
    """Yield a temporary sibling of ``path`` to write; on success it is synced to disk (``fsync``), given
    ``mode`` when asked, and replaces ``path`` in one step (the folder synced after), so a power loss
    leaves the old file or the new one, never an empty or torn one. On failure ``path`` is untouched."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        yield tmp
        if mode is not None:
            os.chmod(tmp, mode)
        if fsync:
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
        os.replace(tmp, path)
        if fsync:
            fsync_dir(path.parent)
    finally:
        tmp.unlink(missing_ok=True)


def write_atomic(path: str | os.PathLike, data: str | bytes, mode: int | None = None) -> None:
    """Write ``data`` to ``path`` atomically and durably (text as UTF-8); ``mode``: its permission bits."""
    with atomic_path(path, mode=mode) as tmp:  # created with its mode: never readable by others, not even briefly
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666 if mode is None else mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode("utf-8") if isinstance(data, str) else data)


def count_lines(path: str | os.PathLike) -> int:
    """Non-blank lines of a request file (what rank 0 counts as its requests)."""
    with open(path, "rb") as f:
        return sum(1 for line in f if line.strip())


def input_fingerprint(path: str | os.PathLike) -> str:
    """Size and a BLAKE2b hash of the whole file: a journal or output is only taken for this input's
    (an edit anywhere in the file is another input). About 0.5 s per 100 MB on one core, once per
    process and version of the file (remembered by path, size and modification time)."""
    st = os.stat(path)
    return _fingerprint(os.fspath(path), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=1024)
def _fingerprint(path: str, size: int, mtime_ns: int) -> str:
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        while chunk := f.read(FINGERPRINT_CHUNK):
            h.update(chunk)
    return f"{size}:{h.hexdigest()}"


def legacy_input_fingerprint(path: str | os.PathLike) -> str:
    """What versions before the whole-file hash recorded: size and a SHA-256 of the first MiB."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        h.update(f.read(1 << 20))
    return f"{os.path.getsize(path)}:{h.hexdigest()[:16]}"
