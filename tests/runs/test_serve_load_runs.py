"""Serve mode's limits on real sockets, against the shared in-process servers of the embedded default model
(tests/servers.py: "default" with tight limits, "default-wide" with the default request limits): bodies
counted as read, uploads streamed with a cap, idle and half-sent sockets, Host/Origin/Content-Type checks,
keys of a key file, caps before tokenizing, tokenizing off the pipeline thread, unread streams; and a bounded
load test with slow, idle, oversized and well-behaved clients together. Every loop is bounded in count and
time. Memory is this process's (the server's threads are in it). An open-file limit below the sockets held,
and the exit code on SIGTERM, need a process of the server's own: tests/integration/test_serve_processes.py."""

from __future__ import annotations

import json
import socket
import threading
import time
from pathlib import Path

import pytest

from tests.servers import httpx

JSON = {"Content-Type": "application/json"}


def rss_mib(field: str = "VmRSS") -> float:
    """This process's resident memory (``VmHWM``: its peak since :func:`reset_peak`): the server's threads'."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no {field}")


def reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS (Linux >= 4.0)


def wait_for(check, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


def complete(server, prompt: str = "Hello", key: str | None = None, **kw) -> httpx.Response:
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, **kw}
    return httpx.post(server.url("/v1/completions"), json=body, headers=auth(key), timeout=120)


def auth(key: str | None) -> dict:
    return {"Authorization": f"Bearer {key}"} if key else {}


def send_chunked(port: int, path: str, total: int, head: bytes = b"") -> tuple[int, bytes]:
    """POST ``total`` bytes chunked (no Content-Length); returns (bytes sent, the answer read so far)."""
    s = socket.create_connection(("127.0.0.1", port))
    s.settimeout(2)  # a server that stopped reading the body: the send blocks until then
    s.sendall(b"POST " + path.encode() + b" HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
              + head + b"Transfer-Encoding: chunked\r\n\r\n")
    piece = b"%x\r\n%s\r\n" % (64 << 10, b" " * (64 << 10))
    sent, answer = 0, b""
    try:
        while sent < total:
            s.sendall(piece)
            sent += 64 << 10
            s.setblocking(False)
            try:
                answer += s.recv(65536)
            except BlockingIOError:
                pass
            s.settimeout(2)
            if answer:
                break
        answer += s.recv(65536)
    except OSError:  # the server closed the connection (reset, timeout of a full send buffer)
        pass
    s.close()
    return sent, answer


def multipart(data: bytes):
    """A multipart form of ``purpose=batch`` and ``file`` as a generator (sent chunked)."""
    yield (b'--BOUNDARY\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
           b'--BOUNDARY\r\nContent-Disposition: form-data; name="file"; filename="a.jsonl"\r\n'
           b"Content-Type: application/octet-stream\r\n\r\n")
    for i in range(0, len(data), 50_000):
        yield data[i:i + 50_000]
    yield b"\r\n--BOUNDARY--\r\n"


def hold_idle_sockets(port: int, count: int, head: bytes) -> list[socket.socket]:
    socks = []
    for _ in range(count):
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        s.sendall(head)
        socks.append(s)
    return socks


# -- tight limits: --max-request-bytes 65536, --max-upload-bytes 1000000, header/body/send timeouts 1.5/1.5/2 s
class TestTight:
    @pytest.fixture(scope="class")
    def tight(self, servers):
        return servers.get("default", 1)

    @pytest.fixture
    def key(self, tight):
        return tight.key()

    def test_keys_of_a_key_file(self, tight, key):
        other = tight.key()
        for k in (key, other):
            assert httpx.get(tight.url("/v1/models"), headers=auth(k)).status_code == 200
        assert httpx.get(tight.url("/v1/models"), headers=auth("sk-carol")).status_code == 401
        assert httpx.get(tight.url("/v1/models")).status_code == 401
        assert complete(tight, key=key).status_code == 200

    def test_chunked_body_refused_with_bounded_memory(self, tight, key):
        before = rss_mib()
        head = b"Authorization: Bearer %s\r\n" % key.encode()
        sent, answer = send_chunked(tight.port, "/v1/completions", 40 << 20, head)
        assert sent < (40 << 20)  # the server stopped reading
        assert answer.startswith(b"HTTP/1.1 413") or not answer, answer[:200]
        assert rss_mib() - before < 8, "the refused body was held in memory"
        assert complete(tight, key=key).status_code == 200

    def test_upload_streamed_with_a_cap(self, tight, key):
        files = tight.serve_dir / "uploads"  # where uploads stream before they move to their key's folder
        r = httpx.post(tight.url("/v1/files"), headers=auth(key), data={"purpose": "batch"},
                       files={"file": ("big.jsonl", b"x" * 1_500_000)}, timeout=60)
        assert r.status_code == 413 and "--max-upload-bytes" in r.json()["error"]["message"]
        for size in (1_000_001, 1_060_000):  # chunked (no Content-Length): the parts counted as they come
            r = httpx.post(tight.url("/v1/files"), content=multipart(b"x" * size), timeout=60,
                           headers={**auth(key), "Content-Type": "multipart/form-data; boundary=BOUNDARY"})
            assert r.status_code == 413 and "--max-upload-bytes" in r.json()["error"]["message"], r.text
        lines = b"".join(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
                                     "body": {"prompt": "x" * 900, "max_tokens": 1}}).encode() + b"\n"
                         for i in range(900))
        assert 800_000 < len(lines) < 1_000_000
        r = httpx.post(tight.url("/v1/files"), headers=auth(key), data={"purpose": "batch"},
                       files={"file": ("ok.jsonl", lines)}, timeout=60)
        assert r.status_code == 200, r.text
        got = httpx.get(tight.url(f"/v1/files/{r.json()['id']}/content"), headers=auth(key), timeout=60)
        assert got.content == lines
        assert not list(files.glob(".upload-*"))  # nothing left of the refused one
        assert httpx.delete(tight.url(f"/v1/files/{r.json()['id']}"), headers=auth(key)).status_code == 200

    def test_host_origin_and_media_type(self, tight, key):
        form = {"data": {"purpose": "batch"}, "files": {"file": ("a.jsonl", b"{}\n")}}
        r = httpx.post(tight.url("/v1/files"), headers={**auth(key), "Host": "evil.example:80"}, **form)
        assert r.status_code == 403
        r = httpx.post(tight.url("/v1/files"), headers={**auth(key), "Origin": "http://evil.example"}, **form)
        assert r.status_code == 403
        r = httpx.post(tight.url("/v1/completions"), content=b'{"prompt": "x"}',
                       headers={**auth(key), "Content-Type": "text/plain"})
        assert r.status_code == 415

    def test_idle_sockets(self, tight, key):
        """300 half-sent requests: /health and a completion still answer (under an open-file limit below them:
        tests/integration/test_serve_processes.py)."""
        socks = hold_idle_sockets(tight.port, 300, b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        try:
            for _ in range(3):
                try:
                    r = httpx.get(tight.url("/health"), timeout=5)
                    break
                except httpx.HTTPError:
                    continue
            assert r.status_code == 200
            assert complete(tight, key=key).status_code == 200
        finally:
            for s in socks:
                s.close()

    def test_slow_header_is_closed(self, tight):
        s = socket.create_connection(("127.0.0.1", tight.port))
        s.settimeout(0.5)
        closed = False
        for byte in b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"y" * 40:
            try:
                s.sendall(bytes([byte]))
                closed = s.recv(100) == b""
            except TimeoutError:
                continue
            except OSError:
                closed = True
            if closed:
                break
        assert closed, "a head sent a byte every 0.5 s was still open after 35 s (header timeout 1.5 s)"
        s.close()

    def test_unread_stream_is_bounded_and_freed(self, tight, key):
        """A stream its client does not read counts against admission until the send timeout closes it."""
        before, mark = rss_mib(), tight.log.mark()
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.connect(("127.0.0.1", tight.port))
        body = json.dumps({"prompt": "Once", "max_tokens": 1500, "n": 16, "logprobs": 5, "stream": True,
                           "temperature": 1.0, "seed": 1}).encode()
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer %s\r\n"
                  b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (key.encode(), len(body), body))
        tight.log.wait_for("output unread", mark, 180)
        wait_for(lambda: tight.pending() == 0, 30, "the unread stream still counts after its connection closed")
        assert rss_mib() - before < 128  # the pipeline's KV cache and kept heap grow too; the buffer cap itself: test_serve_limits
        s.close()
        assert complete(tight, key=key).status_code == 200


# -- the default request limits: prompts and load ------------------------------------------------------------
class TestWide:
    @pytest.fixture(scope="class")
    def wide(self, servers):
        return servers.get("default-wide", 1)

    @pytest.fixture
    def key(self, wide):
        return wide.key()

    def test_huge_prompt_refused_before_tokenizing(self, wide, key):
        r = complete(wide, prompt="x" * (7 << 20), key=key)
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
        assert "at least" in r.json()["error"]["message"]  # the bound from its bytes, not its tokens
        r = httpx.post(wide.url("/v1/completions"), json={"prompt": ["a"] * 20_000, "max_tokens": 1}, headers=auth(key),
                       timeout=120)
        assert r.status_code == 400 and "--max-prompts-per-request" in r.json()["error"]["message"]
        assert complete(wide, key=key).status_code == 200

    def test_tokenizing_does_not_hold_other_clients(self, wide, key):
        """320 prompts of 25 KB (8 MB of text: each could fit the window by its bytes) take seconds to
        tokenize; small requests sent after it are answered before it."""
        done: list[str] = []

        def big() -> None:
            r = complete(wide, prompt=["word " * 5000] * 320, max_tokens=1, key=key)
            assert r.status_code == 400 and "context window" in r.json()["error"]["message"]
            done.append("big")

        t = threading.Thread(target=big)
        t.start()
        time.sleep(0.5)
        for _ in range(3):
            assert complete(wide, max_tokens=2, key=key).status_code == 200
            done.append("small")
        t.join(300)
        assert done[:1] == ["small"] and "big" in done, done

    def test_load(self, wide, key):
        """Slow, idle (300), oversized and unread clients beside well-behaved ones: every well-behaved request
        keeps its usual latency (a generous factor of the slowest measured alone here) and the peak memory of
        this process (the server's) stays bounded."""
        def latencies(k: int) -> list[float]:
            out = []
            for i in range(k):
                t0 = time.monotonic()
                assert complete(wide, prompt=f"Client {i} asks", seed=i, key=key).status_code == 200
                out.append(time.monotonic() - t0)
            return out

        latencies(2)  # warm
        baseline = max(latencies(6))
        stop = threading.Event()
        reset_peak()
        rss0 = rss_mib()

        def idle() -> None:
            socks = hold_idle_sockets(wide.port, 300, b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
            stop.wait(120)
            for s in socks:
                s.close()

        def slow() -> None:
            s = socket.create_connection(("127.0.0.1", wide.port))
            for byte in b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n" * 3:
                if stop.is_set():
                    break
                try:
                    s.sendall(bytes([byte]))
                except OSError:  # closed by the header timeout: come back
                    s.close()
                    s = socket.create_connection(("127.0.0.1", wide.port))
                time.sleep(0.3)
            s.close()

        def oversized() -> None:
            for _ in range(2):
                send_chunked(wide.port, "/v1/completions", 40 << 20)

        def unread() -> None:
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.connect(("127.0.0.1", wide.port))
            body = json.dumps({"prompt": "Unread", "max_tokens": 500, "n": 4, "logprobs": 5, "stream": True}).encode()
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                      b"Authorization: Bearer %s\r\nContent-Length: %d\r\n\r\n%s" % (key.encode(), len(body), body))
            stop.wait(120)
            s.close()

        bad = [threading.Thread(target=f) for f in (idle, slow, slow, oversized, oversized, oversized, unread, unread)]
        for t in bad:
            t.start()
        time.sleep(1.0)
        results: list[list[float]] = []
        good = [threading.Thread(target=lambda: results.append(latencies(4))) for _ in range(3)]
        for t in good:
            t.start()
        for t in good:
            t.join(300)
        stop.set()
        for t in bad:
            t.join(60)
        assert len(results) == 3, "a well-behaved client failed"
        loaded, peak = max(x for r in results for x in r), rss_mib("VmHWM")
        print(f"slowest request alone {baseline:.2f} s, under load {loaded:.2f} s; RSS {rss0:.0f} -> peak {peak:.0f} MiB")
        assert loaded < 10 * baseline + 5, (loaded, baseline)  # 3 clients at once, a loaded machine: generous
        assert peak - rss0 < 100, (rss0, peak)  # three 8 MiB bodies at most (each joined once), never 40 MiB
        wait_for(lambda: wide.pending() == 0, 60, "requests still counted after every client left")
