"""The chat shell's terminal: line editing (the stdlib's GNU readline: history, arrow keys) and Ctrl-C
as a key rather than a signal.

On a terminal the shell turns off the interrupt character (VINTR) for its lifetime, so Ctrl-C reaches no
process as SIGINT:
under torchrun the workers run in their own session and the terminal's SIGINT would go to torchrun,
which stops every rank. At the prompt readline reads Ctrl-C as a key bound to "clear the line";
while an answer streams, the terminal is in cbreak mode and the shell polls for the Ctrl-C byte,
which stops that answer. Without a terminal (stdin a pipe) Ctrl-C is the usual KeyboardInterrupt.
"""

from __future__ import annotations

import os
import select
import sys
import termios

try:  # GNU readline: line editing and history for input()
    import readline
except ImportError:  # pragma: no cover - a Python built without it: plain input()
    readline = None

CTRL_C = b"\x03"


class Terminal:
    def __init__(self, stdin=None):
        self.stdin = stdin or sys.stdin
        self.fd = self.stdin.fileno()
        self.tty = os.isatty(self.fd)
        self.saved = termios.tcgetattr(self.fd) if self.tty else None
        if readline is not None:
            readline.parse_and_bind(r'"\C-c": "\C-e\C-u\C-m"')  # Ctrl-C at the prompt: an empty line
            readline.set_auto_history(True)

    def __enter__(self) -> "Terminal":
        if self.tty:
            attrs = termios.tcgetattr(self.fd)
            # Ctrl-C is a key, not a signal: no interrupt character (readline turns ISIG back on while it
            # reads a line, but it cannot make a character the terminal no longer has into a signal)
            attrs[6][termios.VINTR] = b"\x00" if isinstance(attrs[6][termios.VINTR], bytes) else 0
            termios.tcsetattr(self.fd, termios.TCSANOW, attrs)
        return self

    def __exit__(self, *exc) -> None:
        if self.tty:
            termios.tcsetattr(self.fd, termios.TCSANOW, self.saved)

    def read(self, prompt: str) -> str:
        """One line (EOFError at end of input). A line ending in a backslash continues on the next."""
        lines = []
        while True:
            line = input(prompt if not lines else "... ")
            if line.endswith("\\") and not line.endswith("\\\\"):
                lines.append(line[:-1])
                continue
            lines.append(line)
            return "\n".join(lines)

    def streaming(self) -> "Streaming":
        return Streaming(self)


class Streaming:
    """While an answer streams: keys are not echoed, and :meth:`interrupted` says whether Ctrl-C was pressed."""

    def __init__(self, term: Terminal):
        self.term = term
        self.hit = False

    def __enter__(self) -> "Streaming":
        if self.term.tty:
            self.saved = termios.tcgetattr(self.term.fd)
            attrs = termios.tcgetattr(self.term.fd)
            attrs[3] &= ~(termios.ICANON | termios.ECHO | termios.ISIG)
            attrs[6][termios.VMIN], attrs[6][termios.VTIME] = 0, 0
            termios.tcsetattr(self.term.fd, termios.TCSANOW, attrs)
        return self

    def __exit__(self, *exc) -> None:
        if self.term.tty:  # the settings before the answer, exactly (VMIN/VTIME included)
            termios.tcsetattr(self.term.fd, termios.TCSANOW, self.saved)

    def interrupted(self) -> bool:
        """Ctrl-C pressed since the answer began (other keys typed meanwhile are dropped)."""
        if self.hit or not self.term.tty:
            return self.hit
        while select.select([self.term.fd], [], [], 0)[0]:
            data = os.read(self.term.fd, 64)
            if not data:
                break
            if CTRL_C in data:
                self.hit = True
        return self.hit
