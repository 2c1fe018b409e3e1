"""The HTTP endpoints (FastAPI), in OpenAI's request and response shapes, and the uvicorn thread.

Handlers only validate, hand requests to the pipeline thread (:mod:`serve.source`) and await the
answer; every error is an OpenAI error object ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import threading
import time
import uuid
from dataclasses import dataclass

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from tasks.requests import RequestError, json_problem, parse_body

from .batches import BatchStore, StoreError
from .source import Busy, Live, RequestSource, Unavailable
from .sse import DONE, ChunkMaker, event

log = logging.getLogger(__name__)

UPLOAD_FACTOR = 64  # uploaded files may be this many times --max-request-bytes


@dataclass
class ServeState:
    source: RequestSource
    store: BatchStore
    model: str
    api_key: str | None
    max_request_bytes: int
    created: int = 0
    adapters: tuple[str, ...] = ()  # LoRA adapters (--lora): served under their own names


def error(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
          code: str | None = None, headers: dict | None = None) -> Response:
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return Response(orjson.dumps(body), status, headers=headers, media_type="application/json")


def ok(obj: dict) -> Response:
    return Response(orjson.dumps(obj), 200, media_type="application/json")


def create_app(state: ServeState) -> FastAPI:
    app = FastAPI(title="dist_inference_runner", docs_url=None, redoc_url=None, openapi_url=None)
    state.created = state.created or int(time.time())
    upload_limit = state.max_request_bytes * UPLOAD_FACTOR

    app.add_middleware(Guard, state=state, upload_limit=upload_limit)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, exc):
        return error(exc.status_code, str(exc.detail), code="not_found" if exc.status_code == 404 else None)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request, exc):
        return error(400, f"invalid request: {exc.errors()[:1]}")

    @app.get("/health")
    async def health():
        return ok({"status": "ok", "pending": state.source.pending})

    @app.get("/v1/models")
    async def models():
        return ok({"object": "list", "data": [_model(state, m) for m in (state.model, *state.adapters)]})

    @app.get("/v1/models/{name:path}")
    async def model(name: str):
        if name not in (state.model, *state.adapters):
            return error(404, f"the model {name!r} does not exist; this server serves {_served(state)}",
                         param="model", code="model_not_found")
        return ok(_model(state, name))

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _complete(state, request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _complete(state, request, chat=True)

    from .files_routes import add_batch_routes

    add_batch_routes(app, state, upload_limit)
    return app


class Guard:
    """Pure ASGI middleware (BaseHTTPMiddleware would hide client disconnects from the handlers):
    the API key on /v1 endpoints, and the body size limit from Content-Length."""

    def __init__(self, app, state: ServeState, upload_limit: int):
        self.app, self.state, self.upload_limit = app, state, upload_limit

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            path = scope["path"]
            headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
            if self.state.api_key and path.startswith("/v1") and not _authorized(headers, self.state.api_key):
                return await error(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                                   code="invalid_api_key")(scope, receive, send)
            limit = self.upload_limit if path == "/v1/files" else self.state.max_request_bytes
            size = headers.get("content-length", "")
            if size.isdigit() and int(size) > limit:
                return await error(413, f"the request body of {size} bytes exceeds the limit of {limit} bytes",
                                   code="body_too_large")(scope, receive, send)
        await self.app(scope, receive, send)


def _model(state: ServeState, name: str) -> dict:
    out = {"id": name, "object": "model", "created": state.created, "owned_by": "dist_inference_runner"}
    if name != state.model:  # a LoRA adapter of the base model
        out["parent"] = state.model
    return out


def _served(state: ServeState) -> str:
    return ", ".join(repr(m) for m in (state.model, *state.adapters))


def _authorized(headers: dict, key: str) -> bool:
    got = headers.get("authorization", "")
    return hmac.compare_digest(got.encode(), f"Bearer {key}".encode())


async def read_json(request: Request, limit: int):
    body = await request.body()
    if len(body) > limit:
        raise StoreError(f"the request body of {len(body)} bytes exceeds the limit of {limit} bytes", 413)
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as e:
        raise StoreError(f"the body is not valid JSON: {json_problem(body, e)}", 400) from None


async def _complete(state: ServeState, request: Request, chat: bool) -> Response:
    try:
        body = await read_json(request, state.max_request_bytes)
    except StoreError as e:
        return error(e.status, e.message)
    if isinstance(body, dict) and body.get("model") not in (None, state.model, *state.adapters):
        return error(404, f"the model {body['model']!r} does not exist; this server serves {_served(state)}",
                     param="model", code="model_not_found")
    try:
        req = parse_body(body, chat)
        stream, include_usage = _stream_options(body)
        if stream and req.params.best_of != req.params.n:
            raise RequestError("'best_of' other than 'n' cannot be streamed", "best_of")
    except RequestError as e:
        return error(400, e.message, e.kind, e.param)
    req.stream = stream
    loop = asyncio.get_running_loop()
    live = Live(req, loop, loop.create_future(), stream, asyncio.Queue() if stream else None,
                loop.create_future() if stream else None)
    try:
        state.source.submit(live)
    except Busy as e:
        return error(429, str(e), "rate_limit_error", code="too_many_pending", headers={"Retry-After": "1"})
    except Unavailable as e:
        return error(503, str(e), "server_error")
    if stream:  # a request that cannot run (prompt too long, ...) is still a plain 400, before any event
        await asyncio.wait({live.accepted, live.future}, return_when=asyncio.FIRST_COMPLETED)
        if not live.accepted.done() and live.future.result()[0] == "error":
            _, status, err = live.future.result()
            return error(status, err["message"], err["type"], err.get("param"))
        model = body["model"] if body.get("model") in state.adapters else state.model
        maker = ChunkMaker(chat, model, ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24], int(time.time()))
        return StreamingResponse(_events(state, live, maker, include_usage), media_type="text/event-stream")
    value = await _wait(state, request, live)
    if value is None:
        return error(499, "the client closed the connection")
    if value[0] == "error":
        _, status, err = value
        return error(status, err["message"], err["type"], err.get("param"))
    return ok(value[1]["result"])


def _stream_options(body: dict) -> tuple[bool, bool]:
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise RequestError("'stream' must be true or false", "stream")
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict):
        raise RequestError("'stream_options' must be an object", "stream_options")
    return stream, bool(opts.get("include_usage"))


async def _wait(state: ServeState, request: Request, live: Live):
    """The answer, or None when the client disconnected first (its rows are freed)."""
    while True:
        done, _ = await asyncio.wait({live.future}, timeout=0.5)
        if done:
            return live.future.result()
        if await request.is_disconnected():
            state.source.cancel(live)
            return None


async def _events(state: ServeState, live: Live, maker: ChunkMaker, include_usage: bool):
    finished = False
    try:
        while True:
            getter = asyncio.ensure_future(live.events.get())
            done, _ = await asyncio.wait({getter, live.future}, return_when=asyncio.FIRST_COMPLETED)
            if getter in done:
                yield maker.delta(*getter.result())
                continue
            getter.cancel()
            while not live.events.empty():
                yield maker.delta(*live.events.get_nowait())
            break
        finished = True
        value = live.future.result()
        if value[0] == "error":
            _, status, err = value
            yield event({"error": {**err, "code": status}})
            yield DONE
            return
        for chunk in maker.final(value[1]["result"], include_usage):
            yield chunk
    finally:
        if not finished:
            state.source.cancel(live)


class HttpThread:
    """uvicorn in a daemon thread; the pipeline keeps the main thread."""

    def __init__(self, app: FastAPI, host: str, port: int):
        import uvicorn

        config = uvicorn.Config(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=5,
                                lifespan="off")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="http", daemon=True)

    def start(self, timeout: float = 30.0) -> None:
        self.thread.start()
        t0 = time.monotonic()
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() - t0 > timeout:
                raise RuntimeError("the HTTP server did not start (is the port in use?)")
            time.sleep(0.02)

    def stop(self, timeout: float = 8.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)
