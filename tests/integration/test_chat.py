"""The chat shell through a real terminal (pexpect's pty) at P = 2 under torchrun, every rank sharing the
terminal and rank 0 reading it: the default model's path question, history, /set temperature 0, /system,
/context, Ctrl-C as a key mid-answer (the terminal's interrupt character off) and at the prompt (readline
clears the line), lines typed right after an answer, bad commands, /quit. The same conversation on the
pipeline at P = 1 and 2 in process and as a client of a server: tests/runs/test_chat_runs.py."""

from __future__ import annotations

import sys

import pytest

from tests.utils import RUNNER, _env, free_port

pexpect = pytest.importorskip("pexpect", reason="pexpect drives the shell through a pty (requirements-test.txt)")

PROMPT = ">>> "
BASE = ["--user-msg-fmt", r"Passage: {}\nAnswer:", "--assistant-msg-fmt", r"{}\n\n", "--stop", r"\n",
        "--max-tokens", "6", "--num-threads", "1", "--no-progress"]


def spawn(args: list[str], log, launcher: list[str] = ()) -> "pexpect.spawn":
    env = _env({"DIST_INFER_LOG": "WARNING", "TERM": "dumb"})
    child = pexpect.spawn(sys.executable, [*launcher, str(RUNNER), *args], env=env, encoding="utf-8", timeout=300,
                          dimensions=(50, 200))
    child.logfile_read = log
    return child


def ask(child, lines: list[str]) -> str:
    """Send a message (continuation lines end in a backslash); the text printed before the next prompt."""
    for line in lines[:-1]:
        child.sendline(line + "\\")
    child.sendline(lines[-1])
    child.expect_exact(PROMPT)
    return child.before


def command(child, line: str) -> str:
    child.sendline(line)
    child.expect_exact(PROMPT)
    return child.before


def conversation(child, ended_by: str) -> None:
    """The session every face must hold up (tests/runs/test_chat_runs.py: CONVERSATION); ends with /quit or end
    of input (Ctrl-D)."""
    child.expect_exact(PROMPT, timeout=400)  # loading
    assert "(temperature = 0.0)" in command(child, "/set temperature 0")
    out = ask(child, ["The kitchen is north of the hallway.", "The garden is west of the kitchen.",
                      "Question: How do you go from the hallway to the garden?"])
    assert " north west" in out, out
    assert "unknown command /frobnicate" in command(child, "/frobnicate now")
    assert "usage: /set NAME VALUE" in command(child, "/set nothing")
    ask(child, ["The office is east of the garden.", "Question: How do you go from the garden to the office?"])
    context = command(child, "/context")
    # history: the first exchange, answered, comes before the second question in the prompt sent
    first = "Passage: The kitchen is north of the hallway.\r\nThe garden is west of the kitchen.\r\n" \
            "Question: How do you go from the hallway to the garden?\r\nAnswer: north west\r\n\r\nPassage: The office"
    assert first in context, context
    assert "(system prompt: 'You are terse.')" in command(child, "/system You are terse.")
    context = command(child, "/context")
    assert "---- the last prompt sent ----\r\nPassage: The kitchen" in context  # applies from the next request
    ask(child, ["The bedroom is south of the office.", "Question: How do you go from the office to the bedroom?"])
    assert "---- the last prompt sent ----\r\nYou are terse.\r\nPassage: The kitchen" in command(child, "/context")
    show = command(child, "/show")
    assert "temperature: 0.0" in show and "exchanges kept: 3" in show, show
    # a conversation longer than the window loses its oldest exchanges (prompt + max_tokens > 2048 positions);
    # Ctrl-C while an answer streams stops the answer, not the shell
    command(child, "/set max_tokens 2000")
    command(child, "/set stop none")
    child.sendline("Once upon a time")
    child.expect_exact("its oldest exchange was dropped; 0 kept)")
    child.expect(r"\r\n\s*\S")  # the answer has begun
    child.sendcontrol("c")
    child.expect_exact("(stopped: the answer so far is kept; /undo forgets it)", timeout=120)
    child.expect_exact(PROMPT)
    child.send("half a line")
    child.sendcontrol("c")  # at the prompt: clears the line, a new prompt
    child.sendline("/undo")  # (readline redraws the prompt while it clears: wait for the answer itself)
    child.expect_exact("(the last exchange is forgotten)")
    child.expect_exact(PROMPT)
    assert "exchanges kept: 0" in command(child, "/show")
    assert "(max_tokens = 6)" in command(child, "/set max_tokens 6")
    command(child, "/system")
    command(child, "/set stop \\n")
    out = ask(child, ["The kitchen is north of the hallway.", "The garden is west of the kitchen.",
                      "Question: How do you go from the hallway to the garden?"])
    assert " north west" in out, out  # still answering after the Ctrl-C
    if ended_by == "quit":
        child.sendline("/quit")
    else:
        child.sendeof()
    child.expect(pexpect.EOF, timeout=120)
    child.close()
    assert child.exitstatus == 0, (child.exitstatus, child.signalstatus)


def test_chat_p2_torchrun(tmp_path):
    """Every rank under torchrun shares the terminal; rank 0 reads it. Lines typed right after an answer
    (pexpect sends them as soon as the prompt shows) are read, not lost."""
    launcher = ["-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
                "--master-port", str(free_port())]
    with open(tmp_path / "chat.log", "w") as log:
        conversation(spawn(["--chat", *BASE], log, launcher), "quit")
