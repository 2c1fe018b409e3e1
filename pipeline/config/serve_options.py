"""Serve mode's flags checked before loading: keys (--api-key-file), hosts, the address (the limits' lower
bounds are on their fields, pipeline.config.options).
Imports nothing of the project (pipeline.config.options calls it; serve/ reads keys and the address here)."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

API_KEY_ENVS = ("DIST_INFER_API_KEY", "DIST_RUNNER_API_KEY")  # where a server's key, or a client's, may come from


def serve_problems(opts) -> list[str]:
    """Serve mode's keys (serve/auth.py) and hosts (its limits' bounds are on their fields)."""
    problems = []
    if opts.api_key and opts.api_key_file:
        problems.append("--api-key and --api-key-file both set the keys: pass only one (the file keeps keys out of ps)")
    if opts.api_key_file:
        try:
            read_key_file(opts.api_key_file)
        except ValueError as e:
            problems.append(str(e))
    for flag in ("allowed_hosts", "allowed_origins"):
        value = getattr(opts, flag)
        if value is not None and not [v for v in value.split(",") if v.strip()]:
            problems.append(f"--{flag.replace('_', '-')} is empty: give comma-separated values, or * for any")
    return problems


def read_key_file(path: str) -> dict[str, str]:
    """--api-key-file: {key: name}. One key a line: ``KEY``, ``NAME:KEY`` or ``KEY NAME``; blank lines and
    ``#`` comments skipped; a key without a name is named ``key-`` + the first 12 hex digits of its SHA-256
    (stable across edits of the file). ValueError saying what is wrong (never the key itself)."""
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--api-key-file {path}: cannot read it ({getattr(e, 'strerror', None) or e})") from None
    keys: dict[str, str] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split()
        if len(parts) == 2:
            key, name = parts
        elif len(parts) == 1 and ":" in line:
            name, key = line.split(":", 1)
        elif len(parts) == 1:
            key, name = line, "key-" + hashlib.sha256(line.encode()).hexdigest()[:12]
        else:
            raise ValueError(f"--api-key-file {path}: line {number} has {len(parts)} words; expected KEY, NAME:KEY or "
                             "'KEY NAME'")
        if not key or not re.match(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$", name):
            raise ValueError(f"--api-key-file {path}: line {number}: a key and a name of letters, digits, '.', '_', "
                             "'-' (at most 64) are needed")
        if key in keys:
            raise ValueError(f"--api-key-file {path}: line {number} repeats a key given before")
        if name in keys.values():
            raise ValueError(f"--api-key-file {path}: line {number}: the name {name!r} is given twice")
        keys[key] = name
    if not keys:
        raise ValueError(f"--api-key-file {path}: no keys in it (one a line: KEY, NAME:KEY or 'KEY NAME')")
    return keys


def serve_address(spec: str) -> tuple[str, int]:
    """``[HOST:]PORT`` -> (host, port); the host defaults to the loopback address."""
    host, _, port = spec.rpartition(":")
    if not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError(f"--serve {spec}: expected [HOST:]PORT, e.g. 8000 or 0.0.0.0:8000")
    return host.strip("[]") or "127.0.0.1", int(port)
