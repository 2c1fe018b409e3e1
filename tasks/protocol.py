"""OpenAI's error and answer objects, built here and nowhere else: :class:`RequestError`, and
:class:`Answer`, which each face formats (a file or Batch API line: :func:`output_line`; an HTTP body or
SSE chunks; a Python object; a terminal's text).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

STATUS = {"invalid_request_error": 400, "not_found_error": 404, "rate_limit_error": 429, "server_error": 500}


class RequestError(ValueError):
    """A request that cannot run; becomes {"error": {"message", "type", "param"}}. ``reason``: the kind
    the run summary counts (default: the param, else "line"; e.g. "budget" where the param says less);
    ``status``: the HTTP status (default: the type's, 400 for the request's own fault, 500 for ours)."""

    code: str | None = None  # OpenAI's error code in HTTP bodies (the Batch API's StoreError sets it)

    def __init__(self, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 reason: str | None = None, status: int | None = None):
        super().__init__(message)
        self.message, self.param, self.kind = message, param, kind
        self.reason = reason or param or "line"
        self.status = status or STATUS.get(kind, 500)

    def to_dict(self) -> dict:
        return {"message": self.message, "type": self.kind, "param": self.param}


CANCELLED = RequestError("the request file (the batch) was cancelled before this request finished", None,
                         "batch_cancelled", reason="cancelled")


def server_error(message: str, status: int = 500) -> RequestError:
    """A failure on our side (a computation that raised, a shutdown: 503), not the request's fault."""
    return RequestError(message, None, "server_error", reason="computation", status=status)


@dataclass(frozen=True)
class Answer:
    """One request's outcome for its source: ``result`` (OpenAI's completion or chat object), or
    ``error``, or ``dead``: the engine stopped before answering (why)."""

    result: dict | None = None
    error: RequestError | None = None
    dead: str | None = None

    @property
    def ok(self) -> bool:
        return self.result is not None

    @classmethod
    def from_wire(cls, body: dict) -> Answer:
        """An answer as the last rank sends it back: ``{"result": ...}`` or ``{"error": ...}``."""
        if (e := body.get("error")) is not None:
            return cls(error=RequestError(str(e.get("message", "failed")), e.get("param"),
                                          e.get("type") or "server_error"))
        return cls(result=body["result"])


def output_line(raw: object, custom_id: str | None, result: dict | None = None, error: dict | None = None) -> dict:
    """The line written for one request: the seed's {"request", "result"|"error"} or a Batch API line."""
    if custom_id is None:
        return {"request": raw, "result": result} if error is None else {"request": raw, "error": error}
    rid = "req_" + uuid.uuid4().hex[:24]
    line = {"id": "batch_req_" + uuid.uuid4().hex[:24], "custom_id": custom_id}
    if error is None:
        line.update(response={"status_code": 200, "request_id": rid, "body": result}, error=None)
    else:
        line.update(response={"status_code": 400, "request_id": rid, "body": {"error": error}},
                    error={"code": error.get("type"), "message": error["message"]})
    return line
