"""A process's own memory, which only a fresh process shows: CPU stages keep freed host memory for the
next pass (pipeline/runtime/host_memory.py), a CPU cache holds only the pages its rows write, and a
process's peak RSS is its own, not its parent's. One test, a probe process for each."""

import platform
import subprocess
import sys

import pytest

from tests.utils import _env  # PYTHONPATH: the repository, for the probes' imports

# Allocates and frees a 256 MiB tensor (far over glibc's largest mmap threshold) and prints how much
# of it the process still holds afterwards, in MiB, with or without keep_freed_memory().
PROBE = """
import sys
import torch
from pipeline.runtime.host_memory import keep_freed_memory, release_freed_memory

def rss_mib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20

if sys.argv[1] in ("keep", "release"):
    assert keep_freed_memory()
before = rss_mib()
x = torch.ones(256 << 18)  # 256 MiB of float32, every page touched
y = torch.ones(1 << 10)  # above it in the heap: x's pages are a hole, not the heap's top
held = rss_mib() - before
del x
if sys.argv[1] == "release":
    assert release_freed_memory()
print(round(rss_mib() - before), round(held))
"""


# A 256 MiB KV cache on the CPU: resident memory after allocating it, after one row writes 1 MiB of it,
# and after it is freed, in MiB above the start; and what that row and an unwritten row read.
CACHE_PROBE = """
import torch
from pipeline.runtime.host_memory import keep_freed_memory
from pipeline.cache.kv_cache import zeroed

def rss_mib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20

keep_freed_memory()  # as CPU stages run
before = rss_mib()
cache = zeroed((2, 8, 4, 4096, 256), torch.float32, "cpu")  # layers, rows, kv heads, columns, head dim
allocated = rss_mib() - before
cache[0, 3, :, :256] = 1.0  # one row's first 256 columns of one layer: 1 MiB
used = rss_mib() - before
written, unwritten = float(cache[0, 3, :, :300].sum()), float(cache[1, 5, :, :300].abs().sum())
del cache
print(round(allocated), round(used), round(rss_mib() - before), written, unwritten)
"""


def check_a_cpu_cache_holds_only_the_pages_its_rows_write():
    """A micro-batch's cache is sized for its longest possible rows; on the CPU allocating it touches
    no memory (torch.zeros wrote every page up front), rows cost the pages they use, unwritten cells
    read zero, and the memory goes back to the system when the cache is freed."""
    p = subprocess.run([sys.executable, "-c", CACHE_PROBE], capture_output=True, text=True, timeout=120, env=_env(None))
    assert p.returncode == 0, p.stderr[-2000:]
    allocated, used, after, written, unwritten = p.stdout.split()
    assert float(written) == 4 * 256 * 256 and float(unwritten) == 0
    assert int(allocated) < 8 and int(used) < 16 and int(after) < 8, p.stdout


def check_a_process_peak_is_its_own_not_its_parents():
    """The summaries' peak RSS (tasks.status.peak_rss_bytes) is the runner's own: Linux carries
    ``ru_maxrss`` across fork and exec, so a small process started by a parent holding 400 MiB (pytest,
    torchrun's agent) read 400 MiB as its peak; VmHWM starts afresh at exec."""
    ballast = b"\x01" * (400 * 2**20)  # resident in this (parent) process
    code = "from tasks.status import peak_rss_bytes; print(peak_rss_bytes())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120,
                         env=_env(None))
    assert len(ballast) and int(out.stdout) < 200 * 2**20


def check_freed_tensor_memory_stays_with_the_process_for_the_next_pass():
    def kept_after_free(mode: str) -> tuple[int, int]:
        p = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, timeout=120,
                           env=_env(None))
        assert p.returncode == 0, p.stderr[-2000:]
        kept, held = map(int, p.stdout.split())
        assert held >= 250  # the tensor was resident
        return kept, held

    assert kept_after_free("system")[0] < 50  # glibc's default: the tensor's mmap is unmapped when freed
    kept, held = kept_after_free("keep")
    assert kept >= held - 10  # kept in the heap: the next pass's tensors reuse mapped pages
    assert kept_after_free("release")[0] < 50  # load-time holes handed back on request (malloc_trim)


@pytest.mark.skipif(platform.system() != "Linux", reason="reads /proc/self/statm")
def test_a_process_keeps_and_counts_its_own_memory():
    if platform.libc_ver()[0] == "glibc":  # glibc's malloc
        check_freed_tensor_memory_stays_with_the_process_for_the_next_pass()
    check_a_cpu_cache_holds_only_the_pages_its_rows_write()
    check_a_process_peak_is_its_own_not_its_parents()
