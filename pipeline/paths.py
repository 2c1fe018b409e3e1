"""Where the project keeps what it builds once per machine (compiled kernels, benchmark models).

A leaf module: it imports only the standard library, so every layer may use it.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """``$DIST_INFER_CACHE`` if set, else ``~/.cache/dist-inference-runner`` (benchmarks' models)."""
    env = os.environ.get("DIST_INFER_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "dist-inference-runner"
