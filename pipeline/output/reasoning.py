"""Reasoning models on the last rank: each row's thinking (where it starts and ends in the row's
text), its budget (then the end of the thinking is forced, one token a step, through the sampling
mask), a structured output's grammar held until the answer starts, and a finished row's reasoning
apart from its answer, its ``reasoning_tokens`` and whether the thinking starved its answer. Markers
are found in the row's text, so a marker of several tokens works as one of a single token. The formats
(``--reasoning-parser``) and when a row thinks: docs/usage/reasoning.md.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

START, END = "<think>", "</think>"
CLOSE = "\n</think>\n\n"  # what a budget forces: the end of the thinking and the blank line before the answer
BLANK = "\r\n"  # what separates the end of a thinking from its answer (left out of the answer)
MAY, IN, ANSWER = "may", "in", "answer"  # a row's phase: may open a thinking, thinking, answering


class ReasoningError(ValueError):
    """A --reasoning-parser that cannot work with this model (said before the run starts)."""


@dataclass(frozen=True)
class ReasoningFormat:
    name: str
    forced: tuple[int, ...]  # the ids of CLOSE, forced one a step once a row's budget is spent
    blank_from: int = 0  # where CLOSE's blank line starts in ``forced`` (forced after a natural end under a grammar)
    start_id: int | None = None  # <think>'s id when it is one token (a constrained chat row may open with it)
    always: bool = False  # deepseek_r1: every chat row starts inside the thinking
    start: str = START
    end: str = END


def choose(tokenizer, name: str) -> ReasoningFormat | None:
    """The run's format: ``name`` (``--reasoning-parser``); ``auto``: qwen3 when the chat template
    writes ``<think>``, else none. Raises :class:`ReasoningError` for one that cannot work here."""
    if name == "none":
        return None
    t = getattr(tokenizer, "chat_template", None)  # a text, or named templates
    text = "\n".join(map(str, t.values())) if isinstance(t, dict) else t if isinstance(t, str) else ""
    if name == "gpt_oss" or (name == "auto" and "<|channel|>" in text):
        if name == "auto":
            log.warning("this model's chat template writes gpt-oss's harmony channels, which the runner does not "
                        "parse: results carry the raw text (docs/usage/reasoning.md)")
            return None
        raise ReasoningError("--reasoning-parser gpt_oss: gpt-oss's harmony channels are not parsed (its channel "
                             "markers are special tokens, left out of the text); run with --reasoning-parser none, "
                             "the results then carry the raw text of both channels")
    if name == "auto":
        if START not in text:
            return None
        name = "qwen3"
    forced = tuple(int(t) for t in tokenizer(CLOSE, add_special_tokens=False)["input_ids"])
    if END not in tokenizer.decode(list(forced), skip_special_tokens=True):
        raise ReasoningError(f"--reasoning-parser {name}: this tokenizer cannot write {END!r} back as text (it "
                             "reads it as a special token, or not at all); run with --reasoning-parser none")
    start = tokenizer(START, add_special_tokens=False)["input_ids"]
    blank = next(k for k in range(1, len(forced) + 1)
                 if END in tokenizer.decode(list(forced[:k]), skip_special_tokens=True))
    return ReasoningFormat(name, forced, blank, int(start[0]) if len(start) == 1 else None, name == "deepseek_r1")


@dataclass
class Thinking:
    """One row's thinking, from its admission to its end (held by the row's state on the last rank).
    Character positions are in the row's generated text."""

    phase: str
    budget: int | None  # tokens the model may choose inside the thinking (None: no limit)
    spent: int = 0  # tokens it chose there (forced ones not counted)
    forcing: int = -1  # index of the next forced token in the format's ids (-1: none)
    forced_end: bool = False  # the budget ended the thinking
    start_char: int = 0  # where the thinking's text starts
    end_char: int | None = None  # where its end marker starts
    answer_char: int | None = None  # where the answer starts (after the end marker)
    answer_token: int | None = None  # tokens before the answer (usage's reasoning_tokens)
    grammar: object = None  # the row's structured-output matcher, held until the answer starts

    @property
    def thought(self) -> bool:
        return self.phase == IN or self.end_char is not None

    def tokens(self, generated: int) -> int:
        """Tokens of the thinking (markers included) among ``generated`` tokens: all of them when it never ended."""
        if not self.thought:
            return 0
        return self.answer_token if self.answer_token is not None else generated


def split(th: Thinking | None, text: str) -> tuple[str | None, str]:
    """(reasoning, answer) of a row's text (or of the start of it): the thinking without its markers
    and surrounding blanks, and the text after the end marker without the line breaks that open it; a
    row that never thought: (None, the text unchanged)."""
    if th is None or not th.thought:
        return None, text
    reasoning = text[th.start_char: th.end_char if th.end_char is not None else len(text)].strip()
    return reasoning, text[th.answer_char:].lstrip(BLANK) if th.answer_char is not None else ""


def starved(th: Thinking | None, finish_reason: str, text: str, generated: int = 1) -> str | None:
    """Why a row that ended by length has no answer after its thinking (None: it is not starved; nor is
    a row that generated nothing, ``max_tokens`` 0: a prompt scored)."""
    if th is None or not th.thought or finish_reason != "length" or not generated:
        return None
    if th.answer_char is None:
        return "thinking_unfinished"
    return None if text[th.answer_char:].strip() else "no_answer_after_thinking"  # (blanks are no answer)


class Reasoning:
    """The last rank's side of a run with a reasoning format: rows' thinking from admission to their
    end, the forced tokens' mask, and the figures a file's summary reports."""

    def __init__(self, fmt: ReasoningFormat, detok):
        self.fmt, self.detok = fmt, detok
        self.start_file()

    def start_file(self) -> None:
        self.counts = {"thinking_rows": 0, "reasoning_tokens": 0, "forced_ends": 0, "starved": 0, "retried": 0,
                       "repaired": 0}

    def figures(self) -> dict:
        """This file's figures for its summary ({} when no row thought)."""
        return dict(self.counts) if self.counts["thinking_rows"] or self.counts["starved"] else {}

    # -- a row's way through ----------------------------------------------------------------
    def admit(self, prompt_ids: list[int], budget: int | None, chat: bool) -> Thinking:
        """A new row: inside the thinking when its prompt ends inside one (or, with deepseek_r1, a chat
        row whose prompt did not close one), else a chat row may open one; its budget spent at once when
        it is 0."""
        opens = self._opens(prompt_ids)
        th = Thinking(IN if opens or (self.fmt.always and chat and opens is not None) else
                      MAY if chat and opens is False else ANSWER, budget)
        if th.phase == ANSWER:
            th.answer_char, th.answer_token = 0, 0
        elif th.phase == IN:
            self._spent(th)
        return th

    def _opens(self, prompt_ids: list[int]) -> bool | None:
        """The prompt ends inside a thinking (its end, blanks aside, is the start marker): True; after
        a closed one (Qwen3's empty thinking when enable_thinking is false): None; else False."""
        tail = self.detok.decode(tuple(prompt_ids[-16:])).rstrip()
        return True if tail.endswith(self.fmt.start) else None if tail.endswith(self.fmt.end) else False

    def hold(self, th: Thinking, matcher):
        """A constrained row's matcher: the one to apply from the first token (None: held in ``th`` for
        the answer). A row that may open a thinking whose start marker is several tokens cannot (its
        grammar applies at once); one whose marker is one token may take it besides the grammar's tokens."""
        if th.phase == IN:
            th.grammar = matcher
            return None
        if th.phase == MAY and self.fmt.start_id is None:
            th.phase, th.answer_char, th.answer_token = ANSWER, 0, 0
        return matcher

    def mask(self, ths: list[Thinking | None], allowed: torch.Tensor | None, vocab: int,
             device: torch.device) -> torch.Tensor | None:
        """The step's (rows, vocab) mask with the forced rows' one token each, and the start marker
        allowed to constrained rows that may open a thinking (index operations over the rows, no loop
        over the vocabulary); ``allowed`` unchanged when no row needs either."""
        forced = [(i, self.fmt.forced[th.forcing]) for i, th in enumerate(ths) if th is not None and th.forcing >= 0]
        opens = [i for i, th in enumerate(ths) if th is not None and th.phase == MAY] if allowed is not None and \
            self.fmt.start_id is not None else []
        if not forced and not opens:
            return allowed
        if allowed is None:
            allowed = torch.ones(len(ths), vocab, dtype=torch.bool, device=device)
        if opens:
            allowed[torch.tensor(opens, device=device), self.fmt.start_id] = True
        if forced:
            rows = torch.tensor([i for i, _ in forced], device=device)
            allowed[rows] = False
            allowed[rows, torch.tensor([t for _, t in forced], device=device)] = True
        return allowed

    def before(self, st, tok: int) -> None:
        """Row state ``st`` takes ``tok``: a constrained row that opens its thinking holds its grammar."""
        th = st.thinking
        if th.phase == MAY and st.matcher is not None and tok == self.fmt.start_id:
            th.grammar, st.matcher = st.matcher, None

    def after(self, st, before: int, generated: int) -> None:
        """``st``'s text grew from ``before`` characters by its ``generated``-th token: the phase it is in
        now, the budget spent, what is forced next; the held grammar applies once the answer starts."""
        th, text = st.thinking, st.text.text
        forced = th.forcing >= 0
        if forced:
            th.forcing = th.forcing + 1 if th.forcing + 1 < len(self.fmt.forced) else -1
        if th.phase == MAY:
            lead = len(text) - len(text.lstrip())
            rest = text[lead:]
            if rest.startswith(self.fmt.start):
                th.phase, th.start_char = IN, lead + len(self.fmt.start)
            elif not self.fmt.start.startswith(rest):
                th.phase, th.answer_char, th.answer_token = ANSWER, 0, 0
        elif th.phase == IN:
            th.spent += not forced
            at = text.find(self.fmt.end, max(th.start_char, before - len(self.fmt.end) + 1))
            if at >= 0:
                th.phase, th.end_char, th.answer_char, th.answer_token = ANSWER, at, at + len(self.fmt.end), generated
                if th.grammar is not None and th.forcing < 0 and self.fmt.blank_from < len(self.fmt.forced):
                    th.forcing = self.fmt.blank_from  # the blank line a model writes there, before its grammar
        if th.phase == IN:
            self._spent(th)
        if th.phase == ANSWER and th.forcing < 0 and th.grammar is not None:
            st.matcher, th.grammar = th.grammar, None

    def _spent(self, th: Thinking) -> None:
        """Once the model chose ``budget`` tokens inside the thinking, its end is forced."""
        if th.budget is not None and th.spent >= th.budget and th.forcing < 0 and not th.forced_end:
            th.forcing, th.forced_end = 0, True

    @staticmethod
    def answer_from(th: Thinking, text: str) -> int | None:
        """Where stop strings are looked for in ``text``: from the answer's start, past the line breaks
        that follow a thinking (None: no answer yet)."""
        if th.phase != ANSWER:
            return None
        at = th.answer_char
        if th.thought:
            while at < len(text) and text[at] in BLANK:
                at += 1
        return at

    def stream_limit(self, th: Thinking, length: int) -> int:
        """Characters of a row's text that a stream may send: none while it may still open a thinking,
        all but the start of an end marker that may be forming while it thinks, else all."""
        if th.phase == MAY:
            return 0
        if th.phase == IN:
            return max(th.start_char, length - (len(self.fmt.end) - 1))
        return length

    # -- a finished request -------------------------------------------------------------------
    def count(self, cands: list, starved_reasons: list[str | None], retried: bool, repaired: bool) -> None:
        """A request's figures as its line is written (or sent back to run again)."""
        for cand in cands:
            th = cand.reasoning
            if th is not None and th.thought:
                self.counts["thinking_rows"] += 1
                self.counts["reasoning_tokens"] += th.tokens(len(cand.ids))
                self.counts["forced_ends"] += th.forced_end
        if retried:
            self.counts["retried"] += 1
            return
        self.counts["starved"] += sum(r is not None for r in starved_reasons)
        self.counts["repaired"] += repaired

    def retry(self, cands: list, max_tokens: int, budget: int | None) -> tuple[int, int, int]:
        """The --retry-starved rerun's (thinking budget, max_tokens, tokens the answer keeps): twice the
        thinking the first try's longest row chose (within its own budget, if any, and never less than
        one token), and room after it for the forced end and the first try's whole max_tokens. Rank 0
        shrinks max_tokens to what the context window and --budget allow, the thinking budget first."""
        spent = max((c.reasoning.spent for c in cands if c.reasoning is not None), default=0)
        new = max(1, 2 * spent)
        if budget is not None:
            new = max(new, budget)
        answer_room = max_tokens + len(self.fmt.forced)
        return new, new + answer_room, answer_room
