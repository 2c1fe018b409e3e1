"""Keep freed host memory in the process on CPU stages (glibc's malloc: no mmap per large tensor).

glibc serves every allocation over its mmap threshold (at most 32 MiB) with a fresh ``mmap`` and
returns it with ``munmap`` when freed. A prefill's activations are such tensors (5,590 tokens x 4,096
features of an MLP's up projection: 91 MB), so every layer of every prefill page-faulted its outputs
in anew, the kernel zeroing each page: slower the larger the process (docs/design/host-memory.md).

:func:`keep_freed_memory` turns glibc's per-tensor mmap off and raises its trim threshold, so freed
tensors go back to the heap and the next pass reuses pages already mapped. The process then keeps
its peak heap (as PyTorch's CUDA caching allocator keeps device memory): RSS stays at the run's
peak instead of falling between passes. On a C library other than glibc it does nothing.
"""

from __future__ import annotations

import ctypes
import logging

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # mallopt parameters (glibc's malloc.h)
INT_MAX = 2**31 - 1


def keep_freed_memory() -> bool:
    """Make glibc's malloc keep freed memory (no per-allocation mmap, no trimming below 2 GiB free);
    returns whether it could (False off glibc)."""
    try:
        libc = ctypes.CDLL(None)  # the C library this process already runs
        mallopt = libc.mallopt
        libc.gnu_get_libc_version  # glibc only: another libc's mallopt parameters may mean other things
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = mallopt(M_MMAP_MAX, 0) == 1 and mallopt(M_TRIM_THRESHOLD, INT_MAX) == 1
    log.debug("glibc malloc keeps freed memory: %s", ok)
    return ok


def release_freed_memory() -> bool:
    """Return the heap's free pages to the system now (glibc's ``malloc_trim(0)``: free pages anywhere in
    the heap, not only at its top); False off glibc. For load-time steps that replace one big tensor by
    another (oneDNN's packed copy of a weight, then the plain one freed): the freed weight's pages stay
    resident in a heap that keeps freed memory, and a packed copy a little larger than the hole it
    could have reused goes above it, leaving holes of hundreds of MB after packing a 1B stage."""
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 (glibc only)
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return False
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    trim(0)
    return True
