"""serve.connection_limits on a real uvicorn (a small app in a thread, 127.0.0.1, no model): the connection
cap closes the connection idle longest, busy connections make a newcomer 503, a half-sent head is
closed after the header timeout, a stalled body gets 408, output left unread closes its connection."""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from tests.utils import free_port

try:  # the openai package's HTTP client (httpx, or its fork httpx2 in newer openai releases)
    import httpx
except ImportError:
    httpx = pytest.importorskip("httpx2")


@pytest.fixture
def small_server():
    """uvicorn with serve.connection_limits's limits in a thread: 4 connections, 1 s head, 1 s body, 1 s send
    (swept every 0.25 s)."""
    from serve.endpoints import HttpThread
    from serve.connection_limits import Limits

    app = FastAPI()
    gate = threading.Event()

    @app.get("/health")
    async def health():
        return JSONResponse({"status": "ok"})

    @app.get("/slow")
    async def slow():
        while not gate.is_set():
            await asyncio.sleep(0.05)
        return JSONResponse({"done": True})

    @app.get("/big")
    async def big():
        return Response(b"x" * (64 << 20))

    @app.post("/echo")
    async def echo(request: Request):
        return JSONResponse({"bytes": len(await request.body())})

    port = free_port()
    http = HttpThread(app, "127.0.0.1", port, Limits(max_connections=4, header_timeout=1, body_timeout=1, send_timeout=1))
    http.start()
    yield port, gate
    gate.set()
    http.stop()


def closed_within(sock: socket.socket, seconds: float) -> bytes | None:
    """What the server sent before closing the socket, or None if it stayed open ``seconds``."""
    sock.settimeout(0.2)
    got, deadline = b"", time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            data = sock.recv(65536)
        except TimeoutError:
            continue
        except ConnectionResetError:
            return got
        if not data:
            return got
        got += data
    return None


def test_idle_and_half_sent_connections_make_room(small_server):
    """Past the cap, the connection waiting longest for its head is closed: idle sockets cannot keep
    a client out; a half-sent head is closed after the header timeout, a stalled body gets 408."""
    port, _ = small_server
    idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(12)]
    for s in idle:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # never finished
    assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200
    assert sum(closed_within(s, 0.3) is not None for s in idle) >= 9  # 12 + 1 over a cap of 4
    slow = socket.create_connection(("127.0.0.1", port))
    for byte in b"GET /health HTTP/1.1\r\n":  # a byte every 0.3 s never completes within 1 s
        slow.sendall(bytes([byte]))
        if closed_within(slow, 0.3) is not None:
            break
    else:
        pytest.fail("a head trickling in was not timed out")
    body = socket.create_connection(("127.0.0.1", port))
    body.sendall(b"POST /echo HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 100\r\n\r\n0123456789")
    answer = closed_within(body, 8)
    assert answer is not None and answer.startswith(b"HTTP/1.1 408")
    for s in (*idle, slow, body):
        s.close()


def test_busy_connections_get_503(small_server):
    port, gate = small_server
    busy = []
    for _ in range(4):
        s = socket.create_connection(("127.0.0.1", port))
        s.sendall(b"GET /slow HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        busy.append(s)
    time.sleep(0.5)
    r = httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
    assert r.status_code == 503
    gate.set()
    for s in busy:
        s.settimeout(5)
        assert s.recv(100).startswith(b"HTTP/1.1 200")
        s.close()
    assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200


def test_unread_output_times_out(small_server):
    """A client that stops reading is disconnected after the send timeout (its handler sees it)."""
    port, _ = small_server
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(("127.0.0.1", port))
    closing = threading.Event()

    class Seen(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "left its output unread" in record.getMessage():
                closing.set()

    seen, logger = Seen(), logging.getLogger("serve")
    level = logger.level
    logger.addHandler(seen)
    logger.setLevel(logging.INFO)
    try:
        s.sendall(b"GET /big HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert closing.wait(30), "output left unread for 30 s was never timed out (send timeout 1 s)"
    finally:
        logger.removeHandler(seen)
        logger.setLevel(level)
    s.settimeout(5)
    got = 0
    try:
        while data := s.recv(1 << 20):
            got += len(data)
    except (ConnectionResetError, TimeoutError):
        pass
    assert got < (64 << 20)  # the response was cut off, not delivered
    s.close()
