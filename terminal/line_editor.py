"""The chat shell's terminal: line editing (GNU readline: history, arrow keys) and Ctrl-C as a key rather
than a signal. On a terminal the interrupt character is off while the shell runs, so Ctrl-C sends no
SIGINT (under torchrun that would reach torchrun, which stops every rank): at the prompt readline binds it
to "clear the line"; while an answer streams (cbreak mode) the shell polls for its byte, which stops the
answer, and keeps other keys typed for the next read. Without a terminal Ctrl-C is a KeyboardInterrupt.
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
        self.typed = b""  # keys typed while an answer streamed, for the next read
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
            line = self._line(prompt if not lines else "... ")
            if line.endswith("\\") and not line.endswith("\\\\"):
                lines.append(line[:-1])
                continue
            lines.append(line)
            return "\n".join(lines)

    def _line(self, prompt: str) -> str:
        """A line typed ahead while an answer streamed (echoed after the prompt), else :func:`input`'s (which
        finishes a partial one typed ahead, put in readline's buffer). EOFError for a Ctrl-D typed ahead."""
        if not self.typed:
            return input(prompt)
        text = self.typed.decode(errors="replace")
        if text.startswith("\x04"):
            self.typed = b""
            raise EOFError
        line, newline, rest = text.partition("\n")
        if newline:
            self.typed = rest.encode()
            print(prompt + line, flush=True)
            return line
        self.typed = b""
        if readline is not None and line:
            readline.set_startup_hook(lambda: (readline.insert_text(line), readline.set_startup_hook(None)))
        return input(prompt)

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
        """Ctrl-C pressed since the answer began. Other keys are kept for the next read (those typed before
        a Ctrl-C are dropped with it: it clears what was typed, as at the prompt)."""
        if self.hit or not self.term.tty:
            return self.hit
        while select.select([self.term.fd], [], [], 0)[0]:
            data = os.read(self.term.fd, 64)
            if not data:
                break
            if CTRL_C in data:
                self.hit = True
                self.term.typed = data.rsplit(CTRL_C, 1)[1]
            else:
                self.term.typed += data.replace(b"\r", b"\n")
        return self.hit
