"""The Batch API's state in ``--serve-dir``: uploaded files, batches, their outputs.

    DIR/files/<file id>          an uploaded file's bytes (always under a generated id)
    DIR/files/<file id>.json     its OpenAI file object
    DIR/batches/<batch id>.json  the batch object (status, times, counts, output file ids)
    DIR/batches/<batch id>/output.jsonl   the batch's results: the journaled writer's output
                                          (``output.jsonl.partial`` while it runs)

Every state change is written atomically before it is reported, so a server killed at any moment
and started again on the same folder finds each unfinished batch and resumes it from its journal
(the writer's exactly-once guarantee). Rank 0 reads the outputs, so with P > 1 over several nodes
the folder must be on a filesystem every rank sees. All methods are thread-safe.
"""

from __future__ import annotations

import re
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import orjson

from tasks.files import write_atomic
from tasks.inflight import crashed_runs, inflight_path
from tasks.writer import journal_path

ENDPOINTS = ("/v1/completions", "/v1/chat/completions")
ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")
_ID = re.compile(r"^(file|batch)[-_][A-Za-z0-9_-]{1,64}$")
MAX_CRASHES = 3  # runs of one batch in a row that ended the server without journaling a line: it fails


@dataclass
class BatchJob:
    id: str
    input: str
    output: str
    total: int


class StoreError(ValueError):
    def __init__(self, message: str, status: int = 400, param: str | None = None):
        super().__init__(message)
        self.message, self.status, self.param = message, status, param


class BatchStore:
    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.files_dir, self.batches_dir = self.root / "files", self.root / "batches"
        self.files_dir.mkdir(parents=True, exist_ok=True)
        self.batches_dir.mkdir(parents=True, exist_ok=True)
        self.lock = threading.RLock()
        self.files = {p.stem: orjson.loads(p.read_bytes()) for p in self.files_dir.glob("*.json")}
        self.batches = {p.stem: orjson.loads(p.read_bytes()) for p in self.batches_dir.glob("*.json")}

    # -- files ------------------------------------------------------------------------------
    def add_file(self, data: bytes, filename: str, purpose: str, fid: str | None = None) -> dict:
        fid = fid or "file-" + uuid.uuid4().hex[:24]
        obj = {"id": fid, "object": "file", "bytes": len(data), "created_at": int(time.time()),
               "filename": Path(filename or "upload.jsonl").name[:255], "purpose": purpose, "status": "processed",
               "expires_at": None, "status_details": None}
        write_atomic(self.files_dir / fid, data)
        with self.lock:
            self._save(self.files_dir, obj)
            self.files[fid] = obj
        return obj

    def file(self, fid: str) -> dict:
        with self.lock:
            if not _ID.match(fid) or fid not in self.files:
                raise StoreError(f"no file with id {fid!r}", 404, "file_id")
            return dict(self.files[fid])

    def file_path(self, fid: str) -> Path:
        self.file(fid)
        return self.files_dir / fid

    def list_files(self, purpose: str | None, limit: int, after: str | None, order: str) -> dict:
        with self.lock:
            files = sorted(self.files.values(), key=lambda f: (f["created_at"], f["id"]), reverse=order != "asc")
        files = [f for f in files if purpose is None or f["purpose"] == purpose]
        if after:
            ids = [f["id"] for f in files]
            files = files[ids.index(after) + 1:] if after in ids else []
        page = [dict(f) for f in files[:limit]]
        return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None, "has_more": len(files) > limit}

    def delete_file(self, fid: str) -> dict:
        """Remove a file (not the input of an unfinished batch: a restart resumes from it)."""
        with self.lock:
            self.file(fid)
            users = [b["id"] for b in self.batches.values() if b["input_file_id"] == fid and b["status"] in ACTIVE]
            if users:
                raise StoreError(f"the file {fid} is the input of batch {users[0]}, which has not finished; "
                                 "cancel the batch or wait for it", 400, "file_id")
            del self.files[fid]
            for path in (self.files_dir / f"{fid}.json", self.files_dir / fid):
                path.unlink(missing_ok=True)
        return {"id": fid, "object": "file", "deleted": True}

    # -- batches ----------------------------------------------------------------------------
    def create_batch(self, body: dict) -> dict:
        fid, endpoint = body.get("input_file_id"), body.get("endpoint")
        if endpoint not in ENDPOINTS:
            raise StoreError(f"'endpoint' must be one of {', '.join(ENDPOINTS)}, got {endpoint!r}", 400, "endpoint")
        if not isinstance(fid, str):
            raise StoreError("'input_file_id' is required", 400, "input_file_id")
        window = body.get("completion_window", "24h")
        metadata = body.get("metadata")
        if metadata is not None and not isinstance(metadata, dict):
            raise StoreError("'metadata' must be an object", 400, "metadata")
        path = self.file_path(fid)
        with open(path, "rb") as f:
            total = sum(1 for line in f if line.strip())
        now = int(time.time())
        obj = {"id": "batch_" + uuid.uuid4().hex[:24], "object": "batch", "endpoint": endpoint, "errors": None,
               "input_file_id": fid, "completion_window": window, "status": "validating", "output_file_id": None,
               "error_file_id": None, "created_at": now, "in_progress_at": None, "expires_at": now + 86400,
               "finalizing_at": None, "completed_at": None, "failed_at": None, "expired_at": None,
               "cancelling_at": None, "cancelled_at": None,
               "request_counts": {"total": total, "completed": 0, "failed": 0}, "metadata": metadata}
        with self.lock:
            self._save(self.batches_dir, obj)
            self.batches[obj["id"]] = obj
        return dict(obj)

    def batch(self, bid: str) -> dict:
        with self.lock:
            if not _ID.match(bid) or bid not in self.batches:
                raise StoreError(f"no batch with id {bid!r}", 404, "batch_id")
            return orjson.loads(orjson.dumps(self.public(self.batches[bid])))

    def list_batches(self, after: str | None, limit: int) -> dict:
        with self.lock:
            ordered = sorted(self.batches.values(), key=lambda b: (-b["created_at"], b["id"]))
        if after:
            ids = [b["id"] for b in ordered]
            ordered = ordered[ids.index(after) + 1:] if after in ids else []
        page = [self.public(b) for b in ordered[:limit]]
        return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None, "has_more": len(ordered) > limit}

    def cancel(self, bid: str) -> dict:
        with self.lock:
            b = self.batches.get(bid) if _ID.match(bid) else None
            if b is None:
                raise StoreError(f"no batch with id {bid!r}", 404, "batch_id")
            if b["status"] in ("validating", "in_progress", "finalizing"):
                b.update(status="cancelling", cancelling_at=int(time.time()))
                self._save(self.batches_dir, b)
            return self.batch(bid)

    # -- the engine's side ------------------------------------------------------------------
    def next_job(self) -> BatchJob | None:
        """The oldest unfinished batch (a restarted server resumes it from its journal). A batch whose
        last runs each ended the server before it journaled another line fails instead, with what it
        has (a line that ends the server is answered with an error by then: tasks.inflight)."""
        while True:
            with self.lock:
                active = sorted((b for b in self.batches.values() if b["status"] in ACTIVE),
                                key=lambda b: b["created_at"])
                if not active:
                    return None
                b = active[0]
                out = self.batches_dir / b["id"] / "output.jsonl"
                out.parent.mkdir(exist_ok=True)
                journal = journal_path(out)
                crashes = crashed_runs(inflight_path(journal), _lines(journal))
                if crashes < MAX_CRASHES:
                    return BatchJob(b["id"], str(self.files_dir / b["input_file_id"]), str(out),
                                    b["request_counts"]["total"])
            self.fail(b["id"], f"the server ended {crashes} times in a row while running this batch, without "
                               "answering another line; it is not run again")

    def cancel_requested(self, bid: str) -> bool:
        with self.lock:
            return self.batches[bid]["status"] == "cancelling"

    def started(self, bid: str, skip: int) -> None:
        """The batch's journal is open with ``skip`` lines answered before."""
        failed = 0
        journal = journal_path(self.batches_dir / bid / "output.jsonl")
        if skip and journal.exists():
            with open(journal, "rb") as f:
                failed = sum(1 for _, line in zip(range(skip), f) if _is_error(line))
        with self.lock:
            b = self.batches[bid]
            b["_before"] = [skip - failed, failed]
            b["request_counts"].update(completed=skip - failed, failed=failed)
            if b["status"] == "validating":
                b.update(status="in_progress", in_progress_at=int(time.time()))
            self._save(self.batches_dir, b)

    def progress(self, bid: str, completed: int, failed: int) -> None:
        with self.lock:
            b = self.batches[bid]
            ok, bad = b.get("_before", [0, 0])
            b["request_counts"].update(completed=ok + completed, failed=bad + failed)

    def finish(self, bid: str) -> None:
        """The output is complete: split it into the output and error files, mark the batch done."""
        with self.lock:
            b = self.batches[bid]
        ok, bad = self._split(self.batches_dir / bid / "output.jsonl")
        key = bid.split("_", 1)[1]
        out_obj = self.add_file(b"".join(ok), f"{bid}_output.jsonl", "batch_output", fid=f"file-{key}-output")
        err_obj = self.add_file(b"".join(bad), f"{bid}_errors.jsonl", "batch_output", fid=f"file-{key}-errors") if bad else None
        now = int(time.time())
        with self.lock:
            cancelled = b["status"] == "cancelling"
            b.pop("_before", None)
            b["request_counts"].update(completed=len(ok), failed=len(bad))
            b.update(status="cancelled" if cancelled else "completed", output_file_id=out_obj["id"],
                     error_file_id=err_obj["id"] if err_obj else None, finalizing_at=now,
                     **({"cancelled_at": now} if cancelled else {"completed_at": now}))
            self._save(self.batches_dir, b)

    def fail(self, bid: str, message: str, deliver: bool = True) -> None:
        """The batch cannot run (on): marked failed, with the lines it answered delivered as its output
        and error files (unless ``deliver`` is false: they could not be read)."""
        ids, counts = {}, {}
        if deliver:
            out = self.batches_dir / bid / "output.jsonl"
            try:
                ok, bad = self._split(out if out.exists() else journal_path(out))
                key = bid.split("_", 1)[1]
                if ok or bad:
                    ids["output_file_id"] = self.add_file(b"".join(ok), f"{bid}_output.jsonl", "batch_output",
                                                          fid=f"file-{key}-output")["id"]
                if bad:
                    ids["error_file_id"] = self.add_file(b"".join(bad), f"{bid}_errors.jsonl", "batch_output",
                                                         fid=f"file-{key}-errors")["id"]
                counts = {"completed": len(ok), "failed": len(bad)}
            except OSError:
                pass  # no output yet
        with self.lock:
            b = self.batches[bid]
            b.pop("_before", None)
            b["request_counts"].update(counts)
            b.update(status="failed", failed_at=int(time.time()), **ids,
                     errors={"object": "list", "data": [{"code": "server_error", "message": message}]})
            self._save(self.batches_dir, b)

    @staticmethod
    def _split(path: Path) -> tuple[list[bytes], list[bytes]]:
        """A batch output's lines: (answered, errors); a line that is not a JSON object counts as an error."""
        ok, bad = [], []
        with open(path, "rb") as f:
            for line in f:
                if line.strip():
                    (bad if _is_error(line) else ok).append(line if line.endswith(b"\n") else line + b"\n")
        return ok, bad

    def public(self, b: dict) -> dict:
        return {k: v for k, v in b.items() if not k.startswith("_")}

    @staticmethod
    def _save(folder: Path, obj: dict) -> None:
        write_atomic(folder / f"{obj['id']}.json", orjson.dumps({k: v for k, v in obj.items() if not k.startswith("_")}))


def _is_error(line: bytes) -> bool:
    """An output line holding an error (or not readable as a result at all)."""
    try:
        obj = orjson.loads(line)
    except orjson.JSONDecodeError:
        return True
    return not isinstance(obj, dict) or obj.get("error") is not None


def _lines(path: Path) -> int:
    try:
        with open(path, "rb") as f:
            return sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 20), b""))
    except OSError:
        return 0
