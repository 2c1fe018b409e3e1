"""The Batch API's state in ``--serve-dir``: uploaded files, batches, their outputs, per API key.

    DIR/files/<file id>, <file id>.json   an upload's bytes (always under a generated id), its file object
    DIR/batches/<batch id>.json           the batch object (status, times, counts, output file ids)
    DIR/batches/<batch id>/output.jsonl   its results: the journaled writer's output (``.partial`` meanwhile)
    DIR/keys/<key name>/files, .../batches   the same per named API key (the unnamed key: the folders above)

A key sees only its own files and batches (another key's ids answer 404), within :class:`StoreLimits`.
Every change is written atomically and durably before it is reported, so a server killed at any moment
resumes each unfinished batch from its journal; an unreadable record is logged and set aside, never
stops the server. Rank 0 reads the outputs: with P > 1 on several nodes the folder must be on a
filesystem every rank sees. All methods are thread-safe.
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
import uuid
from pathlib import Path

import orjson

from tasks.files import write_atomic
from tasks.inflight import crashed_runs, inflight_path
from tasks.writer import journal_path

from tasks.batch_checks import CheckError, check_input, check_metadata, check_window, unanswered_lines
from tasks.serve_dir import FILE_MODE, make_private_dir
from tasks.batch_records import (DEFAULT_OWNER, MAX_CRASHES, BatchJob, StoreError, StoreLimits, count_lines,
                                 is_error, page, valid_id)

log = logging.getLogger(__name__)

ENDPOINTS = ("/v1/completions", "/v1/chat/completions")
ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")
ENDED = ("completed", "failed", "cancelled", "expired")


def _batch_object(bid: str, owner: str, now: int, **fields) -> dict:
    """A batch object in OpenAI's field order: ``fields`` set, every other time and id unset."""
    return {"id": bid, "object": "batch", "endpoint": None, "errors": None, "input_file_id": None,
            "completion_window": "24h", "status": "validating", "output_file_id": None, "error_file_id": None,
            "created_at": now, "in_progress_at": None, "expires_at": now + 86400, "finalizing_at": None,
            "completed_at": None, "failed_at": None, "expired_at": None, "cancelling_at": None, "cancelled_at": None,
            "request_counts": {"total": 0, "completed": 0, "failed": 0}, "metadata": None, "_owner": owner} | fields


class BatchStore:
    def __init__(self, root: str | Path, limits: StoreLimits | None = None):
        self.root = make_private_dir(Path(root))
        self.limits = limits or StoreLimits()
        self.lock = threading.RLock()
        self.files: dict[str, dict] = {}  # id -> file object (+ "_owner", not saved: the folder says it)
        self.batches: dict[str, dict] = {}
        self._disk_checked, self._disk_low = 0.0, False
        # uploads stream into this folder (serve/file_upload.py) and move into their key's folder when complete;
        # a crash mid-upload leaves a .part file there, removed at the next start
        self.uploads_dir = make_private_dir(self.root / "uploads")
        for part in self.uploads_dir.glob("*.part"):
            part.unlink(missing_ok=True)
        owners = [DEFAULT_OWNER] + sorted(p.name for p in (self.root / "keys").glob("*") if p.is_dir())
        for owner in owners:
            self._load(owner)

    # -- folders and records ---------------------------------------------------------------
    def _dir(self, owner: str, kind: str) -> Path:
        base = self.root if owner == DEFAULT_OWNER else self.root / "keys" / owner
        return make_private_dir(base / kind)

    def _load(self, owner: str) -> None:
        for path in sorted(self._dir(owner, "files").glob("*.json")):
            obj = self._read(path, ("purpose", "bytes", "created_at"))
            if obj is not None:
                if not isinstance(obj.get("expires_at"), int):  # written by a version without expiry
                    life = self.limits.retention_s if obj["purpose"] == "batch_output" else self.limits.file_expiry_s
                    obj["expires_at"] = int(obj["created_at"]) + life
                self.files[obj["id"]] = dict(obj, _owner=owner)
        for path in sorted(self._dir(owner, "batches").glob("*.json")):
            obj = self._read(path, ("status", "endpoint", "request_counts", "created_at"))
            if obj is not None and not valid_id(obj.get("input_file_id")):
                log.error("%s: its input_file_id %r is not a file id; the batch is marked failed", path,
                          str(obj.get("input_file_id"))[:80])
                obj = None
            if obj is None and valid_id(path.stem):  # the batch is reported failed, its answered lines delivered
                now = int(path.stat().st_mtime)
                obj = _batch_object(path.stem, owner, now, status="failed", failed_at=now)
                self._end(obj, "failed", "the server could not read this batch's record after a restart (it was "
                                         "damaged); the requests answered before are in the output file")
            if obj is not None:
                self.batches[obj["id"]] = dict(obj, _owner=owner)

    @staticmethod
    def _read(path: Path, needs: tuple[str, ...]) -> dict | None:
        """The record at ``path``, or None (logged) when it is unreadable, torn or names ids that are not ids."""
        try:
            obj = orjson.loads(path.read_bytes())
            assert isinstance(obj, dict) and obj.get("id") == path.stem and valid_id(path.stem)
            assert all(k in obj for k in needs)
            for key in ("output_file_id", "error_file_id"):
                assert obj.get(key) is None or valid_id(obj[key])
            return obj
        except (OSError, orjson.JSONDecodeError, AssertionError):
            log.error("%s: not a valid record (empty, torn by a power loss, or edited); set aside", path)
            return None

    def _save(self, obj: dict) -> None:
        folder = self._dir(obj["_owner"], "batches" if obj["object"] == "batch" else "files")
        write_atomic(folder / f"{obj['id']}.json", orjson.dumps(self.public(obj)), mode=FILE_MODE)

    @staticmethod
    def public(b: dict) -> dict:
        return {k: v for k, v in b.items() if not k.startswith("_")}

    # -- files ------------------------------------------------------------------------------
    def add_file(self, owner: str, data: bytes | Path, filename: str, purpose: str, fid: str | None = None,
                 expires_after: int | None = None) -> dict:
        """Store an upload (``data``: its bytes, or a file to move in) under a new id, within the key's quota."""
        fid = fid or "file-" + uuid.uuid4().hex[:24]
        size = data.stat().st_size if isinstance(data, Path) else len(data)
        now = int(time.time())
        life = expires_after or (self.limits.retention_s if purpose == "batch_output" else self.limits.file_expiry_s)
        obj = {"id": fid, "object": "file", "bytes": size, "created_at": now,
               "filename": Path(filename or "upload.jsonl").name[:255], "purpose": purpose, "status": "processed",
               "expires_at": now + life, "status_details": None, "_owner": owner}
        with self.lock:
            if purpose == "batch":  # outputs always land: their key made room before it created the batch
                self._check_quota(owner, size)
            path = self._dir(owner, "files") / fid
            if isinstance(data, Path):
                data.chmod(FILE_MODE)
                data.replace(path)
            else:
                write_atomic(path, data, mode=FILE_MODE)
            self._save(obj)
            self.files[fid] = obj
        return self.public(obj)

    def _check_quota(self, owner: str, size: int) -> None:
        mine = [f for f in self.files.values() if f["_owner"] == owner]
        used = sum(f["bytes"] for f in mine)
        if len(mine) + 1 > self.limits.max_files:
            raise StoreError(f"this API key holds {len(mine)} files, the most the server keeps per key "
                             f"({self.limits.max_files}); delete some (DELETE /v1/files/ID) first", 429, "file",
                             "insufficient_quota", "files_quota_exceeded")
        if used + size > self.limits.max_bytes:
            raise StoreError(f"this file of {size} bytes would bring this API key's stored bytes to {used + size}, "
                             f"over the server's {self.limits.max_bytes} per key; delete some files first", 413,
                             "file", "insufficient_quota", "storage_quota_exceeded")

    def _own_file(self, owner: str, fid: str) -> dict:
        f = self.files.get(fid) if valid_id(fid) else None
        if f is None or f["_owner"] != owner or f["expires_at"] <= time.time():
            raise StoreError(f"no file with id {fid[:80]!r}", 404, "file_id", code="not_found")
        return f

    def file(self, owner: str, fid: str) -> dict:
        with self.lock:
            return self.public(self._own_file(owner, fid))

    def file_path(self, owner: str, fid: str) -> Path:
        with self.lock:
            f = self._own_file(owner, fid)
            path = self._dir(owner, "files") / f["id"]
        if not path.is_file():
            raise StoreError(f"the content of file {fid} is gone from the server's storage", 404, "file_id",
                             code="not_found")
        return path

    def list_files(self, owner: str, purpose: str | None, limit: int, after: str | None, order: str) -> dict:
        with self.lock:
            now = time.time()
            files = sorted((f for f in self.files.values() if f["_owner"] == owner and f["expires_at"] > now),
                           key=lambda f: (f["created_at"], f["id"]), reverse=order != "asc")
            files = [self.public(f) for f in files if purpose is None or f["purpose"] == purpose]
        return page(files, after, limit)

    def delete_file(self, owner: str, fid: str) -> dict:
        """Remove a file (not the input of an unfinished batch: a restart resumes from it)."""
        with self.lock:
            self._own_file(owner, fid)
            users = [b["id"] for b in self.batches.values() if b["input_file_id"] == fid and b["status"] in ACTIVE]
            if users:
                raise StoreError(f"the file {fid} is the input of batch {users[0]}, which has not finished; "
                                 "cancel the batch or wait for it", 400, "file_id")
            self._remove_file(fid)
        return {"id": fid, "object": "file", "deleted": True}

    def _remove_file(self, fid: str) -> None:
        f = self.files.pop(fid)
        folder = self._dir(f["_owner"], "files")
        for path in (folder / f"{fid}.json", folder / fid):
            path.unlink(missing_ok=True)

    # -- batches ----------------------------------------------------------------------------
    def create_batch(self, owner: str, body: dict) -> dict:
        """Validate as OpenAI does (endpoint, window, metadata, the input file's purpose and lines), then queue."""
        fid, endpoint = body.get("input_file_id"), body.get("endpoint")
        if endpoint not in ENDPOINTS:
            raise CheckError(f"'endpoint' must be one of {', '.join(ENDPOINTS)}, got {str(endpoint)[:80]!r}",
                             "endpoint", "invalid_endpoint")
        if not isinstance(fid, str):
            raise CheckError("'input_file_id' is required", "input_file_id")
        window = check_window(body.get("completion_window", "24h"))
        metadata = check_metadata(body.get("metadata"))
        with self.lock:
            f = self._own_file(owner, fid)
        if f["purpose"] != "batch":
            raise CheckError(f"the file {fid} has purpose {f['purpose']!r}; a batch's input must be a file "
                             "uploaded with purpose 'batch'", "input_file_id", "invalid_input_file")
        total = check_input(self.file_path(owner, fid), endpoint)
        now = int(time.time())
        obj = _batch_object("batch_" + uuid.uuid4().hex[:24], owner, now, endpoint=endpoint, input_file_id=fid,
                            expires_at=now + window, request_counts={"total": total, "completed": 0, "failed": 0},
                            metadata=metadata)
        with self.lock:
            self._save(obj)
            self.batches[obj["id"]] = obj
            return self._copy(obj)

    def _own_batch(self, owner: str, bid: str) -> dict:
        b = self.batches.get(bid) if valid_id(bid) else None
        if b is None or b["_owner"] != owner:
            raise StoreError(f"no batch with id {bid[:80]!r}", 404, "batch_id", code="not_found")
        return b

    def _copy(self, b: dict) -> dict:
        return orjson.loads(orjson.dumps(self.public(b)))

    def batch(self, owner: str, bid: str) -> dict:
        with self.lock:
            return self._copy(self._own_batch(owner, bid))

    def list_batches(self, owner: str, after: str | None, limit: int) -> dict:
        with self.lock:
            mine = sorted((b for b in self.batches.values() if b["_owner"] == owner),
                          key=lambda b: (-b["created_at"], b["id"]))
            data = [self._copy(b) for b in mine]
        return page(data, after, limit)

    def cancel(self, owner: str, bid: str) -> dict:
        with self.lock:
            b = self._own_batch(owner, bid)
            if b["status"] in ("validating", "in_progress", "finalizing"):
                b.update(status="cancelling", cancelling_at=int(time.time()))
                self._save(b)
            return self._copy(b)

    # -- the engine's side ------------------------------------------------------------------
    def next_job(self) -> BatchJob | None:
        """The oldest unfinished batch (a restarted server resumes it from its journal); batches whose
        window passed before they ran end ``expired`` here, cancelled ones that never ran ``cancelled``, and
        one whose last runs each ended the server before it journaled another line ``failed``."""
        with self.lock:
            active = sorted((b for b in self.batches.values() if b["status"] in ACTIVE), key=lambda b: b["created_at"])
            for b in active:
                if b["status"] == "cancelling" and b["in_progress_at"] is None:
                    self._end(b, "cancelled")
                elif self.is_expired(b["id"]):
                    self._end(b, "expired")
                else:
                    out = self._output(b)
                    make_private_dir(out.parent)
                    journal = journal_path(out)
                    crashes = crashed_runs(inflight_path(journal), count_lines(journal))
                    if crashes >= MAX_CRASHES:  # a line that ends the server is answered with an error by
                        self._end(b, "failed", f"the server ended {crashes} times in a row while running this "
                                  "batch, without answering another line; it is not run again")  # then: tasks.inflight
                        continue
                    inp = self._dir(b["_owner"], "files") / b["input_file_id"]
                    return BatchJob(b["id"], str(inp), str(out), b["request_counts"]["total"])
            return None

    def _output(self, b: dict) -> Path:
        return self._dir(b["_owner"], "batches") / b["id"] / "output.jsonl"

    def is_expired(self, bid: str) -> bool:
        with self.lock:
            return self.batches[bid]["expires_at"] <= time.time()

    def cancel_requested(self, bid: str) -> bool:
        with self.lock:
            return self.batches[bid]["status"] == "cancelling"

    def started(self, bid: str, skip: int) -> None:
        """The batch's journal is open with ``skip`` lines answered before."""
        failed = 0
        with self.lock:
            journal = journal_path(self._output(self.batches[bid]))
        if skip and journal.exists():
            with open(journal, "rb") as f:
                failed = sum(1 for _, line in zip(range(skip), f) if is_error(line))
        with self.lock:
            b = self.batches[bid]
            b["_before"] = [skip - failed, failed]
            b["request_counts"].update(completed=skip - failed, failed=failed)
            if b["status"] == "validating":
                b.update(status="in_progress", in_progress_at=int(time.time()))
            self._save(b)

    def progress(self, bid: str, completed: int, failed: int) -> None:
        with self.lock:
            b = self.batches[bid]
            ok, bad = b.get("_before", [0, 0])
            b["request_counts"].update(completed=ok + completed, failed=bad + failed)

    def finish(self, bid: str, expired: bool = False) -> None:
        """The output is written (every line, or those before a cancel or the window's end): deliver it."""
        with self.lock:
            b = self.batches[bid]
            status = "expired" if expired else "cancelled" if b["status"] == "cancelling" else "completed"
            self._end(b, status)

    def fail(self, bid: str, message: str, deliver: bool = True) -> None:
        """The batch cannot go on: what it answered is delivered, the rest listed in its error file
        (``deliver`` false: its output could not be read, it is only marked failed)."""
        with self.lock:
            self._end(self.batches[bid], "failed", message, deliver)

    def _end(self, b: dict, status: str, message: str | None = None, deliver: bool = True) -> None:
        """Deliver a batch's answered lines (output and error files, as OpenAI does for every end) and
        mark it ``status``; the requests a failed or expired batch never ran get error lines of their own."""
        answered = self._answered(b) if deliver else []
        ok = [line for line in answered if not is_error(line)]
        bad = [line for line in answered if is_error(line)]
        inp = self._dir(b["_owner"], "files") / b["input_file_id"] if valid_id(b["input_file_id"]) else None
        code = {"failed": "batch_failed", "expired": "batch_expired", "cancelled": "batch_cancelled"}.get(status)
        if code and deliver and inp is not None and inp.is_file():
            why = message or ("The batch was cancelled before this request ran." if status == "cancelled" else
                              "This request could not be executed before the completion window expired.")
            bad += unanswered_lines(inp, len(answered), code, why)
        key = b["id"].split("_", 1)[1]
        if ok or status in ("completed", "cancelled"):  # a cancelled batch always has its (maybe empty) output
            b["output_file_id"] = self.add_file(b["_owner"], b"".join(ok), f"{b['id']}_output.jsonl",
                                                "batch_output", fid=f"file-{key}-output")["id"]
        if bad:
            b["error_file_id"] = self.add_file(b["_owner"], b"".join(bad), f"{b['id']}_errors.jsonl",
                                               "batch_output", fid=f"file-{key}-errors")["id"]
        now = int(time.time())
        b.pop("_before", None)
        b["request_counts"].update(completed=len(ok), failed=len(bad))
        b.update(status=status, finalizing_at=b.get("finalizing_at") or now, **{f"{status}_at": now})
        if message:
            b["errors"] = {"object": "list", "data": [{"code": code or "server_error", "message": message,
                                                       "param": None, "line": None}]}
        self._save(b)
        shutil.rmtree(self._output(b).parent, ignore_errors=True)  # delivered: the journal is not needed

    def _answered(self, b: dict) -> list[bytes]:
        """The batch's complete result lines so far: its output, else its journal (a torn last line is left out)."""
        out = self._output(b)
        for path in (out, journal_path(out)):
            if path.is_file():
                data = path.read_bytes()
                return [line + b"\n" for line in data[:data.rfind(b"\n") + 1].splitlines() if line.strip()]
        return []

    def disk_low(self) -> bool:
        """Less than the --min-free-disk-bytes left where the state lives (checked at most once a second):
        batches pause (interactive requests go on), so a full disk never ends the server."""
        now = time.monotonic()
        if now - self._disk_checked >= 1.0:
            self._disk_checked = now
            low = shutil.disk_usage(self.root).free < self.limits.min_free_bytes
            if low != self._disk_low:
                (log.error if low else log.warning)(
                    "%s: %s", self.root, f"less than {self.limits.min_free_bytes} bytes free: batches pause" if low
                    else "disk space is back: batches go on")
            self._disk_low = low
        return self._disk_low

    def sweep(self) -> None:
        """Delete expired files, and ended batches (with their output files) past --batch-retention-hours."""
        now = time.time()
        with self.lock:
            busy = {b["input_file_id"] for b in self.batches.values() if b["status"] in ACTIVE}
            for fid in [f["id"] for f in self.files.values() if f["expires_at"] <= now and f["id"] not in busy]:
                self._remove_file(fid)
            for b in [b for b in self.batches.values() if b["status"] in ENDED]:
                ended = max(b.get(f"{s}_at") or 0 for s in ENDED)
                if ended + self.limits.retention_s <= now:
                    del self.batches[b["id"]]
                    (self._dir(b["_owner"], "batches") / f"{b['id']}.json").unlink(missing_ok=True)
