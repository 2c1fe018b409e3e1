"""Rank 0's structured-output intake: every distinct constraint compiled once, as its line is read, on
a worker thread with a time limit (``--grammar-timeout``); one that fails or runs out of time becomes
that request's error and the rest of the file runs. With P = 1 the compiled :class:`Grammars` are the
ones the last rank samples with; with P > 1 the last rank compiles each spec once more.
"""

from __future__ import annotations

import threading

from tasks.protocol import RequestError
from pipeline.sampling.grammar import GrammarError, Grammars, spec_key

DEFAULT_GRAMMAR_TIMEOUT = 5.0  # seconds


class GrammarIntake:
    def __init__(self, grammars: Grammars, timeout: float = DEFAULT_GRAMMAR_TIMEOUT):
        self.grammars, self.timeout = grammars, timeout
        self.timed_out: set[str] = set()  # specs that ran out of time: their next requests fail at once
        self.constrained = 0  # requests with a constraint that compiled

    def check(self, spec: dict, param: str = "structured_outputs") -> None:
        """Raise :class:`RequestError` (naming ``param``, the field the constraint came in) unless ``spec``
        compiles within the time limit (cached by text)."""
        key = spec_key(spec)
        if key in self.timed_out:
            raise self._timeout_error(param)
        if not self.grammars.known(spec):
            # a daemon thread per new grammar: one that never ends cannot hold up later ones or the exit
            worker = threading.Thread(target=self._compile_quietly, args=(spec,), daemon=True,
                                      name="grammar-compile")
            worker.start()
            worker.join(self.timeout)
            if worker.is_alive():
                self.timed_out.add(key)
                raise self._timeout_error(param)
        try:
            self.grammars.compile(spec)
        except GrammarError as e:
            raise RequestError(f"the output constraint cannot be compiled: {e}", param, reason="grammar") from None
        self.constrained += 1

    def _compile_quietly(self, spec: dict) -> None:
        try:
            self.grammars.compile(spec)
        except GrammarError:
            pass  # cached as the spec's error: check() raises it

    def _timeout_error(self, param: str) -> RequestError:
        return RequestError(f"the output constraint did not compile within {self.timeout:g} s "
                            "(--grammar-timeout); simplify the schema or raise the limit", param,
                            reason="grammar_timeout")
