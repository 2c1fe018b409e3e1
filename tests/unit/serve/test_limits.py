"""Serve mode's limits without a model: keys and their names, the Host/Origin/Content-Type/body
checks (serve.guard), caps before tokenizing (serve.tokenizing), admission by rows and bounded stream
buffers (serve.http_channel); the connection cap and timeouts: tests/unit/serve/test_protocol.py; the same
limits on the real server: tests/runs/test_serve_load_runs.py. Apps run on uvicorn threads on 127.0.0.1."""

from __future__ import annotations

import asyncio
import socket

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from tests.utils import free_port

try:  # the openai package's HTTP client (httpx, or its fork httpx2 in newer openai releases)
    import httpx
except ImportError:
    httpx = pytest.importorskip("httpx2")

RUNNING: list = []  # uvicorn threads of guarded_app, stopped at the end of the module


# -- keys -------------------------------------------------------------------------------------
def test_key_file(tmp_path):
    from pipeline.config.options import parse_options, read_key_file
    from serve.auth import Keys

    f = tmp_path / "keys"
    f.write_text("# team keys\nalice:sk-alice\n\nsk-bob bob\nsk-anon\n")
    keys = read_key_file(str(f))
    assert keys["sk-alice"] == "alice" and keys["sk-bob"] == "bob" and keys["sk-anon"].startswith("key-")
    assert read_key_file(str(f))["sk-anon"] == keys["sk-anon"]  # a stable name for a key without one
    ring = Keys(keys)
    assert ring.name_of("Bearer sk-alice") == "alice" and ring.name_of("bearer sk-bob") == "bob"
    assert ring.name_of("Bearer sk-nope") is None and ring.name_of("Basic sk-alice") is None
    assert ring.name_of("") is None
    for text, problem in (("a:k1\nb:k1\n", "repeats a key"), ("a:k1\na:k2\n", "given twice"),
                          ("k1 a b\n", "3 words"), ("# nothing\n", "no keys"), ("bad/name:k\n", "a name of")):
        f.write_text(text)
        with pytest.raises(ValueError, match=problem) as e:
            read_key_file(str(f))
        assert "k1" not in str(e.value).replace("line", "")  # the key itself is never echoed
    f.write_text("alice:sk-alice\n")
    with pytest.raises(SystemExit):
        parse_options(["--serve", "8000", "--api-key", "k", "--api-key-file", str(f)])
    with pytest.raises(SystemExit):
        parse_options(["--serve", "8000", "--api-key-file", str(tmp_path / "missing")])
    assert parse_options(["--serve", "8000", "--api-key-file", str(f)]).api_key_file == str(f)


def test_keys_from_flags_and_environment(tmp_path, caplog):
    from serve.auth import load_keys

    with caplog.at_level("WARNING", logger="serve"):
        assert load_keys("k", None, env={}).name_of("Bearer k") == "default"
    assert "ps" in caplog.text  # --api-key is visible to every local user
    assert load_keys(None, None, env={"DIST_RUNNER_API_KEY": "e"}).name_of("Bearer e") == "default"
    assert load_keys(None, None, env={"DIST_INFER_API_KEY": "e"}).name_of("Bearer e") == "default"
    assert not load_keys(None, None, env={})
    f = tmp_path / "keys"
    f.write_text("alice:sk-a\n")
    f.chmod(0o644)
    caplog.clear()
    with caplog.at_level("WARNING", logger="serve"):
        assert load_keys(None, str(f), env={"DIST_INFER_API_KEY": "e"}).name_of("Bearer e") is None
    assert "chmod 600" in caplog.text


# -- the guard --------------------------------------------------------------------------------
def guarded_app(keys: dict | None = None, hosts: str | None = None, origins: str | None = None,
                max_request_bytes: int = 1 << 16, bind: str = "127.0.0.1") -> FastAPI:
    from serve.auth import Keys, make_access
    from serve.guard import Guard

    app = FastAPI()
    app.add_middleware(Guard, keys=Keys(keys or {}), access=make_access(bind, hosts, origins),
                       max_request_bytes=max_request_bytes, max_upload_bytes=1 << 20)

    @app.post("/v1/completions")
    async def echo(request: Request):
        body = await request.body()
        return JSONResponse({"key": request.state.key_name, "bytes": len(body)})

    @app.post("/v1/files")
    async def files(request: Request):
        return JSONResponse({"bytes": len(await request.body())})

    @app.get("/health")
    async def health():
        return JSONResponse({"status": "ok"})

    return app


def client(app, host: str = "127.0.0.1:8000"):
    """An HTTP client of ``app`` served by uvicorn on 127.0.0.1, sending ``Host: host``."""
    from serve.endpoints import HttpThread

    port = free_port()
    http = HttpThread(app, "127.0.0.1", port)
    http.start()
    RUNNING.append(http)
    return httpx.Client(base_url=f"http://127.0.0.1:{port}", headers={"Host": host}, timeout=30)


@pytest.fixture(scope="module", autouse=True)
def stop_servers():
    yield
    for http in RUNNING:
        http.stop()


def test_host_and_origin_allow_lists():
    """DNS rebinding (a page's own name as Host) and cross-site browser requests are refused (403)."""
    c = client(guarded_app())
    js = {"Content-Type": "application/json"}
    for host in ("127.0.0.1:8000", "localhost:8000", "[::1]:8000", "localhost", "app.localhost:1", "10.1.2.3"):
        assert c.post("/v1/completions", content=b"{}", headers={**js, "Host": host}).status_code == 200, host
    r = c.post("/v1/completions", content=b"{}", headers={**js, "Host": "evil.example"})
    assert r.status_code == 403 and r.json()["error"]["code"] == "host_not_allowed"
    assert c.get("/health", headers={"Host": "evil.example:8000"}).status_code == 403
    r = c.post("/v1/completions", content=b"{}", headers={**js, "Origin": "http://evil.example"})
    assert r.status_code == 403 and r.json()["error"]["code"] == "origin_not_allowed"
    assert c.post("/v1/completions", content=b"{}", headers={**js, "Origin": "null"}).status_code == 403
    # the server's own page (same origin) and clients that send no Origin
    assert c.post("/v1/completions", content=b"{}", headers={**js, "Origin": "http://127.0.0.1:8000"}).status_code == 200
    wide = client(guarded_app(hosts="api.example,other.example", origins="https://ui.example"), "api.example")
    assert wide.get("/health").status_code == 200
    assert wide.get("/health", headers={"Host": "evil.example"}).status_code == 403
    assert wide.post("/v1/completions", content=b"{}", headers={**js, "Origin": "https://ui.example"}).status_code == 200
    assert wide.post("/v1/completions", content=b"{}", headers={**js, "Origin": "https://x.example"}).status_code == 403
    anyone = client(guarded_app(hosts="*", origins="*"), "evil.example")
    assert anyone.post("/v1/completions", content=b"{}", headers={**js, "Origin": "http://evil.example"}).status_code == 200
    # bound beyond loopback: this machine's name is what clients of a cluster node use
    assert client(guarded_app(bind="0.0.0.0"), socket.gethostname()).get("/health").status_code == 200
    assert client(guarded_app(), socket.gethostname() + ".invalid").get("/health").status_code == 403


def test_server_app_answers_allowed_origins_with_cors(tmp_path):
    """The server's app (create_app): --allowed-origins get CORS headers and preflights; others 403."""
    from serve.endpoints import ServeState, create_app
    from serve.auth import Keys, make_access
    from pipeline.runtime.sources import Requests
    from tasks.batch_store import BatchStore

    state = ServeState(Requests(4, 16), BatchStore(tmp_path), "m", Keys({"sk": "a"}), 1000,
                       access=make_access("127.0.0.1", None, "https://ui.example"), allowed_origins="https://ui.example")
    c = client(create_app(state))
    ui = {"Origin": "https://ui.example", "Authorization": "Bearer sk"}
    r = c.get("/v1/models", headers=ui)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://ui.example"
    r = c.options("/v1/completions", headers={"Origin": "https://ui.example", "Access-Control-Request-Method": "POST",
                                              "Access-Control-Request-Headers": "authorization,content-type"})
    assert r.status_code == 200 and "POST" in r.headers["access-control-allow-methods"]
    assert c.get("/v1/models", headers={**ui, "Origin": "https://evil.example"}).status_code == 403
    r = c.post("/v1/completions", content=b'{"prompt": "x"}', headers={**ui, "Content-Type": "text/plain"})
    assert r.status_code == 415


def test_json_only_bodies_and_keys():
    c = client(guarded_app(keys={"sk-a": "alice", "sk-b": "bob"}))
    auth = {"Authorization": "Bearer sk-b"}
    for kind in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", None):
        headers = {**auth, **({"Content-Type": kind} if kind else {})}
        r = c.post("/v1/completions", content=b'{"prompt": "x"}', headers=headers)
        assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type", kind
    r = c.post("/v1/completions", content=b"{}", headers={**auth, "Content-Type": "application/json; charset=utf-8"})
    assert r.status_code == 200 and r.json()["key"] == "bob"
    r = c.post("/v1/completions", content=b"{}", headers={"Authorization": "Bearer sk-a", "Content-Type": "application/json"})
    assert r.json()["key"] == "alice"
    assert c.post("/v1/completions", content=b"{}", headers={"Content-Type": "application/json"}).status_code == 401
    assert c.post("/v1/files", content=b"{}", headers={**auth, "Content-Type": "application/json"}).status_code == 415
    r = c.post("/v1/files", files={"file": ("a.jsonl", b"{}\n")}, data={"purpose": "batch"}, headers=auth)
    assert r.status_code == 200
    assert c.get("/health").status_code == 200  # no key needed


def test_body_counted_as_read():
    """A chunked body (no Content-Length) stops at the first byte past the limit."""
    c = client(guarded_app(max_request_bytes=1000))
    sent = []

    def chunks():
        for _ in range(10_000):
            sent.append(100)
            yield b"x" * 100

    r = c.post("/v1/completions", content=chunks(), headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"
    assert r.headers["connection"] == "close"
    assert c.post("/v1/completions", content=b"x" * 1000, headers={"Content-Type": "application/json"}).status_code == 200
    r = c.post("/v1/completions", content=b"x" * 1001, headers={"Content-Type": "application/json"})
    assert r.status_code == 413


# -- before tokenizing, admission, streams ----------------------------------------------------
def test_caps_before_tokenizing():
    from pipeline.runtime.sources import rows_of
    from serve.tokenizing import Caps, check_caps, max_token_bytes
    from tasks.requests import parse_body
    from tasks.protocol import RequestError
    from tests.utils import local_tokenizer

    tok = local_tokenizer()
    most = max_token_bytes(tok)
    assert 1 <= most < 64
    caps = Caps(max_prompts=4, max_rows=16, context=100, max_token_bytes=most, truncate=False)
    text = "word " * 2000
    assert len(tok(text)["input_ids"]) > 100  # the check never refuses a prompt that fits
    fits = "z" * (most * 90)
    check_caps(parse_body({"prompt": fits, "max_tokens": 10}, False), caps)
    with pytest.raises(RequestError, match="at least .* tokens") as e:
        check_caps(parse_body({"prompt": "z" * (most * 95), "max_tokens": 10}, False), caps)
    assert e.value.param == "prompt"
    with pytest.raises(RequestError, match="context window"):
        check_caps(parse_body({"messages": [{"role": "user", "content": "z" * (most * 101)}]}, True), caps)
    with pytest.raises(RequestError, match="context window"):
        check_caps(parse_body({"prompt": list(range(95)), "max_tokens": 10}, False), caps)
    with pytest.raises(RequestError, match="--max-prompts-per-request"):
        check_caps(parse_body({"prompt": ["a"] * 5}, False), caps)
    req = parse_body({"prompt": ["a"] * 3, "n": 2, "best_of": 6}, False)
    assert rows_of(req) == 18
    with pytest.raises(RequestError, match="--max-pending-rows"):
        check_caps(req, caps)
    check_caps(parse_body({"prompt": "z" * (most * 200)}, False), Caps(4, 16, 100, most, truncate=True))


def live_request(loop, rows: int = 1, stream: bool = False):
    from pipeline.runtime.sources import Live
    from serve.http_channel import HttpChannel
    from tasks.requests import parse_body

    req = parse_body({"prompt": "x", "max_tokens": 4, "stream": stream}, False)
    return Live(req, HttpChannel(loop, stream), stream, rows=rows)


def test_admission_counts_rows_and_open_streams():
    from pipeline.runtime.sources import Busy, Requests
    from tasks.protocol import Answer

    loop = asyncio.new_event_loop()
    try:
        source = Requests(max_pending=10, max_rows=8)
        big = live_request(loop, rows=6)
        source.submit(big)
        with pytest.raises(Busy, match="--max-pending-rows"):
            source.submit(live_request(loop, rows=3))
        stream = live_request(loop, rows=2, stream=True)
        source.submit(stream)
        assert (source.pending, source.rows) == (2, 8)
        source.resolve(big, Answer(result={}))
        source.resolve(stream, Answer(result={}))  # answered, but its client has not read it all yet
        assert (source.pending, source.rows) == (1, 2)
        source.release(stream)  # its response ended
        source.release(stream)
        assert (source.pending, source.rows) == (0, 0)
        lone = live_request(loop, rows=20)  # alone, a request may use more than the cap (check_caps refuses it first)
        source.submit(lone)
        source.release(lone)  # cancelled: no answer is owed
        assert source.pending == 0
    finally:
        loop.close()


def test_unread_stream_buffer_is_bounded():
    """Deltas past the buffer are not kept; the final chunk still carries the whole text and logprobs."""
    from serve.http_channel import STREAM_BUFFER
    from serve.sse import ChunkMaker

    loop = asyncio.new_event_loop()
    try:
        live = live_request(loop, stream=True)
        channel = live.channel
        words = [f"w{i} " for i in range(STREAM_BUFFER * 3)]
        for w in words:
            channel.delta(0, w, {"tokens": [w], "token_logprobs": [-1.0], "top_logprobs": None, "text_offset": [0]})
        loop.run_until_complete(asyncio.sleep(0))
        assert channel.events.qsize() == STREAM_BUFFER and channel.overflow
        maker = ChunkMaker(False, "m", "cmpl-x", 0)
        got = [maker.delta(*channel.events.get_nowait()) for _ in range(STREAM_BUFFER)]
        text = "".join(words)
        lp = {"tokens": words, "token_logprobs": [-1.0] * len(words), "top_logprobs": None,
              "text_offset": [0] * len(words)}
        got += maker.final({"choices": [{"index": 0, "text": text, "finish_reason": "length", "logprobs": lp}],
                            "usage": {}}, False)
        import orjson

        chunks = [orjson.loads(c[6:]) for c in got[:-1]]
        assert "".join(c["choices"][0]["text"] for c in chunks) == text
        assert sum((c["choices"][0]["logprobs"]["tokens"] for c in chunks), []) == words
    finally:
        loop.close()
