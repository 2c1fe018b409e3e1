"""The Batch API endpoints: ``/v1/files`` and ``/v1/batches`` (state in :class:`serve.batches.BatchStore`)."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse

from .batches import StoreError


def add_batch_routes(app: FastAPI, state) -> None:
    from .app import error, ok, read_json
    from .upload import receive_upload

    store = state.store

    @app.exception_handler(StoreError)
    async def store_error(request, exc: StoreError):  # an unknown id (404) or a request the store refuses
        return error(exc.status, exc.message, param=exc.param)

    @app.post("/v1/files")
    async def upload(request: Request):
        """The body streamed into the store's folder, counted against --max-upload-bytes as it comes."""
        up = await receive_upload(request.headers.get("content-type", ""), request.stream(), store.files_dir,
                                  state.max_upload_bytes)
        try:
            purpose = up.fields.get("purpose")
            if purpose != "batch":
                return error(400, f"'purpose' must be 'batch', got {purpose!r}", param="purpose")
            return ok(store.add_file(up.path, up.filename or "upload.jsonl", purpose))
        finally:
            up.discard()  # nothing left once the store took it

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
