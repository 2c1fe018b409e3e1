"""The checks every HTTP request passes before a handler sees it, in this order (pure ASGI middleware:
BaseHTTPMiddleware would hide client disconnects from the handlers):

1. ``Host`` allowed, else 403 (DNS rebinding); ``Origin``, when sent, allowed, else 403;
2. with keys, on ``/v1``, ``/metrics`` and the tokenizer routes: a known ``Authorization: Bearer KEY``,
   else 401 (the key's name goes to ``request.state.key_name``);
3. POST bodies: JSON (``multipart/form-data`` on ``POST /v1/files`` only), else 415;
4. the body's size, counted as it arrives (chunked bodies too): 413 and ``Connection: close`` at the
   first byte past the limit, so the server never holds more than the limit and one read.
"""

from __future__ import annotations

from serve.auth import DEFAULT_NAME, Access, Keys
from serve.responses import error

UPLOAD_ROUTE = "/v1/files"
METRICS_ROUTE = "/metrics"  # Prometheus (serve.metrics): behind the key like /v1
KEYED_ROUTES = (METRICS_ROUTE, "/tokenize", "/detokenize", "/tokenizer_info")  # vLLM's tokenizer routes too
MULTIPART_SLACK = 64 << 10  # an upload's body holds the file plus part headers and the purpose field


class BodyTooLarge(Exception):
    """Raised from ``receive`` when a body passes its limit; the guard answers 413."""

    def __init__(self, limit: int, flag: str):
        super().__init__(f"the request body exceeds the limit of {limit} bytes ({flag})")


class Guard:
    def __init__(self, app, keys: Keys, access: Access, max_request_bytes: int, max_upload_bytes: int):
        self.app, self.keys, self.access = app, keys, access
        self.max_request_bytes, self.max_upload_bytes = max_request_bytes, max_upload_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        if (refused := self._refusal(scope, headers)) is not None:
            return await _answer(*refused, scope, receive, send)
        upload = scope["path"] == UPLOAD_ROUTE and scope["method"] == "POST"
        limit = self.max_upload_bytes + MULTIPART_SLACK if upload else self.max_request_bytes
        flag = "--max-upload-bytes" if upload else "--max-request-bytes"
        size = headers.get("content-length", "")
        if size.isdigit() and int(size) > limit:
            return await _answer(413, f"the request body of {size} bytes exceeds the limit of {limit} bytes ({flag})",
                                 "body_too_large", scope, receive, send)
        started, seen = False, 0

        async def counted():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise BodyTooLarge(limit, flag)
            return message

        async def watched(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted, watched)
        except BodyTooLarge as e:
            if started:
                raise
            await _answer(413, str(e), "body_too_large", scope, receive, send)

    def _refusal(self, scope, headers: dict) -> tuple[int, str, str] | None:
        """(status, message, code) of a request refused before its handler, or None."""
        host = headers.get("host")
        if not self.access.host_ok(host):
            return 403, (f"the Host {host!r} is not served here; start the server with --allowed-hosts "
                         f"{host!r} to accept it"), "host_not_allowed"
        origin = headers.get("origin")
        if not self.access.origin_ok(origin, host, scope.get("scheme", "http")):
            return 403, (f"requests from the web origin {origin!r} are not allowed; start the server with "
                         f"--allowed-origins {origin!r} to allow it"), "origin_not_allowed"
        path = scope["path"]
        state = scope.setdefault("state", {})
        state.setdefault("key_name", DEFAULT_NAME)  # (an outer layer may have named the key: tests)
        if self.keys and (path.startswith("/v1") or path in KEYED_ROUTES):
            name = self.keys.name_of(headers.get("authorization", ""))
            if name is None:
                return 401, "missing or wrong API key: send 'Authorization: Bearer <key>'", "invalid_api_key"
            state["key_name"] = name
        if scope["method"] == "POST":
            return _media_refusal(path, headers)
        return None


def _media_refusal(path: str, headers: dict) -> tuple[int, str, str] | None:
    """415 unless a POST body is JSON (a multipart form on the upload route). A body-less POST
    (cancelling a batch) needs no type."""
    kind = headers.get("content-type", "").split(";", 1)[0].strip().lower()
    has_body = headers.get("content-length", "0") != "0" or "transfer-encoding" in headers
    got = kind or "no Content-Type"
    if path == UPLOAD_ROUTE:
        if kind == "multipart/form-data":
            return None
        return 415, f"POST {UPLOAD_ROUTE} takes multipart/form-data, got {got}", "unsupported_media_type"
    if kind == "application/json" or kind.endswith("+json") or (not kind and not has_body):
        return None
    return 415, f"the body must be JSON sent with 'Content-Type: application/json', got {got}", "unsupported_media_type"


async def _answer(status: int, message: str, code: str, scope, receive, send) -> None:
    headers = {"Connection": "close"} if status == 413 else None  # the rest of the body is not read
    await error(status, message, code=code, headers=headers)(scope, receive, send)
