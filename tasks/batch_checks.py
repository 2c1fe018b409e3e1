"""What the Batch API refuses at create time, with OpenAI's limits (below), and the lines of requests a
batch never ran.
"""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Iterator
from pathlib import Path

import orjson

from tasks.batch_records import StoreError

WINDOWS = {"24h": 86400}  # completion_window -> seconds
MAX_BATCH_REQUESTS = 50_000
METADATA_PAIRS, METADATA_KEY, METADATA_VALUE = 16, 64, 512
EXPIRES_MIN, EXPIRES_MAX = 3600, 2592000  # a file's expires_after seconds: 1 hour .. 30 days


class CheckError(StoreError):
    """A create request OpenAI would refuse: HTTP 400 with this message, param and code."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message, 400, param, code=code)


def check_window(window) -> int:
    """``completion_window`` -> seconds (only "24h", as OpenAI)."""
    if window not in WINDOWS:
        raise CheckError(f"'completion_window' must be '24h', got {window!r}", "completion_window",
                         "invalid_completion_window")
    return WINDOWS[window]


def check_metadata(metadata) -> dict | None:
    if metadata is None:
        return None
    if not isinstance(metadata, dict):
        raise CheckError("'metadata' must be an object of string values", "metadata", "invalid_metadata")
    if len(metadata) > METADATA_PAIRS:
        raise CheckError(f"'metadata' may hold at most {METADATA_PAIRS} pairs, got {len(metadata)}", "metadata",
                         "invalid_metadata")
    for k, v in metadata.items():
        if len(k) > METADATA_KEY:
            raise CheckError(f"'metadata' keys may be at most {METADATA_KEY} characters; {k[:20]!r}... has {len(k)}",
                             "metadata", "invalid_metadata")
        if not isinstance(v, str) or len(v) > METADATA_VALUE:
            what = f"has {len(v)}" if isinstance(v, str) else "is not a string"
            raise CheckError(f"'metadata' values must be strings of at most {METADATA_VALUE} characters; the value "
                             f"of {k[:20]!r} {what}", "metadata", "invalid_metadata")
    return dict(metadata)


def check_input(path: Path, endpoint: str) -> int:
    """Count the batch's requests, refusing (with the line number) a duplicate ``custom_id``, a ``url``
    other than ``endpoint`` and more than MAX_BATCH_REQUESTS lines. A line that is not a JSON object is
    left to the run, which answers it with an error line in its place."""
    seen: set[str] = set()
    total = 0
    for number, line in _lines(path):
        total += 1
        if total > MAX_BATCH_REQUESTS:
            raise CheckError(f"a batch may hold at most {MAX_BATCH_REQUESTS} requests; this file has more",
                             "input_file_id", "too_many_requests")
        try:
            raw = orjson.loads(line)
        except orjson.JSONDecodeError:
            continue
        if not isinstance(raw, dict):
            continue
        url = raw.get("url")
        if url is not None and url != endpoint:
            raise CheckError(f"line {number}: its 'url' {str(url)[:80]!r} differs from the batch's endpoint "
                             f"{endpoint!r}; a batch holds requests to one endpoint", "input_file_id", "mismatched_url")
        cid = raw.get("custom_id")
        if cid is not None:
            key = str(cid)
            if key in seen:
                raise CheckError(f"line {number}: the custom_id {key[:80]!r} appears twice; each request of a batch "
                                 "needs its own", "input_file_id", "duplicate_custom_id")
            seen.add(key)
    return total


def check_expires_after(anchor, seconds) -> int | None:
    """A file's ``expires_after`` (form fields ``expires_after[anchor]``, ``expires_after[seconds]``) -> seconds."""
    if anchor is None and seconds is None:
        return None
    if anchor != "created_at":
        raise CheckError(f"'expires_after[anchor]' must be 'created_at', got {anchor!r}", "expires_after")
    try:
        value = int(seconds)
    except (TypeError, ValueError):
        raise CheckError(f"'expires_after[seconds]' must be an integer, got {seconds!r}", "expires_after") from None
    if not EXPIRES_MIN <= value <= EXPIRES_MAX:
        raise CheckError(f"'expires_after[seconds]' must be between {EXPIRES_MIN} and {EXPIRES_MAX}, got {value}",
                         "expires_after")
    return value


def _lines(path: Path) -> Iterator[tuple[int, bytes]]:
    """(line number from 1, line) of each non-blank line: the requests, in the order the run reads them."""
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            if line.strip():
                yield number, line


def unanswered_lines(path: Path, answered: int, code: str, message: str) -> list[bytes]:
    """Error lines (OpenAI's shape) for the requests after the first ``answered`` ones: what a failed or
    expired batch never ran, so the client can resubmit exactly those."""
    out = []
    for _, line in itertools.islice(_lines(path), answered, None):
        try:
            raw = orjson.loads(line)
        except orjson.JSONDecodeError:
            raw = None
        cid = raw.get("custom_id") if isinstance(raw, dict) else None
        out.append(orjson.dumps({"id": "batch_req_" + uuid.uuid4().hex[:24], "custom_id": cid, "response": None,
                                 "error": {"code": code, "message": message}}) + b"\n")
    return out
