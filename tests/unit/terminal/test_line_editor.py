"""The chat shell's terminal on a real pty (no processes): keys typed while an answer streams are
kept for the next line instead of lost, Ctrl-C stops the answer and clears what was typed before it,
and a Ctrl-D typed ahead ends the shell."""

from __future__ import annotations

import os
import pty

import pytest

from terminal.line_editor import Terminal


@pytest.fixture
def term():
    master, slave = pty.openpty()
    stdin = os.fdopen(slave, "rb", buffering=0)
    with Terminal(stdin) as t:
        yield t, master
    stdin.close()
    os.close(master)


def test_a_line_typed_during_an_answer_is_the_next_line(term, capsys):
    t, master = term
    with t.streaming() as keys:
        os.write(master, b"next question\r")
        assert not keys.interrupted()
    assert t.read(">>> ") == "next question"
    assert capsys.readouterr().out == ">>> next question\n"  # shown as if typed at the prompt


def test_ctrl_c_stops_the_answer_and_clears_what_was_typed_before_it(term):
    t, master = term
    with t.streaming() as keys:
        os.write(master, b"half a li\x03again\r")
        assert keys.interrupted() and keys.interrupted()
    assert t.read(">>> ") == "again"


def test_a_ctrl_d_typed_ahead_ends_input(term):
    t, master = term
    with t.streaming() as keys:
        os.write(master, b"\x04")
        keys.interrupted()
    with pytest.raises(EOFError):
        t.read(">>> ")


def test_two_lines_typed_ahead_come_one_at_a_time(term):
    t, master = term
    with t.streaming() as keys:
        os.write(master, b"one\rtwo\r")
        keys.interrupted()
    assert [t.read(">>> "), t.read(">>> ")] == ["one", "two"]
