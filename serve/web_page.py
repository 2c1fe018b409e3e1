"""The chat page at ``GET /`` (serve/static/index.html), served as it is. It calls this server's own
``/v1`` routes with the key typed into it (serve.guard applies as to any client); its Content-Security-Policy
lets it load nothing from elsewhere and talk only to this server.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import Response

PAGE = Path(__file__).resolve().parent / "static" / "index.html"
HEADERS = {
    "Cache-Control": "no-store",
    "Content-Security-Policy": ("default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
                                "connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; "
                                "frame-ancestors 'none'"),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}


def add_page_route(app: FastAPI) -> None:
    page = PAGE.read_bytes()  # read once: a missing file fails at start-up, not per request

    @app.get("/", include_in_schema=False)
    async def index():
        return Response(page, 200, headers=HEADERS, media_type="text/html; charset=utf-8")
