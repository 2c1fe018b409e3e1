"""Keep freed host memory in the process on CPU stages (glibc's malloc: no mmap per large tensor).

glibc maps every allocation over its mmap threshold afresh and unmaps it when freed, so every layer of
every prefill page-faulted its activations in anew (docs/design/host-memory.md). With
:func:`keep_freed_memory` freed tensors go back to the heap and the next pass reuses pages already
mapped; RSS then stays at the run's peak. Off glibc both functions do nothing and return False.
"""

from __future__ import annotations

import ctypes
import logging

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # mallopt parameters (glibc's malloc.h)
INT_MAX = 2**31 - 1


def _glibc(name: str):
    """The C function ``name`` of this process's glibc (None off glibc: another libc's mallopt parameters
    may mean other things)."""
    try:
        libc = ctypes.CDLL(None)  # the C library this process already runs
        libc.gnu_get_libc_version  # noqa: B018 (glibc only)
        return getattr(libc, name)
    except (OSError, AttributeError):
        return None


def keep_freed_memory() -> bool:
    """Make glibc's malloc keep freed memory (no per-allocation mmap, no trimming below 2 GiB free);
    returns whether it could."""
    mallopt = _glibc("mallopt")
    if mallopt is None:
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = mallopt(M_MMAP_MAX, 0) == 1 and mallopt(M_TRIM_THRESHOLD, INT_MAX) == 1
    log.debug("glibc malloc keeps freed memory: %s", ok)
    return ok


def release_freed_memory() -> bool:
    """Return the heap's free pages to the system now (``malloc_trim(0)``: anywhere in the heap). For
    load-time steps that replace one big tensor by another (oneDNN's packed copy of a weight, then the
    plain one freed): in a heap that keeps freed memory, a packed copy a little larger than the hole it
    could have reused goes above it, leaving holes of hundreds of MB after packing a 1B stage."""
    trim = _glibc("malloc_trim")
    if trim is None:
        return False
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    trim(0)
    return True
