"""The chat shell with the real model, in this process: its conversation (the default model's path question,
history, /set, /system, /context, /show, /undo, bad commands, a conversation longer than the window, Ctrl-C
mid-answer, /quit) through a scripted terminal, on the pipeline at P = 1 and P = 2 (``--chat --in-process``)
and as a client of the shared in-process "default" server (``--chat --url``, a key of its own; a wrong key;
the server's chat template). The shell in a real terminal (pexpect's pty, Ctrl-C as a key, readline, torchrun
sharing the terminal): tests/integration/test_chat.py."""

from __future__ import annotations

import io

import pytest
import torch

import dist_inference_runner
from pipeline.config.options import parse_options
from terminal import interactive
from terminal.chat_backends import HttpBackend
from terminal.chat_shell import ChatShell

BASE = ["--user-msg-fmt", r"Passage: {}\nAnswer:", "--assistant-msg-fmt", r"{}\n\n", "--stop", r"\n",
        "--max-tokens", "6", "--num-threads", "1", "--no-progress"]
PATH = ("The kitchen is north of the hallway.\nThe garden is west of the kitchen.\n"
        "Question: How do you go from the hallway to the garden?")
CONVERSATION = [
    "/set temperature 0", PATH, "/frobnicate now", "/set nothing",
    "The office is east of the garden.\nQuestion: How do you go from the garden to the office?", "/context",
    "/system You are terse.", "/context",
    "The bedroom is south of the office.\nQuestion: How do you go from the office to the bedroom?", "/context", "/show",
    "/set max_tokens 2000", "/set stop none", "Once upon a time",  # longer than the window with 3 exchanges; Ctrl-C
    "/undo", "/show", "/set max_tokens 6", "/system", "/set stop \\n", PATH, "/quit", "never read",
]
CTRL_C = CONVERSATION.index("Once upon a time")


class Script:
    """A terminal stand-in: types the given lines, one a prompt (then end of input), and presses Ctrl-C once
    the answer to line ``ctrl_c`` has begun. ``said[i]``: what the shell printed after line i."""

    def __init__(self, lines: list[str], out: io.StringIO, ctrl_c: int | None = None):
        self.lines, self.out, self.ctrl_c = list(lines), out, ctrl_c
        self.typed: list[str] = []
        self.marks: list[int] = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass

    def read(self, prompt: str) -> str:
        self.marks.append(self.out.tell())
        if len(self.typed) == len(self.lines):
            raise EOFError
        self.typed.append(self.lines[len(self.typed)])
        return self.typed[-1]

    def streaming(self):
        return _Keys(self, len(self.typed) - 1 == self.ctrl_c, self.out.tell())

    @property
    def said(self) -> list[str]:
        text = self.out.getvalue()
        ends = [*self.marks[1:], len(text)]
        return [text[a:b] for a, b in zip(self.marks, ends)]


class _Keys:
    def __init__(self, script: Script, press: bool, start: int):
        self.script, self.press, self.start = script, press, start

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass

    def interrupted(self) -> bool:
        """Ctrl-C once some of the answer is printed (as a person presses it while it streams)."""
        return self.press and self.script.out.tell() > self.start


def check_conversation(script: Script) -> None:
    """What every face of the shell must have answered to :data:`CONVERSATION` (tests/integration/test_chat.py
    checks the same in a terminal)."""
    said = dict(enumerate(script.said))
    assert script.typed == CONVERSATION[:-1]  # nothing read after /quit
    assert "(temperature = 0.0)" in said[0]
    assert " north west" in said[1], said[1]
    assert "unknown command /frobnicate" in said[2] and "usage: /set NAME VALUE" in said[3]
    first = ("Passage: The kitchen is north of the hallway.\nThe garden is west of the kitchen.\n"
             "Question: How do you go from the hallway to the garden?\nAnswer: north west\n\nPassage: The office")
    assert first in said[5], said[5]  # history: the first exchange, answered, before the second question
    assert "(system prompt: 'You are terse.')" in said[6]
    assert "---- the last prompt sent ----\nPassage: The kitchen" in said[7]  # applies from the next request
    assert "---- the last prompt sent ----\nYou are terse.\nPassage: The kitchen" in said[9]
    assert "temperature: 0.0" in said[10] and "exchanges kept: 3" in said[10], said[10]
    stopped = said[CTRL_C]
    assert "its oldest exchange was dropped; 0 kept)" in stopped, stopped
    assert "(stopped: the answer so far is kept; /undo forgets it)" in stopped, stopped
    assert "(the last exchange is forgotten)" in said[CTRL_C + 1]
    assert "exchanges kept: 0" in said[CTRL_C + 2]
    assert "(max_tokens = 6)" in said[CTRL_C + 3]
    assert " north west" in said[CTRL_C + 6], said[CTRL_C + 6]  # still answering after the Ctrl-C


@pytest.mark.parametrize("stages", [1, 2], ids=["P1", "P2"])
def test_chat_on_the_pipeline(stages, monkeypatch):
    """``--chat`` with the model in this process (every rank a thread): the shell's conversation end to end."""
    out, scripts = io.StringIO(), []

    def shell(backend, opts):
        scripts.append(Script(CONVERSATION, out, CTRL_C))
        return ChatShell(backend, opts, scripts[-1], out)

    monkeypatch.setattr(interactive, "ChatShell", shell)
    argv = ["--chat", *BASE, "--in-process", "--pipeline-group-size", str(stages)]
    threads = torch.get_num_threads()
    try:
        assert dist_inference_runner.main(argv, signals=False) == 0, out.getvalue()[-3000:]
    finally:
        torch.set_num_threads(threads)  # rank 0 ran on this thread (--num-threads 1)
    check_conversation(scripts[0])


@pytest.fixture(scope="module")
def server(servers):
    return servers.get("default", 1)


def test_chat_client_of_serve(server, capsys):
    """``--chat --url``: the same conversation over HTTP (a stopped answer's rows freed on the server); a wrong key
    exits 1 naming the 401; without the format flags the server's chat template renders the messages."""
    key = server.key()
    out = io.StringIO()
    script = Script(CONVERSATION, out, CTRL_C)
    opts = parse_options(["--chat", "--url", server.url(), "--api-key", key, *BASE])
    assert ChatShell(HttpBackend(server.url(), key), opts, script, out).run() == 0
    check_conversation(script)
    assert server.pending() == 0
    assert dist_inference_runner.main(["--chat", "--url", server.url(), "--api-key", "wrong"], signals=False) == 1
    assert "401" in capsys.readouterr().err
    out = io.StringIO()
    script = Script(["hello", "/context"], out)
    opts = parse_options(["--chat", "--url", server.url(), "--api-key", key, "--max-tokens", "3", "--temperature", "0"])
    assert ChatShell(HttpBackend(server.url(), key), opts, script, out).run() == 0
    assert '"role": "user",\n    "content": "hello"' in script.said[1], script.said[1]
