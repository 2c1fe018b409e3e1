"""The HTTP endpoints (FastAPI), in OpenAI's request and response shapes, and the uvicorn thread.

Handlers only validate, hand requests to the pipeline thread (:mod:`serve.http_channel`) and await the
answer; every error is an OpenAI error object ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from pipeline.runtime.sources import Busy, Live, Requests, Unavailable, rows_of
from tasks.protocol import Answer, RequestError
from tasks.requests import bool_field, parse_body

from serve.auth import Access, Keys, origin_list
from tasks.batch_store import BatchStore
from serve.guard import Guard
from serve.metrics import CountRequests, ServeMetrics
from serve.tokenizing import Caps, Tokenizing, check_caps
from serve.http_channel import HttpChannel
from serve.sse import DONE, ChunkMaker, event
from serve.batch_routes import add_batch_routes
from serve.connection_limits import protocol_class
from serve.responses import error, model_not_found, ok, read_json
from serve.tokenizer_routes import add_tokenizer_routes
from serve.web_page import add_page_route

log = logging.getLogger(__name__)

MAX_HEAD = 16 << 10  # bytes of a request head (line and headers); more: 400 (h11's limit, uvicorn's default)


@dataclass
class ServeState:
    source: Requests
    store: BatchStore
    model: str
    keys: Keys
    max_request_bytes: int
    max_upload_bytes: int = 200_000_000
    created: int = 0
    adapters: tuple[str, ...] = ()  # LoRA adapters (--lora): served under their own names
    access: Access = field(default_factory=lambda: Access({"localhost"}))
    allowed_origins: str | None = None  # --allowed-origins as given (CORS headers)
    caps: Caps | None = None  # per-request caps checked before tokenizing (None: none)
    tokenizing: Tokenizing | None = None  # None: the pipeline thread tokenizes (tests of the engine alone)
    metrics: ServeMetrics | None = None  # GET /metrics (serve.metrics); None: no such route
    lenient_fields: bool = False  # --lenient-fields: unknown or unsupported request fields ignored and logged
    max_model_len: int = 0  # the model's context window (/tokenize reports it)
    vocab_size: int = 0  # the model's embedding rows (/detokenize's ids are checked against it; 0: not known)

    @property
    def served(self) -> tuple[str, ...]:
        """The names a request's "model" may take: the base model's, then each adapter's."""
        return (self.model, *self.adapters)


def create_app(state: ServeState) -> FastAPI:
    app = FastAPI(title="dist_inference_runner", docs_url=None, redoc_url=None, openapi_url=None)
    state.created = state.created or int(time.time())

    app.add_middleware(Guard, keys=state.keys, access=state.access, max_request_bytes=state.max_request_bytes,
                       max_upload_bytes=state.max_upload_bytes)
    origins = origin_list(state.allowed_origins)
    if origins:  # browsers may call from these origins: preflights answered, CORS headers on answers
        from starlette.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=origins, allow_methods=["GET", "POST", "DELETE"],
                           allow_headers=["Authorization", "Content-Type"])
    if state.metrics is not None:  # outermost: refused requests are counted too
        app.add_middleware(CountRequests, metrics=state.metrics, routes=app)

        @app.get("/metrics")
        async def metrics():
            return Response(state.metrics.text(), 200, media_type=CONTENT_TYPE_LATEST)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, exc):
        return error(exc.status_code, str(exc.detail), code="not_found" if exc.status_code == 404 else None)

    @app.exception_handler(RequestError)
    async def request_error(request, exc: RequestError):  # a bad body, an unknown id, a quota, an answer
        return error(exc.status, exc.message, exc.kind, param=exc.param, code=exc.code)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request, exc):  # a query parameter: ?limit=x
        e = exc.errors()[0]
        where = e["loc"][-1] if e.get("loc") else None
        return error(400, f"invalid '{where}': {e.get('msg', 'not valid')}", param=where)

    @app.get("/health")
    async def health():
        return ok({"status": "ok", "pending": state.source.pending})

    @app.get("/v1/models")
    async def models():
        return ok({"object": "list", "data": [_model(state, m) for m in state.served]})

    @app.get("/v1/models/{name:path}")
    async def model(name: str):
        if name not in state.served:
            return model_not_found(name, state.served)
        return ok(_model(state, name))

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _complete(state, request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _complete(state, request, chat=True)

    add_batch_routes(app, state)
    add_tokenizer_routes(app, state)  # vLLM's /tokenize, /detokenize, /tokenizer_info
    add_page_route(app)  # the chat page at / (serve/static/index.html)
    return app


def _model(state: ServeState, name: str) -> dict:
    out = {"id": name, "object": "model", "created": state.created, "owned_by": "dist_inference_runner"}
    if name != state.model:  # a LoRA adapter of the base model
        out["parent"] = state.model
    return out


async def _complete(state: ServeState, request: Request, chat: bool) -> Response:
    body = await read_json(request)
    if isinstance(body, dict) and body.get("model") not in (None, *state.served):
        return model_not_found(body["model"], state.served)
    try:
        req = parse_body(body, chat, lenient=state.lenient_fields)
        if req.ignored:  # as vLLM logs them
            log.warning("request fields ignored (--lenient-fields): %s", ", ".join(req.ignored))
            if state.metrics is not None:
                state.metrics.fields(req.ignored, "ignored")
        stream = bool_field(body, "stream")
        stream_options = body.get("stream_options") or {}
        if not isinstance(stream_options, dict):
            raise RequestError("'stream_options' must be an object", "stream_options")
        if stream_options and not stream:  # as OpenAI and vLLM answer
            raise RequestError("'stream_options' is only allowed when 'stream' is true", "stream_options")
        include_usage = bool_field(stream_options, "include_usage")
        if stream and req.params.best_of != req.params.n:
            raise RequestError("'best_of' other than 'n' cannot be streamed", "best_of")
        if state.caps is not None:  # refused before tokenizing: too many prompts or rows, text over the window
            check_caps(req, state.caps)
    except RequestError as e:
        if state.metrics is not None and e.reason.startswith("field:"):
            state.metrics.fields([e.reason[6:]], "refused")
        return error(400, e.message, e.kind, e.param)
    req.stream = stream
    live = Live(req, HttpChannel(asyncio.get_running_loop(), stream), stream, rows=rows_of(req))
    try:
        state.source.admit(live)
    except Busy as e:
        return error(429, str(e), "rate_limit_error", code="too_many_pending", headers={"Retry-After": "1"})
    except Unavailable as e:
        return error(503, str(e), "server_error")
    streaming = False
    try:
        response = await _run(state, request, live, body, chat, include_usage)
        streaming = isinstance(response, _Stream)
        return response
    finally:
        if not streaming:  # a stream is released when its response ends
            state.source.release(live)


async def _run(state: ServeState, request: Request, live: Live, body: dict, chat: bool,
               include_usage: bool) -> Response:
    """Tokenize (off the pipeline thread), hand to the pipeline thread, answer or stream."""
    if state.tokenizing is not None:
        try:
            live.prompt_ids = await state.tokenizing(live.req)
        except RequestError as e:
            return error(400, e.message, e.kind, e.param)
        except Exception as e:  # noqa: BLE001 - a prompt the tokenizer cannot take is this request's error
            return error(400, f"the prompt could not be tokenized: {type(e).__name__}: {e}",
                         param="messages" if chat else "prompt")
    state.source.submit(live)
    channel = live.channel
    if live.stream:  # a request that cannot run (prompt too long, ...) is still a plain 400, before any event
        await asyncio.wait({channel.queued, channel.future}, return_when=asyncio.FIRST_COMPLETED)
        if not channel.queued.done() and not channel.future.result().ok:
            raise _answer_error(channel.future.result())
        model = body["model"] if body.get("model") in state.adapters else state.model
        maker = ChunkMaker(chat, model, ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24], int(time.time()))
        return _Stream(_events(state, live, maker, include_usage), lambda: _closed(state, live),
                       media_type="text/event-stream")
    answer = await _wait(state, request, live)
    if answer is None:
        return error(499, "the client closed the connection")
    if not answer.ok:
        raise _answer_error(answer)
    return ok(answer.result)


def _answer_error(answer: Answer) -> RequestError:
    """An answer that is not a result (raised: the app's handler answers it): the request's error, or the
    engine's end (503)."""
    return answer.error or RequestError(f"the server stopped: {answer.dead}", kind="server_error", status=503)


class _Stream(StreamingResponse):
    """A stream that calls ``on_close`` however it ends (sent, client gone, cancelled before it began)."""

    def __init__(self, content, on_close, **kwargs):
        super().__init__(content, **kwargs)
        self.on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


def _closed(state: ServeState, live: Live) -> None:
    """A stream's response ended: rows still running are freed, and it stops counting against admission."""
    if not live.channel.future.done():
        state.source.cancel(live)
    state.source.release(live)


async def _wait(state: ServeState, request: Request, live: Live):
    """The answer, or None when the client disconnected first (its rows are freed)."""
    while True:
        done, _ = await asyncio.wait({live.channel.future}, timeout=0.5)
        if done:
            return live.channel.future.result()
        if await request.is_disconnected():
            state.source.cancel(live)
            return None


async def _events(state: ServeState, live: Live, maker: ChunkMaker, include_usage: bool):
    channel, finished = live.channel, False
    try:
        while True:
            getter = asyncio.ensure_future(channel.events.get())
            done, _ = await asyncio.wait({getter, channel.future}, return_when=asyncio.FIRST_COMPLETED)
            if getter in done:
                yield maker.delta(*getter.result())
                continue
            getter.cancel()
            while not channel.events.empty():
                yield maker.delta(*channel.events.get_nowait())
            break
        finished = True
        answer = channel.future.result()
        if not answer.ok:
            e = _answer_error(answer)
            yield event({"error": {**e.to_dict(), "code": e.status}})
            yield DONE
            return
        for chunk in maker.final(answer.result, include_usage):
            yield chunk
    finally:
        if not finished:
            state.source.cancel(live)


class HttpThread:
    """uvicorn in a daemon thread; the pipeline keeps the main thread."""

    def __init__(self, app: FastAPI, host: str, port: int, limits=None, keep_alive: int = 5):
        """``limits``: serve.connection_limits.Limits (connection cap and timeouts); None: uvicorn's defaults."""
        import uvicorn

        # limit_concurrency: uvicorn answers 503 past it once a head is in (the cap itself is kept by the
        # protocol, which closes idle connections first)
        extra = {} if limits is None else {"http": protocol_class(limits),
                                           "limit_concurrency": limits.max_connections + 1}
        config = uvicorn.Config(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=5,
                                lifespan="off", timeout_keep_alive=keep_alive, h11_max_incomplete_event_size=MAX_HEAD,
                                **extra)
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
