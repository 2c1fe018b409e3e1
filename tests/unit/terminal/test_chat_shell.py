"""The chat shell's conversation, commands and window trimming, with a recording backend (no model,
no terminal: tests/integration/test_chat.py drives the real thing through a pty)."""

from __future__ import annotations

import http.server
import io
import json
import threading

from pipeline.config.options import parse_options
from terminal.chat_backends import BackendError, HttpBackend
from terminal.chat_shell import ChatShell, Conversation


class Backend:
    """Answers "A<n>" in two pieces; counts a prompt's tokens as its characters."""

    def __init__(self, context=None, has_template=True, refuse_over=None):
        self.model, self.adapters, self.where = "base", ["support"], "test"
        self.context, self.has_template, self.refuse_over = context, has_template, refuse_over
        self.sent: list[tuple[dict, bool]] = []

    def tokens(self, body, chat):
        return len(json.dumps(body["messages"]) if chat else body["prompt"])

    def render(self, messages):
        return "|".join(f"{m['role']}={m['content']}" for m in messages)

    def generate(self, body, chat):
        if self.refuse_over is not None and self.tokens(body, chat) > self.refuse_over:
            raise BackendError("over the context window", context=True)
        self.sent.append((body, chat))
        n = len(self.sent)
        yield "A"
        yield str(n)


class Lines:
    """A Terminal stand-in: the given lines, then end of input."""

    def __init__(self, lines):
        self.lines = list(lines)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass

    def read(self, prompt):
        if not self.lines:
            raise EOFError
        return self.lines.pop(0)

    def streaming(self):
        return _NoKeys()


class _NoKeys:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass

    def interrupted(self):
        return False


def shell(lines, backend=None, *flags):
    opts = parse_options(["--chat", "--temperature", "0.7", *flags])
    out = io.StringIO()
    sh = ChatShell(backend or Backend(), opts, Lines(lines), out)
    assert sh.run() == 0
    return sh, out.getvalue()


def test_history_and_template_messages():
    sh, out = shell(["hi", "/system be brief", "again", "/context"])
    assert "A1\n" in out and "A2\n" in out
    body, chat = sh.backend.sent[1]
    assert chat and body["messages"] == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
                                         {"role": "assistant", "content": "A1"}, {"role": "user", "content": "again"}]
    assert body["temperature"] == 0.7
    assert "system=be brief|user=hi|assistant=A1|user=again" in out


def test_commands(tmp_path):
    saved = tmp_path / "chat.json"
    sh, out = shell(["/set temperature 0", "/set top_k x", "/set bogus 1", "/nope", "q1", "q2", "/undo", "/show",
                     "/adapter support", "q3", "/adapter missing", f"/save {saved}", "/reset", "/show", "/help",
                     "/quit", "never read"])
    assert "(temperature = 0.0)" in out
    assert "/set top_k: 'x' is not an integer" in out
    assert "usage: /set NAME VALUE" in out
    assert "unknown command /nope" in out
    assert "(the last exchange is forgotten)" in out and "exchanges kept: 1" in out
    assert sh.backend.sent[-1][0]["model"] == "support"
    assert "/adapter missing: no such adapter; adapters: support" in out
    data = json.loads(saved.read_text())
    assert data["model"] == "support" and [m["content"] for m in data["messages"]] == ["q1", "A1", "q3", "A3"]
    assert "exchanges kept: 0" in out and "/context" in out  # /reset, then /help lists the commands
    assert len(sh.backend.sent) == 3  # nothing after /quit


def test_base_model_formats():
    sh, out = shell(["what?", "more?", "/context"], Backend(), "--user-msg-fmt", r"Q: {}\nA:",
                    "--assistant-msg-fmt", r"{}\n\n", "--system-prompt", "Answer briefly.")
    body, chat = sh.backend.sent[1]
    assert not chat
    assert body["prompt"] == "Answer briefly.\nQ: what?\nA:A1\n\nQ: more?\nA:"
    assert "---- the last prompt sent ----\nAnswer briefly.\nQ: what?" in out


def test_no_template_gets_plain_formats():
    sh, out = shell(["hi"], Backend(has_template=False))
    assert "no chat template" in out
    assert sh.backend.sent[0][0]["prompt"] == "User: hi\nAssistant: "


def test_oldest_turns_dropped_to_fit_the_window():
    backend = Backend(context=230)  # characters stand for tokens; max_tokens 128 leaves ~100 for the prompt
    sh, out = shell(["first question", "second question", "third question"], backend)
    assert "oldest exchange was dropped" in out
    last = backend.sent[-1][0]["messages"]
    assert last[-1]["content"] == "third question" and last[0]["content"] != "first question"
    assert backend.tokens(backend.sent[-1][0], True) + 128 <= 230


def test_server_side_context_error_drops_turns():
    backend = Backend(refuse_over=120)  # a client: the server says when the prompt is over the window
    sh, out = shell(["first question", "second question", "third question"], backend)
    assert "oldest exchange was dropped" in out
    assert len(backend.sent) == 3


def test_a_request_that_fails_anyway_keeps_the_exchanges_dropped_for_it():
    class Window(Backend):  # the pipeline's own check: prompt + max_tokens over the window is the request's error
        def generate(self, body, chat):
            if self.tokens(body, chat) + body["max_tokens"] > self.context:
                raise BackendError("prompt + max_tokens exceeds the context window", context=True)
            yield from super().generate(body, chat)

    # max_tokens alone is over the window: dropping every exchange could not make the request fit
    sh, out = shell(["q1", "q2", "/set max_tokens 1000", "q3"], Window(context=400))
    assert "dropped; 0 kept" in out and "(the 2 exchange(s) dropped for it are kept)" in out
    assert sh.conv.turns == [("q1", "A1"), ("q2", "A2")]
    # a server that refuses the new turn even alone
    sh, out = shell(["q1", "q2", "a question much too long for this tiny server's window"], Backend(refuse_over=80))
    assert "(the 1 exchange(s) dropped for it are kept)" in out and sh.conv.turns == [("q2", "A2")]


def test_error_is_reported_and_shell_goes_on():
    class Failing(Backend):
        def generate(self, body, chat):
            raise BackendError("the server answered 400: bad")
            yield  # a generator

    sh, out = shell(["hi", "/show"], Failing())
    assert "error: the server answered 400: bad" in out and "exchanges kept: 0" in out


def test_conversation_formatting():
    c = Conversation("sys\n", [("u1", "a1")])
    assert c.formatted("u2", "<{}>", "[{}]") == "sys\n<u1>[a1]<u2>["
    assert c.messages() == [{"role": "system", "content": "sys\n"}, {"role": "user", "content": "u1"},
                            {"role": "assistant", "content": "a1"}]


def test_a_server_that_goes_away_mid_answer_is_an_error_and_the_shell_goes_on():
    """--chat --url: a stream cut in a chunk (uvicorn's chunked encoding: IncompleteRead) or closed before
    its [DONE] is the turn's error, on a line of its own; not a traceback, nor a short answer kept as whole."""
    delta = b'data: {"choices":[{"delta":{"content":"hel"}}]}\n\n'
    cuts = [b"Transfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n50\r\ndata: {" % (len(delta), delta),
            b"Connection: close\r\n\r\n" + delta]

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # /v1/models
            self.wfile.write(b'HTTP/1.1 200 OK\r\nContent-Length: 21\r\n\r\n{"data":[{"id":"m"}]}')

        def do_POST(self):  # the answer, cut
            self.rfile.read(int(self.headers["Content-Length"]))
            self.wfile.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n" + cuts.pop(0))
            self.close_connection = True

    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        sh, out = shell(["one", "two", "/show"], HttpBackend(f"http://127.0.0.1:{server.server_port}"))
        server.shutdown()
    assert out.count("hel\nerror: ") == 2 and "IncompleteRead" in out and "closed the stream before its end" in out
    assert "exchanges kept: 0" in out
