"""The Batch API store's small parts: ids, key names, limits, errors, and reading output lines."""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

import orjson

from tasks.protocol import RequestError

_ID = re.compile(r"^(file|batch)[-_][A-Za-z0-9_-]{1,64}$")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
DEFAULT_OWNER = "default"  # the key without a name (or no key): the top-level files/ and batches/


@dataclass(frozen=True)
class StoreLimits:
    """Per-key quotas and lifetimes (flags --key-storage-bytes ... --min-free-disk-bytes)."""

    max_bytes: int = 10 << 30
    max_files: int = 1000
    file_expiry_s: int = 30 * 86400
    retention_s: int = 30 * 86400
    min_free_bytes: int = 256 << 20


MAX_CRASHES = 3  # runs of one batch in a row that ended the server without journaling a line or narrowing
# the suspects (tasks.inflight.crashed_runs): it fails


@dataclass
class BatchJob:
    id: str
    input: str
    output: str
    total: int


class StoreError(RequestError):
    """A Batch API refusal: HTTP ``status`` with OpenAI's error object, its ``code`` included."""

    def __init__(self, message: str, status: int = 400, param: str | None = None, kind: str = "invalid_request_error",
                 code: str | None = None):
        super().__init__(message, param, kind, status=status)
        self.code = code


def owner_slug(name: str | None) -> str:
    """A key's name -> its folder name under keys/ (names that are not plain get a hash)."""
    name = name or DEFAULT_OWNER
    return name if _NAME.match(name) else "h-" + hashlib.sha256(name.encode()).hexdigest()[:24]


def valid_id(value) -> bool:
    return isinstance(value, str) and bool(_ID.match(value))


def page(items: list[dict], after: str | None, limit: int) -> dict:
    if after:
        ids = [x["id"] for x in items]
        items = items[ids.index(after) + 1:] if after in ids else []
    page = items[:limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit}


def is_error(line: bytes) -> bool:
    """An output line holding an error (or not readable as a result at all)."""
    try:
        obj = orjson.loads(line)
    except orjson.JSONDecodeError:
        return True
    return not isinstance(obj, dict) or obj.get("error") is not None


def count_lines(path: Path) -> int:
    try:
        with open(path, "rb") as f:
            return sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 20), b""))
    except OSError:
        return 0
