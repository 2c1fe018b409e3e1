"""Output assembly on the last rank: a finished request's result (best_of chosen, each choice
formatted, usage), written as a file's line or sent back to rank 0 as a live request's answer, and the
text a streaming row can no longer take back, as deltas."""

from __future__ import annotations

import time

from tasks.protocol import output_line
from tasks.requests import Params

from pipeline.output.head_state import RequestState, RowState
from pipeline.output.results import chat_choice, completion_choice, result_object, top_dict


class Answers:
    def __init__(self, detok, model_name: str):
        self.detok, self.model_name = detok, model_name
        self.results: list[tuple[int, dict]] = []  # (input index, the file's line), not yet taken
        self.live: list[tuple[int, dict]] = []  # (request index, {"result"} | {"error"}) for rank 0
        self.deltas: list[tuple] = []  # streaming: (request index, choice index, new text, its logprobs or None)
        self.format_seconds = 0.0  # detokenizing and formatting results
        self.failed = 0  # requests answered with an error because computing them raised (the run went on)

    def finish(self, live: bool, index: int, req: RequestState) -> None:
        """A finished request: a file's line (the writer's), or for a live request its answer for rank 0,
        ``{"result": ...}`` or ``{"error": ...}`` (tasks.protocol.Answer.from_wire)."""
        t0 = time.perf_counter()
        result = None
        if req.error is None:
            try:
                result = self._result(req)
            except Exception as e:
                req.failed("formatting its result", e)
        if req.error is not None:
            self.failed += 1
        if live:
            self.live.append((index, {"result": result} if req.error is None else {"error": req.error}))
        else:
            self.results.append((index, output_line(req.raw, req.custom_id, result=result, error=req.error)))
        self.format_seconds += time.perf_counter() - t0

    def _result(self, req: RequestState) -> dict:
        p = req.params
        choices, completion_tokens = [], 0
        for prompt_i in range(req.n_prompts):
            cands = req.choices[prompt_i]
            completion_tokens += sum(c.generated for c in cands)
            best = sorted(cands, key=lambda c: (-c.mean_logprob, c.choice))[: p.n] if p.best_of > p.n else \
                sorted(cands, key=lambda c: c.choice)
            for j, cand in enumerate(best):
                idx = prompt_i * p.n + j
                if req.kind == "chat":
                    choices.append(chat_choice(self.detok, cand, idx, p))
                else:
                    choices.append(completion_choice(self.detok, cand, idx, p.logprobs, req.echoes.get(prompt_i),
                                                     p.return_token_ids))
        result = result_object(req.kind, req.model or self.model_name, choices, req.prompt_tokens, completion_tokens,
                               time.perf_counter() - req.started, req.batch_size, req.cached_tokens)
        if req.notes:
            result["warnings"] = req.notes
        return result

    def stream(self, request: int, choice: int, st: RowState, p: Params) -> None:
        """Queue the whole tokens a streaming row can no longer take back (their text, and their
        logprobs when asked): text up to the last (longest stop - 1) characters, which a stop string
        found later could still cut, ending with a token that completes its characters."""
        hold = max((len(s) for s in p.stop), default=1) - 1
        safe = len(st.text.text) - hold
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
            c, offsets, at = st.cand, [], st.sent_chars
            for piece in pieces[st.sent:end]:
                offsets.append(at)
                at += len(piece)
            lp = {"tokens": pieces[st.sent:end], "token_logprobs": c.logprobs[st.sent:end],
                  "top_logprobs": [top_dict(self.detok, t) for t in c.top[st.sent:end]] if p.logprobs else None,
                  "text_offset": offsets}
        self.deltas.append((request, choice, text, lp))
        st.sent, st.sent_chars = end, st.sent_chars + len(text)

    def take_results(self) -> list[tuple[int, dict]]:
        """The file's requests finished since the last call: (input index, output line)."""
        out, self.results = self.results, []
        return out

    def take_answers(self) -> tuple[list[tuple[int, dict]], list[tuple]]:
        """What goes back to rank 0 since the last call: the live requests finished and the streams' new text."""
        out = self.live, self.deltas
        self.live, self.deltas = [], []
        return out
