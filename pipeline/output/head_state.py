"""What the last stage's Head keeps per row, per best_of group and per request between passes."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tasks.requests import Params, constraint_param
from pipeline.output.results import Candidate, IncrementalText
from pipeline.sampling.grammar import GrammarError
from pipeline.sampling.processors import prompt_tokens

from pipeline.runtime.messages import Admission


@dataclass
class RowState:
    gid: int
    cand: Candidate
    key: int  # random stream
    text: IncrementalText | None = None  # only when the request has stop strings or streams
    sent: int = -1  # streaming: tokens whose text was sent as deltas (-1: not streamed)
    sent_chars: int = 0  # streaming: the characters of those tokens
    counts: dict[int, int] = field(default_factory=dict)  # generated token counts (penalties: Params.counts_tokens)
    matcher: object = None  # structured outputs: this row's llguidance matcher (pipeline.sampling.grammar)
    thinking: object = None  # a reasoning run: the row's pipeline.output.reasoning.Thinking
    sent_reasoning: int = 0  # streaming a chat row that thinks: characters of its reasoning sent
    sent_content: int = 0  # and of its answer


@dataclass
class GroupState:
    meta: Admission  # what rank 0 sent when the group entered
    started: float
    echo: dict | None = None
    done: int = 0
    seen: torch.Tensor | None = None  # repetition_penalty: the prompt's distinct token ids on the device, made once

    def prompt_tokens(self, vocab: int, device: torch.device) -> torch.Tensor:
        """The prompt's distinct token ids on ``device`` (every row of the group shares them)."""
        if self.seen is None:
            self.seen = prompt_tokens(self.meta.prompt_ids, vocab, device)
        return self.seen

    @property
    def params(self) -> Params:
        return self.meta.params

    @property
    def rows(self) -> list[int]:
        return self.meta.rows


@dataclass
class RequestState:
    raw: object
    kind: str
    custom_id: str | None
    params: Params
    n_prompts: int
    choices: dict[int, list[Candidate]] = field(default_factory=dict)  # prompt_i -> candidates
    echoes: dict[int, dict | None] = field(default_factory=dict)
    prompt_ids: dict[int, list[int]] = field(default_factory=dict)  # return_token_ids: prompt_i -> its ids
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served by the prefix cache
    started: float = 0.0
    batch_size: int = 0
    notes: list[str] = field(default_factory=list)
    model: str | None = None  # a LoRA adapter's name: the result's "model" (else the base model's)
    stream: bool = False  # a live request streamed as it runs (never run again: its text went out)
    error: dict | None = None  # a row of it failed: the request is answered with this error

    def failed(self, doing: str, e: Exception) -> None:
        """Answer the request with an error: a grammar that cannot go on is the request's own (a schema
        without a finite instance exhausts the parser's limits), anything else the runner's."""
        if self.error is not None:
            return
        if isinstance(e, GrammarError):
            self.error = {"message": f"the request's grammar could not go on while {doing}: {e}; the other "
                                     "requests were answered", "type": "invalid_request_error",
                          "param": constraint_param(self.raw)}
            return
        self.error = {"message": f"this request failed while {doing} ({type(e).__name__}: {str(e)[:200]}); "
                                 "the other requests were answered", "type": "server_error", "param": None}
