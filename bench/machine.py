"""The machine a figure was measured on, as the benchmarks print it (docs give figures per CPU)."""

from __future__ import annotations

import os
import platform
from pathlib import Path


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), else what the platform says."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def cpu_name() -> str:
    """The CPU's model name and how many cores this machine has."""
    return f"{cpu_model()}, {os.cpu_count()} cores"
