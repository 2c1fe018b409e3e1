"""The Batch API endpoints: ``/v1/files`` and ``/v1/batches`` (state in :class:`serve.batches.BatchStore`)."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse

from .batches import StoreError


def add_batch_routes(app: FastAPI, state, upload_limit: int) -> None:
    from .app import error, ok, read_json

    store = state.store

    @app.exception_handler(StoreError)
    async def store_error(request, exc: StoreError):  # an unknown id (404) or a request the store refuses
        return error(exc.status, exc.message, param=exc.param)

    @app.post("/v1/files")
    async def upload(request: Request):
        try:
            form = await request.form(max_part_size=upload_limit)
        except Exception as e:  # noqa: BLE001 - a malformed multipart body
            return error(400, f"expected a multipart/form-data body with 'file' and 'purpose': {e}")
        purpose, upload = form.get("purpose"), form.get("file")
        if purpose != "batch":
            return error(400, f"'purpose' must be 'batch', got {purpose!r}", param="purpose")
        if upload is None or isinstance(upload, str):
            return error(400, "'file' is required (a JSONL file of Batch API requests)", param="file")
        data = await upload.read()
        if len(data) > upload_limit:
            return error(413, f"the file of {len(data)} bytes exceeds the limit of {upload_limit} bytes")
        return ok(store.add_file(data, upload.filename or "upload.jsonl", purpose))

    @app.get("/v1/files")
    async def list_files(purpose: str | None = None, limit: int = 10000, after: str | None = None,
                         order: str = "desc"):
        if order not in ("asc", "desc"):
            return error(400, f"'order' must be 'asc' or 'desc', got {order!r}", param="order")
        return ok(store.list_files(purpose, max(1, min(limit, 10000)), after, order))

    @app.delete("/v1/files/{fid}")
    async def delete_file(fid: str):
        return ok(store.delete_file(fid))

    @app.get("/v1/files/{fid}")
    async def get_file(fid: str):
        return ok(store.file(fid))

    @app.get("/v1/files/{fid}/content")
    async def file_content(fid: str):
        return FileResponse(store.file_path(fid), media_type="application/jsonl")

    @app.post("/v1/batches")
    async def create_batch(request: Request):
        try:
            body = await read_json(request, state.max_request_bytes)
            if not isinstance(body, dict):
                raise StoreError("the body must be a JSON object")
            return ok(store.create_batch(body))
        except StoreError as e:
            return error(400 if e.status == 404 else e.status, e.message, param=e.param)

    @app.get("/v1/batches")
    async def list_batches(after: str | None = None, limit: int = 20):
        return ok(store.list_batches(after, max(1, min(limit, 100))))

    @app.get("/v1/batches/{bid}")
    async def get_batch(bid: str):
        return ok(store.batch(bid))

    @app.post("/v1/batches/{bid}/cancel")
    async def cancel_batch(bid: str):
        return ok(store.cancel(bid))
