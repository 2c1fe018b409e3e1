"""JSON answers in OpenAI's shapes, and JSON request bodies read (their size is the guard's to bound)."""

from __future__ import annotations

import orjson
from fastapi import Request
from fastapi.responses import Response

from tasks.batch_store import StoreError
from tasks.requests import json_problem


def error(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
          code: str | None = None, headers: dict | None = None) -> Response:
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return Response(orjson.dumps(body), status, headers=headers, media_type="application/json")


def model_not_found(name: object, served: tuple[str, ...]) -> Response:
    """404 for a "model" this server does not serve (``served``: the base model's name, its adapters')."""
    return error(404, f"the model {name!r} does not exist; this server serves {', '.join(map(repr, served))}",
                 param="model", code="model_not_found")


def ok(obj: dict) -> Response:
    return Response(orjson.dumps(obj), 200, media_type="application/json")


async def read_json(request: Request):
    """The request's JSON body (its size is serve.guard's to bound, as it arrives)."""
    body = await request.body()
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as e:
        raise StoreError(f"the body is not valid JSON: {json_problem(body, e)}", 400) from None
