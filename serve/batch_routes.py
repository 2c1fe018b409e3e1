"""The Batch API endpoints: ``/v1/files`` and ``/v1/batches`` (state in :class:`tasks.batch_store.BatchStore`).

Every call acts for the API key that made it (:func:`owner_of`): a key lists, reads, cancels and
deletes only its own files and batches; another key's ids answer 404, as ids that do not exist.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse
from starlette.concurrency import run_in_threadpool

from tasks.batch_checks import check_expires_after
from tasks.batch_records import StoreError, owner_slug
from serve.responses import error, ok, read_json
from serve.file_upload import receive_upload


STORAGE_FULL = "the server could not store this (its disk is full); try again later"


def owner_of(request: Request) -> str:
    """The store's name for the key that authenticated ``request`` (the authentication middleware sets
    ``request.state.key_name``; without keys, or for the unnamed key, everyone is "default")."""
    return owner_slug(getattr(request.state, "key_name", None))


def add_batch_routes(app: FastAPI, state) -> None:
    store = state.store

    @app.post("/v1/files")
    async def upload(request: Request):
        """The body streamed into the store's folder, counted against --max-upload-bytes as it comes."""
        up = None
        try:
            up = await receive_upload(request.headers.get("content-type", ""), request.stream(), store.uploads_dir,
                                      state.max_upload_bytes)
            purpose = up.fields.get("purpose")
            if purpose != "batch":
                return error(400, f"'purpose' must be 'batch', got {purpose!r}", param="purpose")
            expires = check_expires_after(up.fields.get("expires_after[anchor]"),
                                          up.fields.get("expires_after[seconds]"))
            return ok(await run_in_threadpool(store.add_file, owner_of(request), up.path,
                                              up.filename or "upload.jsonl", purpose, None, expires))
        except OSError:  # a full disk: the server goes on, the client may retry (no path in the message)
            return error(503, STORAGE_FULL, "server_error", headers={"Retry-After": "60"})
        finally:
            if up is not None:  # receive_upload removes what it wrote when it fails
                up.discard()  # nothing left once the store took it

    @app.get("/v1/files")
    async def list_files(request: Request, purpose: str | None = None, limit: int = 10000, after: str | None = None,
                         order: str = "desc"):
        if order not in ("asc", "desc"):
            return error(400, f"'order' must be 'asc' or 'desc', got {order!r}", param="order")
        return ok(store.list_files(owner_of(request), purpose, max(1, min(limit, 10000)), after, order))

    @app.delete("/v1/files/{fid}")
    async def delete_file(request: Request, fid: str):
        return ok(store.delete_file(owner_of(request), fid))

    @app.get("/v1/files/{fid}")
    async def get_file(request: Request, fid: str):
        return ok(store.file(owner_of(request), fid))

    @app.get("/v1/files/{fid}/content")
    async def file_content(request: Request, fid: str):
        return FileResponse(store.file_path(owner_of(request), fid), media_type="application/jsonl")

    @app.post("/v1/batches")
    async def create_batch(request: Request):
        try:
            body = await read_json(request)
            if not isinstance(body, dict):
                raise StoreError("the body must be a JSON object")
            # reads the whole input file (up to 50,000 lines): off the event loop
            return ok(await run_in_threadpool(store.create_batch, owner_of(request), body))
        except OSError:
            return error(503, STORAGE_FULL, "server_error", headers={"Retry-After": "60"})
        except StoreError as e:
            return error(400 if e.status == 404 else e.status, e.message, e.kind, param=e.param, code=e.code)

    @app.get("/v1/batches")
    async def list_batches(request: Request, after: str | None = None, limit: int = 20):
        return ok(store.list_batches(owner_of(request), after, max(1, min(limit, 100))))

    @app.get("/v1/batches/{bid}")
    async def get_batch(request: Request, bid: str):
        return ok(store.batch(owner_of(request), bid))

    @app.post("/v1/batches/{bid}/cancel")
    async def cancel_batch(request: Request, bid: str):
        return ok(store.cancel(owner_of(request), bid))
