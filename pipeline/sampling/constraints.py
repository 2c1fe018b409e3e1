"""Structured outputs on the last rank: each constrained row's matcher, its next-token mask for the
sampling step, and the figures a file's summary reports.

The Head calls :meth:`Constraints.matcher` when a constrained row enters, :meth:`Constraints.ahead`
once it was fed a token (its next mask computed while the stages run), :meth:`Constraints.mask` at the
sampling step and :meth:`Constraints.forget` when it finishes.
"""

from __future__ import annotations

import time

import torch

from pipeline.sampling.grammar import GrammarError, Grammars, MasksAhead, allowed_mask


class Constraints:
    def __init__(self, grammars: Grammars | None, eos_ids: set[int], masks_on_thread: bool = True):
        self.grammars, self.eos_ids = grammars, eos_ids  # compiled grammars (None: none on this rank)
        self.masks = MasksAhead(masks_on_thread)  # constrained rows' next masks (ahead: while the stages run)
        self.rows = 0  # rows sampled under a grammar's mask, this file
        self.mask_seconds = 0.0  # the sampling step waiting for (or computing) those masks
        self._compile_base = (0.0, 0)  # the grammars' compile counters when the file opened

    @property
    def vocab(self) -> int:
        """The tokenizer's vocabulary: llguidance's mask width."""
        return self.grammars.tok.vocab_size

    def start_file(self) -> None:
        self.rows, self.mask_seconds = 0, 0.0
        self.masks.ahead_seconds = 0.0  # (no mask is pending between files)
        self._compile_base = (self.grammars.compile_seconds, self.grammars.compiled) if self.grammars else (0.0, 0)

    def matcher(self, structured: dict):
        """A new constrained row's matcher (GrammarError when none can be made here), its first mask started."""
        if self.grammars is None:
            raise GrammarError("no grammar compiler on this rank")
        m = self.grammars.matcher(structured)
        self.rows += 1
        self.masks.start(m)  # (a chunked prompt's later passes)
        return m

    def ahead(self, matchers: list) -> None:
        """The pass's fed rows' next masks, computed as one batch while the stages run."""
        for m in matchers:
            self.masks.start(m)
        if self.grammars is not None and self.grammars.tok is not None:
            self.masks.flush(self.vocab)

    def mask(self, matchers: list, vocab: int, device: torch.device) -> torch.Tensor | None:
        """(rows, vocab) bool of what each row may take next (some row is constrained; None for the others)."""
        t0 = time.perf_counter()
        allowed = allowed_mask(matchers, self.eos_ids, self.vocab, vocab, device, self.masks)
        self.mask_seconds += time.perf_counter() - t0
        return allowed

    def forget(self, matcher) -> None:
        self.masks.forget(matcher)

    def figures(self) -> dict:
        """This file's structured-output figures for its summary ({} when no row was constrained)."""
        if not self.rows or self.grammars is None:
            return {}
        return {"constrained_rows": self.rows,
                "grammars_compiled": self.grammars.compiled - self._compile_base[1],
                "compile_seconds": round(self.grammars.compile_seconds - self._compile_base[0], 4),
                "mask_seconds": round(self.mask_seconds, 4),
                "mask_ahead_seconds": round(self.masks.ahead_seconds, 4), "masks_on_thread": self.masks.on_thread}
