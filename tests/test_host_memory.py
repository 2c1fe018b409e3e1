"""CPU stages keep freed host memory for the next pass (pipeline/host_memory.py)."""

import platform
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# Allocates and frees a 256 MiB tensor (far over glibc's largest mmap threshold) and prints how much
# of it the process still holds afterwards, in MiB, with or without keep_freed_memory().
PROBE = """
import sys
sys.path.insert(0, {repo!r})
import torch
from pipeline.host_memory import keep_freed_memory

def rss_mib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20

if sys.argv[1] == "keep":
    assert keep_freed_memory()
before = rss_mib()
x = torch.ones(256 << 18)  # 256 MiB of float32, every page touched
held = rss_mib() - before
del x
print(round(rss_mib() - before), round(held))
"""


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's malloc")
def test_freed_tensor_memory_stays_with_the_process_for_the_next_pass():
    def kept_after_free(mode: str) -> tuple[int, int]:
        p = subprocess.run([sys.executable, "-c", PROBE.format(repo=str(REPO)), mode], capture_output=True,
                           text=True, timeout=120)
        assert p.returncode == 0, p.stderr[-2000:]
        kept, held = map(int, p.stdout.split())
        assert held >= 250  # the tensor was resident
        return kept, held

    assert kept_after_free("system")[0] < 50  # glibc's default: the tensor's mmap is unmapped when freed
    kept, held = kept_after_free("keep")
    assert kept >= held - 10  # kept in the heap: the next pass's tensors reuse mapped pages
