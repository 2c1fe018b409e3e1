"""Where the chat shell's requests go: the pipeline loaded in this process (:class:`LocalBackend`, through
serve mode's engine) or a running ``--serve`` server (:class:`HttpBackend`, its streaming
``/v1/chat/completions`` and ``/v1/completions``). Both take an OpenAI request body and yield the
answer's text as it is generated; closing the generator stops the answer (the rows are freed).
"""

from __future__ import annotations

import http.client
import json
import os
from typing import Iterator
from urllib.parse import urlsplit

from tasks.protocol import RequestError

from pipeline.config.serve_options import API_KEY_ENVS
from terminal.local_engine import LocalEngine, error_of


class BackendError(Exception):
    """An answer that did not come: the request's error (``context`` set when it exceeds the window)."""

    def __init__(self, message: str, context: bool = False):
        super().__init__(message)
        self.context = context


def _is_context_error(message: str, param) -> bool:
    return param in ("messages", "prompt") and "context window" in message


class LocalBackend:
    """The loaded pipeline: requests go to serve mode's engine on the pipeline thread."""

    def __init__(self, engine: LocalEngine, model: str, adapters: list[str]):
        self.engine, self.model, self.adapters = engine, model, adapters
        self.context = engine.driver.max_positions
        self.has_template = bool(getattr(engine.tok, "chat_template", None))
        self.where = "this process"

    def tokens(self, body: dict, chat: bool) -> int | None:
        """The prompt's length in tokens (None when it cannot be rendered)."""
        try:
            if chat:
                return len(self.engine.tok.apply_chat_template(body["messages"], add_generation_prompt=True,
                                                               tokenize=True))
            return len(self.engine.tok(body["prompt"], add_special_tokens=True)["input_ids"])
        except Exception:  # noqa: BLE001 - the request itself will say what is wrong
            return None

    def render(self, messages: list[dict]) -> str | None:
        """The exact text the chat template makes of ``messages`` (what the model reads)."""
        try:
            return self.engine.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except Exception:  # noqa: BLE001
            return None

    def generate(self, body: dict, chat: bool) -> Iterator[str]:
        try:
            ticket = self.engine.submit(body, chat, stream=True)
        except RequestError as e:
            raise BackendError(e.message, _is_context_error(e.message, e.param)) from None
        try:
            while ticket.answer is None:
                event = self.engine.events(ticket)
                if event is None:
                    yield ""  # nothing new yet: the shell looks for Ctrl-C meanwhile
                elif event[0] == "delta":
                    yield event[1][1]
            err = error_of(ticket.answer)
            if err is not None:
                raise BackendError(err.message, _is_context_error(err.message, err.param))
            choice = ticket.answer.result["choices"][0]  # answered: the last deltas held back for stop strings
            full = choice["message"]["content"] if chat else choice["text"]
            sent = ticket.text.get(0, "")
            if full.startswith(sent) and len(full) > len(sent):
                yield full[len(sent):]
        finally:
            self.engine.cancel(ticket)


class HttpBackend:
    """A running server: streaming requests over HTTP (the key as ``Authorization: Bearer``)."""

    def __init__(self, url: str, api_key: str | None = None, timeout: float = 600.0):
        parts = urlsplit(url)
        self.https, self.host, self.port = parts.scheme == "https", parts.hostname, parts.port
        self.base = parts.path.rstrip("/").removesuffix("/v1")
        key = api_key or next((os.environ[e] for e in API_KEY_ENVS if os.environ.get(e)), None)
        self.headers = {"Content-Type": "application/json", "Accept": "text/event-stream",
                        **({"Authorization": f"Bearer {key}"} if key else {})}
        self.timeout = timeout
        self.where = url
        self.context, self.has_template = None, True  # unknown: the server's template applies
        models = self._get("/v1/models")["data"]
        self.model = models[0]["id"]
        self.adapters = [m["id"] for m in models[1:]]

    def _connection(self) -> http.client.HTTPConnection:
        cls = http.client.HTTPSConnection if self.https else http.client.HTTPConnection
        return cls(self.host, self.port, timeout=self.timeout)

    def _get(self, path: str) -> dict:
        conn = self._connection()
        try:
            conn.request("GET", self.base + path, headers=self.headers)
            resp = conn.getresponse()
            data = resp.read()
        except OSError as e:
            raise BackendError(f"cannot reach the server at {self.where}: {e}") from None
        finally:
            conn.close()
        if resp.status != 200:
            message = _error(data).get("message") or data[:200].decode("utf-8", "replace")
            raise BackendError(f"the server answered {resp.status}: {message}")
        return json.loads(data)

    def tokens(self, body: dict, chat: bool) -> int | None:
        return None  # the server counts: a prompt over its window comes back as a context error

    def render(self, messages: list[dict]) -> str | None:
        return None  # the server applies its template

    def generate(self, body: dict, chat: bool) -> Iterator[str]:
        path = self.base + ("/v1/chat/completions" if chat else "/v1/completions")
        conn = self._connection()
        try:
            conn.request("POST", path, json.dumps({**body, "stream": True}).encode(), self.headers)
            resp = conn.getresponse()
            if resp.status != 200:
                data = resp.read()
                err = _error(data)
                raise BackendError(f"the server answered {resp.status}: {err.get('message', data[:200])}",
                                   resp.status == 400 and _is_context_error(err.get("message", ""), err.get("param")))
            yield from _sse_text(resp, chat)
        except (OSError, http.client.HTTPException) as e:  # before or during the answer (a server gone: IncompleteRead)
            raise BackendError(f"the connection to the server at {self.where} failed: {e!r}") from None
        finally:
            conn.close()  # an answer stopped early: the server sees the client leave and frees its rows


def _sse_text(resp, chat: bool) -> Iterator[str]:
    """The text deltas of a server-sent event stream (OpenAI's chunks)."""
    for raw in resp:
        line = raw.decode("utf-8").strip()
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        chunk = json.loads(data)
        if "error" in chunk:
            raise BackendError(chunk["error"].get("message", "the request failed"))
        for choice in chunk.get("choices") or []:
            text = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
            if text:
                yield text
    raise BackendError("the answer broke off: the server closed the stream before its end")


def _error(data: bytes) -> dict:
    try:
        return json.loads(data).get("error") or {}
    except (ValueError, AttributeError):
        return {}
