"""Checkpoint bytes read straight into a stage's parameters, in large positioned reads on a few threads.

Each stored tensor is cut into :data:`CHUNK`-byte chunks, each read with ``os.preadv`` at its own offset
(no shared file position, no mmap) by one of a few threads, in submission order: directly into the
parameter's bytes when the dtypes match, else into that thread's scratch buffer and cast into place (a
cast costs one chunk of memory, not a stored tensor). ``preadv`` and torch's copy release the GIL, so
the reads (and the fresh pages' faults) overlap. A short read surfaces from :meth:`ParallelReader.wait`
as a :class:`CheckpointError` naming the file and tensor.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from pipeline.loading.tensor_store import CheckpointError

CHUNK = 32 << 20  # bytes a thread reads at once: large sequential reads, a small cast scratch
THREADS = 2  # measured on a 2-core VM: 2-3 threads fill the parameters ~1.5-2x faster than 1


class ParallelReader:
    """Reads (file, offset, stored dtype) ranges into contiguous CPU tensors on ``threads`` threads."""

    def __init__(self, threads: int = THREADS, chunk: int = CHUNK):
        self.chunk = chunk
        self._pool = ThreadPoolExecutor(max(1, threads), thread_name_prefix="ckpt-read")
        self._pending: list[Future] = []
        self._local = threading.local()  # each thread's cast scratch

    def submit(self, fd: int, offset: int, stored: torch.dtype, out: torch.Tensor, what: str) -> None:
        """Queue reading ``out.numel()`` elements of dtype ``stored`` at byte ``offset`` of ``fd``
        into ``out`` (contiguous, CPU; its dtype may differ: cast chunk by chunk). ``what`` names
        the file and tensor in errors."""
        flat = out.view(-1)
        per = max(1, self.chunk // stored.itemsize)  # elements a chunk holds, in the stored dtype
        for start in range(0, flat.numel(), per):
            piece = flat[start : start + per]
            self._pending.append(self._pool.submit(self._read, fd, offset + start * stored.itemsize,
                                                   stored, piece, what))

    def _read(self, fd: int, offset: int, stored: torch.dtype, out: torch.Tensor, what: str) -> None:
        if out.dtype == stored:
            dest = out
        else:  # read the stored bytes into this thread's scratch, cast into place below
            scratch = getattr(self._local, "scratch", None)
            if scratch is None or scratch.numel() < self.chunk:
                scratch = self._local.scratch = torch.empty(self.chunk, dtype=torch.uint8)
            dest = scratch[: out.numel() * stored.itemsize].view(stored)
        view = memoryview(dest.view(torch.uint8).numpy()).cast("B")
        done = 0
        while done < len(view):  # preadv may return less than asked (large reads, signals)
            n = os.preadv(fd, [view[done:]], offset + done)
            if n == 0:
                raise CheckpointError(f"{what}: truncated while reading (file ended at byte {offset + done})")
            done += n
        if dest is not out:
            out.copy_(dest)

    def wait(self) -> None:
        """Block until every queued chunk is in place; the first error, if any (the rest still finish)."""
        pending, self._pending = self._pending, []
        errors = [e for e in (f.exception() for f in pending) if e is not None]
        if errors:
            raise errors[0]

    def close(self) -> None:
        """Wait for queued chunks (errors ignored: close follows an error) and stop the threads."""
        for f in self._pending:
            f.cancel()
        self._pool.shutdown(wait=True)
        self._pending = []
