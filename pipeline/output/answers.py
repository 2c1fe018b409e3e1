"""Output assembly on the last rank: a finished request's result (best_of chosen, each choice
formatted, usage), written as a file's line or sent back to rank 0 as a live request's answer, and the
text a streaming row can no longer take back, as deltas."""

from __future__ import annotations

import time
from typing import NamedTuple

from tasks.protocol import output_line
from tasks.requests import Params

from pipeline.output.head_state import RequestState, RowState
from pipeline.output.reasoning import Reasoning, split, starved
from pipeline.output.results import Candidate, chat_choice, completion_choice, result_object, text_offsets, top_dict


class Taken(NamedTuple):
    results: list[tuple[int, dict]]  # (input index, the file's line)
    live: list[tuple[int, dict]]  # (request index, {"result"} | {"error"})
    deltas: list[tuple]  # (request index, choice index, new text, its logprobs or None, new reasoning text)
    # --retry-starved: [live, request index, the request (a file's line; None: live), thinking budget,
    # max_tokens, tokens the answer keeps] of requests whose thinking starved an answer, to run again
    retries: list[list]


class Answers:
    def __init__(self, detok, model_name: str, reasoning: Reasoning | None = None, retry_starved: bool = False):
        self.detok, self.model_name = detok, model_name
        self.reasoning, self.retry_starved = reasoning, retry_starved  # a reasoning run (else None)
        # not yet taken: each as :class:`Taken`'s field of its name
        self.results, self.live, self.deltas, self.retries = [], [], [], []
        self.format_seconds = 0.0  # detokenizing and formatting results

    def finish(self, live: bool, index: int, req: RequestState) -> None:
        """A finished request: a file's line (the writer's), or for a live request its answer for rank 0,
        ``{"result": ...}`` or ``{"error": ...}`` (tasks.protocol.Answer.from_wire)."""
        t0 = time.perf_counter()
        result = None
        if req.error is None and self.reasoning is not None and self._retried(live, index, req):
            self.format_seconds += time.perf_counter() - t0
            return
        if req.error is None:
            try:
                result = self._result(req)
            except Exception as e:
                req.failed("formatting its result", e)
        if live:
            self.live.append((index, {"result": result} if req.error is None else {"error": req.error}))
        else:
            self.results.append((index, output_line(req.raw, req.custom_id, result=result, error=req.error)))
        self.format_seconds += time.perf_counter() - t0

    @staticmethod
    def _chosen(req: RequestState) -> list[tuple[int, int, Candidate]]:
        """(prompt, choice index, candidate) of every choice the result returns (best_of chosen)."""
        p, out = req.params, []
        for prompt_i in range(req.n_prompts):
            cands = req.choices[prompt_i]
            best = sorted(cands, key=lambda c: (-c.mean_logprob, c.choice))[: p.n] if p.best_of > p.n else \
                sorted(cands, key=lambda c: c.choice)
            out += [(prompt_i, prompt_i * p.n + j, cand) for j, cand in enumerate(best)]
        return out

    def _result(self, req: RequestState) -> dict:
        p = req.params
        choices = []
        completion_tokens = sum(c.generated for cands in req.choices.values() for c in cands)
        for prompt_i, idx, cand in self._chosen(req):
            if req.kind == "chat":
                choices.append(chat_choice(self.detok, cand, idx, p))
            else:
                choices.append(completion_choice(self.detok, cand, idx, p.logprobs, req.echoes.get(prompt_i),
                                                 p.return_token_ids, req.prompt_ids.get(prompt_i)))
            if self.reasoning is not None:
                self._reasoning_fields(choices[-1], cand, req.kind == "chat")
        result = result_object(req.kind, req.model or self.model_name, choices, req.prompt_tokens, completion_tokens,
                               time.perf_counter() - req.started, req.batch_size, req.cached_tokens)
        if req.kind == "chat" and p.return_token_ids:  # vLLM's chat response carries them beside the choices
            result["prompt_token_ids"] = req.prompt_ids.get(0)
        if self.reasoning is not None:
            self._reasoning_figures(result, req)
        if req.notes:
            result["warnings"] = req.notes
        return result

    # -- reasoning runs (pipeline.output.reasoning) --------------------------------------------------
    @staticmethod
    def _reasoning_fields(choice: dict, cand: Candidate, chat: bool) -> None:
        """A choice of a reasoning run: a chat message's reasoning apart from its answer (a completion
        keeps the raw text), and why an answer the thinking starved is empty."""
        text = choice["message"]["content"] if chat else choice["text"]
        if chat:
            reasoning, choice["message"]["content"] = split(cand.reasoning, text)
            choice["message"]["reasoning_content"] = reasoning
        why = starved(cand.reasoning, cand.finish_reason, text, cand.generated)
        if why is not None:
            choice["starved"] = why

    def _reasoning_figures(self, result: dict, req: RequestState) -> None:
        """Usage's reasoning_tokens (every candidate's thinking, as completion_tokens counts every
        candidate) where a row thought or could have (a budget), this file's counts, and on a
        --retry-starved rerun what it ran with."""
        cands = [c for cs in req.choices.values() for c in cs]
        if req.params.thinking_budget is not None or any(c.reasoning is not None and c.reasoning.thought for c in cands):
            result["usage"]["completion_tokens_details"] = {  # (absent where nothing thought, as before)
                "reasoning_tokens": sum(c.reasoning.tokens(len(c.ids)) for c in cands if c.reasoning is not None)}
        reasons = [c.get("starved") for c in result["choices"]]
        p = req.params
        if p.starved_retry:
            result["retry"] = {"reason": "starved", "max_tokens": p.max_tokens, "thinking_token_budget": p.thinking_budget}
        self.reasoning.count(cands, reasons, False, p.starved_retry and not any(reasons))

    def _retried(self, live: bool, index: int, req: RequestState) -> bool:
        """--retry-starved: a request whose returned choices include one the thinking starved goes back to
        rank 0 to run once more (its first try's figures counted, nothing written); True when it does.
        Not a rerun, and not a stream (its text went out already)."""
        p = req.params
        if not self.retry_starved or p.starved_retry or req.stream:
            return False
        chosen = [cand for _, _, cand in self._chosen(req)]
        texts = ["".join(c.pieces) if c.pieces is not None else "" for c in chosen]
        reasons = [starved(c.reasoning, c.finish_reason, t[:c.stop_at] if c.stop_at is not None else t, c.generated)
                   for c, t in zip(chosen, texts)]
        if not any(reasons):
            return False
        cands = [c for cs in req.choices.values() for c in cs]
        self.reasoning.count(cands, reasons, True, False)
        self.retries.append([live, index, None if live else req.raw,
                             *self.reasoning.retry(cands, p.max_tokens, p.thinking_budget)])
        return True

    def stream(self, request: int, choice: int, st: RowState, p: Params, chat: bool = False) -> None:
        """Queue the whole tokens a streaming row can no longer take back (their text, and their
        logprobs when asked): text up to the last (longest stop - 1) characters, which a stop string
        found later could still cut, ending with a token that completes its characters. A chat row
        that thinks sends its reasoning apart from its answer (pipeline.output.reasoning.split)."""
        hold = max((len(s) for s in p.stop), default=1) - 1
        safe = len(st.text.text) - hold
        if st.thinking is not None:  # nothing of a marker that may be forming
            safe = min(safe, self.reasoning.stream_limit(st.thinking, len(st.text.text)))
        pieces, pos, end = st.text.pieces, st.sent_chars, st.sent
        for k in range(st.sent, len(pieces)):
            if pos + len(pieces[k]) > safe:
                break
            pos += len(pieces[k])
            if pieces[k]:
                end = k + 1
        if end == st.sent:
            return
        text = "".join(pieces[st.sent:end])
        lp = None
        if p.logprobs is not None:
            c = st.cand
            lp = {"tokens": pieces[st.sent:end], "token_logprobs": c.logprobs[st.sent:end],
                  "top_logprobs": [top_dict(self.detok, t) for t in c.top[st.sent:end]] if p.logprobs else None,
                  "text_offset": text_offsets(pieces[st.sent:end], st.sent_chars)}
        st.sent, st.sent_chars = end, st.sent_chars + len(text)
        reasoning = ""
        if chat and st.thinking is not None:
            r, c = split(st.thinking, st.text.text[: st.sent_chars])
            reasoning, text = (r or "")[st.sent_reasoning:], c[st.sent_content:]
            st.sent_reasoning, st.sent_content = st.sent_reasoning + len(reasoning), st.sent_content + len(text)
        self.deltas.append((request, choice, text, lp, reasoning))

    def take(self) -> Taken:
        """What the pass finished since the last call, emptied: the file's output lines, the live requests'
        answers and their streams' new text for rank 0, and the requests --retry-starved runs again."""
        out = Taken(self.results, self.live, self.deltas, self.retries)
        self.results, self.live, self.deltas, self.retries = [], [], [], []
        return out
