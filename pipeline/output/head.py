"""The last stage after its layers: which rows need logits, each row's state from admission to its
end (EOS, stop strings, length, a grammar that is complete), and finished requests.

The device work and the grammars' masks are pipeline.sampling's; results and deltas are assembled by
pipeline.output.answers.
"""

from __future__ import annotations

import time

import torch

from tasks.requests import Params

from pipeline.output.answers import Answers
from pipeline.output.head_state import GroupState, RequestState, RowState
from pipeline.output.reasoning import ANSWER, Reasoning, ReasoningFormat
from pipeline.output.results import Candidate, Detokenizer, IncrementalText
from pipeline.runtime.messages import Admission, Prefill
from pipeline.sampling.constraints import Constraints
from pipeline.sampling.grammar import GrammarError, Grammars
from pipeline.sampling.sampler import stream_key, uniform
from pipeline.sampling.scoring import PromptScorer
from pipeline.sampling.step import draw, head_logits


class Head:
    def __init__(self, model, tokenizer, eos_ids: set[int], model_name: str, run_seed: int,
                 grammars: Grammars | None = None, masks_on_thread: bool = True,
                 reasoning: ReasoningFormat | None = None, retry_starved: bool = False):
        self.model, self.detok = model, Detokenizer(tokenizer)
        self.scorer = PromptScorer(model)  # echo: the prompt's own logprobs
        self.eos_ids, self.model_name, self.run_seed = eos_ids, model_name, run_seed
        # reasoning models: rows' thinking, budgets, starved rows (pipeline.output.reasoning)
        self.reasoning = Reasoning(reasoning, self.detok) if reasoning is not None else None
        self.answers = Answers(self.detok, model_name, self.reasoning, retry_starved)  # results, streamed text
        self.constraints = Constraints(grammars, eos_ids, masks_on_thread)  # structured outputs' masks
        self.slots: dict[int, dict[int, RowState]] = {}  # slot -> row -> state
        self.groups: dict[int, GroupState] = {}
        self.requests: dict[tuple[bool, int], RequestState] = {}  # (live, index) -> state
        self.generated_tokens = 0
        self.resume: dict[int, dict] = {}  # the open file's rows checkpointed mid-generation (line -> state)

    # -- admission --------------------------------------------------------------------------
    def start_file(self) -> None:
        """A new file: its counters from zero."""
        self.generated_tokens, self.answers.format_seconds = 0, 0.0
        self.constraints.start_file()
        if self.reasoning is not None:
            self.reasoning.start_file()

    def admit(self, slot: int, meta: Admission, slot_rows: int) -> None:
        p = meta.params
        key = (meta.live, meta.req)
        if key not in self.requests:
            self.requests[key] = RequestState(meta.raw, meta.kind, meta.custom_id, p, meta.n_prompts,
                                              started=time.perf_counter(), model=meta.model, stream=meta.stream)
        req = self.requests[key]
        if meta.raw is not None:  # only the first prompt's admission carries the request, in any order
            req.raw = meta.raw
        req.batch_size = max(req.batch_size, slot_rows)
        if meta.note:
            req.notes.append(meta.note)
        prompt = meta.prompt_ids[: len(meta.prompt_ids) - meta.resumed]  # (a resumed row's tokens so far follow)
        req.prompt_tokens += len(prompt)
        if p.return_token_ids:
            req.prompt_ids[meta.prompt_i] = list(prompt)
        g = GroupState(meta, time.perf_counter())
        self.groups[meta.gid] = g
        rows = self.slots.setdefault(slot, {})
        for j, r in enumerate(g.rows):
            key = stream_key(self.run_seed, p.seed, meta.req, meta.prompt_i, j)
            cand = Candidate(choice=j, top=[] if p.logprobs else None)
            stream = meta.stream and not p.echo  # echoed prompts come whole with the final chunk
            rows[r] = RowState(meta.gid, cand, key, None, sent=0 if stream else -1)
            try:
                if self.reasoning is not None:
                    rows[r].thinking = cand.reasoning = self.reasoning.admit(prompt, p.thinking_budget,
                                                                             meta.kind == "chat")
                    if rows[r].thinking.phase == ANSWER:  # it cannot think: nothing to follow (its result says so)
                        rows[r].thinking = None
                rows[r].text = IncrementalText(self.detok, prompt) \
                    if p.stop or stream or rows[r].thinking is not None else None
            except Exception as e:
                self._failed(req, "reading its prompt", e)
            if p.structured is not None:
                try:
                    rows[r].matcher = self.constraints.matcher(p.structured)
                    if rows[r].thinking is not None:  # a thinking row's grammar applies to its answer
                        rows[r].matcher = self.reasoning.hold(rows[r].thinking, rows[r].matcher)
                except Exception as e:
                    self._failed(req, "compiling its output constraint", e)
            if meta.resumed:
                try:
                    self._restore(rows[r], meta, p)
                except Exception as e:
                    self._failed(req, "restoring its checkpointed tokens", e)

    def _restore(self, st: RowState, meta: Admission, p: Params) -> None:
        """A row checkpointed mid-generation: its tokens, logprobs, text, penalty counts and grammar state
        as they were; it samples its next token from where it stopped (its random stream goes on by step)."""
        saved = self.resume.pop(meta.req)
        ids = meta.prompt_ids[len(meta.prompt_ids) - meta.resumed:]
        assert saved["ids"] == ids, "the checkpoint and rank 0 disagree on the row's tokens"
        c = st.cand
        c.ids, c.logprobs, c.generated = list(ids), list(saved["logprobs"]), len(ids)
        if st.matcher is not None:
            self.constraints.forget(st.matcher)  # its first mask (not flushed yet) is for the state before these
        if c.top is not None:
            c.top = [[tuple(x) for x in t] for t in saved["top"]]
        for tok in ids:
            if p.counts_tokens:
                st.counts[tok] = st.counts.get(tok, 0) + 1
            if st.text is not None:
                st.text.add(tok)
            if st.matcher is not None and not st.matcher.consume_token(tok):
                raise GrammarError(f"its checkpointed token {tok} does not fit its grammar")
        if st.matcher is not None:
            self.constraints.ahead([st.matcher])

    def checkpoint(self) -> dict[int, dict]:
        """The open file's rows in flight that can resume mid-generation (one prompt, one row, no echo, not
        thinking): line -> its generated tokens, their logprobs and top logprobs."""
        out = {}
        for rows in self.slots.values():
            for st in rows.values():
                g = self.groups[st.gid]
                p, c = g.params, st.cand
                if g.meta.live or g.meta.n_prompts != 1 or p.best_of != 1 or p.echo or not c.ids \
                        or st.thinking is not None:  # a thinking's phases are not replayed: it starts again
                    continue
                out[g.meta.req] = {"ids": list(c.ids), "logprobs": list(c.logprobs),
                                   "top": [[list(x) for x in t] for t in c.top] if c.top is not None else None}
        return out

    def _failed(self, req: RequestState | None, doing: str, e: Exception) -> None:
        """A request whose computation raised is answered with an error (its rows finish at their
        next pass); the rest of the micro-batch, the run and the server go on."""
        if req is not None:
            req.failed(doing, e)

    def _request_of(self, gid: int) -> RequestState | None:
        g = self.groups.get(gid)
        return None if g is None else self.requests.get((g.meta.live, g.meta.req))

    # -- one pass ---------------------------------------------------------------------------
    def on_pass(self, slot: int, decode_rows: list[int], h_decode, prefill: list[Prefill], h_prefill,
                pool=None) -> tuple[dict, list[int]]:
        """Sample for every row that produced logits; returns ({row: token} to feed, finished rows).
        h_decode: (len(decode_rows), hidden); h_prefill: (b, t, hidden) for the prefill leads listed in
        ``prefill``, from each one's first uncached token; pool: this stage's prefix pool (echo scoring)."""
        states = self.slots[slot]
        feed, finished = {}, []
        hiddens, targets = [], []  # targets: the rows each logits row serves (a prefill lead serves its group)
        if decode_rows:
            keep = [i for i, r in enumerate(decode_rows) if self._request_error(states[r].gid) is None]
            kept = set(keep)
            finished += [r for i, r in enumerate(decode_rows) if i not in kept]
            if keep:
                hiddens.append(h_decode if len(keep) == len(decode_rows) else h_decode[keep])
                targets += [[decode_rows[i]] for i in keep]
        for i, item in enumerate(prefill):
            g = self.groups.get(item.gid)
            req = self.requests.get((g.meta.live, g.meta.req)) if g is not None and not item.resumed else None
            if req is not None:  # the pool's tokens (a chunked prompt's first pass loads them)
                req.cached_tokens += item.cached
            if item.partial:  # chunked prefill: the prompt's next part comes in a later pass
                continue
            n = item.len - item.cached
            if g.params.echo and self._request_error(item.gid) is None:
                try:
                    g.echo = self.scorer.score(h_prefill[i, :n], g.meta.prompt_ids, g.params.logprobs or 0, item,
                                               pool)
                except Exception as e:
                    self._failed(self.requests.get((g.meta.live, g.meta.req)), "scoring its prompt (echo)", e)
            if g.params.max_tokens == 0:
                for r in g.rows:
                    states[r].cand.finish_reason = "length"
                continue
            if self._request_error(item.gid) is not None:
                finished += g.rows
                continue
            hiddens.append(h_prefill[i, n - 1 : n])
            targets.append(g.rows)
        if hiddens:
            logits = head_logits(self.model, hiddens, targets)  # (rows, V) float32
            rows = [r for rs in targets for r in rs]
            try:
                self._step(states, rows, logits, feed, finished)
            except Exception:  # find the row(s) it was: each alone (_sample changes nothing before it returns)
                for i, r in enumerate(rows):
                    try:
                        self._step(states, [r], logits[i : i + 1], feed, finished)
                    except Exception as e:
                        self._failed(self._request_of(states[r].gid), "sampling its next token", e)
                        finished.append(r)
        for item in prefill:  # scoring-only groups finish without sampling
            g = self.groups[item.gid]
            if g.params.max_tokens == 0 and not item.partial:
                finished += g.rows
        for r in finished:
            self._finish_row(slot, r)
        matchers = [states[r].matcher for r in feed if states[r].matcher is not None]
        if matchers:  # constrained rows' next masks, while the stages run their next pass
            self.constraints.ahead(matchers)
        return feed, finished

    def _request_error(self, gid: int) -> dict | None:
        req = self._request_of(gid)
        return None if req is None else req.error

    def _step(self, states, rows: list[int], logits: torch.Tensor, feed: dict, finished: list[int]) -> None:
        """Sample a token for each of ``rows`` (logits (len(rows), V)) and advance them. The batched
        device work (pipeline.sampling.step) raises before any row changes; a row whose own bookkeeping
        raises (detokenizing, stop strings, streaming) is answered with an error and the others go on."""
        groups = [self.groups[states[r].gid] for r in rows]
        ps = [g.params for g in groups]
        matchers = [states[r].matcher for r in rows]
        allowed = self.constraints.mask(matchers, logits.shape[-1], logits.device) \
            if any(m is not None for m in matchers) else None
        thinking = [states[r].thinking for r in rows] if self.reasoning is not None else []
        if any(th is not None for th in thinking):  # the forced end of a thinking whose budget is spent
            allowed = self.reasoning.mask(thinking, allowed, logits.shape[-1], logits.device)
        d = draw(logits, ps, [states[r].counts for r in rows],
                 [uniform(states[r].key, len(states[r].cand.ids)) if p.temperature > 0 else 0.0
                  for r, p in zip(rows, ps)], allowed, [len(states[r].cand.ids) for r in rows],
                 [g.prompt_tokens(logits.shape[-1], logits.device) if p.repetition_penalty != 1.0 else None
                  for g, p in zip(groups, ps)], self.eos_ids)
        self.generated_tokens += len(rows)
        for i, (r, p) in enumerate(zip(rows, ps)):
            try:
                self._advance(states[r], r, p, d.chosen[i], d.chosen_lp[i], d.top_i[i] if d.top_i else None,
                              d.top_v[i] if d.top_v else None, feed, finished)
            except Exception as e:
                self._failed(self._request_of(states[r].gid), "producing its output", e)
                feed.pop(r, None)
                if r not in finished:
                    finished.append(r)

    def _advance(self, st: RowState, r: int, p: Params, tok: int, tok_lp: float, top_i: list[int] | None,
                 top_v: list[float] | None, feed: dict, finished: list[int]) -> None:
        """Row ``r`` took token ``tok``: record it, then finish the row (EOS, stop string, length) or feed it."""
        cand = st.cand
        cand.generated += 1
        if (tok in self.eos_ids and not p.ignore_eos) or tok in p.stop_token_ids:  # not part of the output
            cand.finish_reason = "stop"
            finished.append(r)
            return
        if st.thinking is not None:
            self.reasoning.before(st, tok)
        if st.matcher is not None and not st.matcher.consume_token(tok):  # the mask allowed it: never expected
            raise GrammarError(f"it refused token {tok} ({(st.matcher.get_error() or '?').splitlines()[0][:200]})")
        cand.ids.append(tok)
        cand.logprobs.append(tok_lp)
        if cand.top is not None:
            cand.top.append(list(zip(top_i[: p.logprobs], top_v[: p.logprobs])))
        if p.counts_tokens:
            st.counts[tok] = st.counts.get(tok, 0) + 1
        if st.text is not None:
            before = len(st.text.text)
            st.text.add(tok)
            floor = 0  # as vLLM: a stop string ends the text only once min_tokens tokens are out
            if st.thinking is not None:  # the thinking's phase; stop strings apply to the answer alone
                self.reasoning.after(st, before, len(cand.ids))
                floor = self.reasoning.answer_from(st.thinking, st.text.text)
            hit = _find_stop(st.text.text, p.stop, before, floor) \
                if floor is not None and p.stop and len(cand.ids) > p.min_tokens else None
            if hit is not None:
                cand.finish_reason, cand.stop_at = "stop", hit
                finished.append(r)
                return
            if st.sent >= 0:
                meta = self.groups[st.gid].meta
                self.answers.stream(meta.req, meta.prompt_i * p.n + st.cand.choice, st, p, meta.kind == "chat")
            if st.thinking is not None and st.thinking.phase == ANSWER and not st.thinking.thought:
                st.thinking = None  # its answer did not open a thinking: no more to follow, nor text to keep for it
                if not p.stop and st.sent < 0:
                    st.text = None
        if st.matcher is not None and st.matcher.is_stopped():  # the grammar is complete and can take nothing more
            cand.finish_reason = "stop"
            finished.append(r)
            return
        if len(cand.ids) >= p.max_tokens:
            cand.finish_reason = "length"
            finished.append(r)
            return
        feed[r] = tok

    # -- finishing --------------------------------------------------------------------------
    def _end_row(self, slot: int, row: int):
        """A row leaves: its state and grammars go, its group counts it done (and goes after its last
        row). Returns (the row's state, its group, whether that was the group's last row)."""
        st = self.slots[slot].pop(row)
        self.constraints.forget(st.matcher)
        if st.thinking is not None:
            self.constraints.forget(st.thinking.grammar)
        g = self.groups[st.gid]
        g.done += 1
        if g.done == len(g.rows):
            del self.groups[st.gid]
        return st, g, g.done == len(g.rows)

    def _finish_row(self, slot: int, row: int) -> None:
        st, g, last = self._end_row(slot, row)
        key = (g.meta.live, g.meta.req)
        req = self.requests.get(key)
        if st.text is not None and (req is None or req.error is None):
            try:
                st.cand.pieces = st.text.finish()
            except Exception as e:
                self._failed(req, "producing its output", e)
        if req is None:  # serve mode: the client left and the request was dropped
            return
        req.choices.setdefault(g.meta.prompt_i, []).append(st.cand)
        if last:
            req.echoes[g.meta.prompt_i] = g.echo
            if len(req.choices) == req.n_prompts and all(
                len(c) == req.params.best_of for c in req.choices.values()
            ):
                self.answers.finish(*key, self.requests.pop(key))

    def drop(self, slot: int, live_reqs: set[int]) -> list[int]:
        """Serve mode: forget the rows of ``live_reqs`` (their clients left) in ``slot``; the rows freed."""
        rows = [r for r, st in self.slots.get(slot, {}).items() if self.groups[st.gid].meta.live
                and self.groups[st.gid].meta.req in live_reqs]
        for r in rows:
            self._end_row(slot, r)
        for req in live_reqs:
            if not any(g.meta.live and g.meta.req == req for g in self.groups.values()):
                self.requests.pop((True, req), None)
        return rows

    def cancel(self, slot: int, lines: set[int], error: dict) -> list[int]:
        """A cancelled file's ``lines`` in ``slot``: their requests are answered with ``error``, their rows
        end now; returns the rows."""
        rows = [r for r, st in self.slots.get(slot, {}).items()
                if not (meta := self.groups[st.gid].meta).live and meta.req in lines]
        return self._end_rows(slot, rows, error)

    def rows_of(self, gid: int) -> list[int]:
        """The slot rows of group ``gid`` (none once it finished)."""
        g = self.groups.get(gid)
        return list(g.rows) if g is not None else []

    def fail_rows(self, slot: int, rows: list[int], cause: str) -> list[int]:
        """A stage's forward raised (``cause``) computing ``rows`` alone (pipeline.runtime.retry): their
        requests are answered with an error, the rows finish; returns those that did."""
        error = {"message": f"a stage's forward raised while computing this request alone ({cause}); the other "
                            "requests of its micro-batch were answered", "type": "server_error", "param": None}
        return self._end_rows(slot, [r for r in rows if r in self.slots.get(slot, {})], error)

    def _end_rows(self, slot: int, rows: list[int], error: dict) -> list[int]:
        """``rows`` end now, their requests answered with ``error`` (unless they have one already)."""
        for r in rows:
            req = self._request_of(self.slots[slot][r].gid)
            if req is not None and req.error is None:
                req.error = dict(error)
            self._finish_row(slot, r)
        return rows


def _find_stop(text: str, stops: list[str], since: int, floor: int = 0) -> int | None:
    """Earliest index of any stop string that ends after ``since`` (so spans across tokens count) and
    starts at ``floor`` or later (a thinking row: its answer's start)."""
    return min((i for s in stops if (i := text.find(s, max(floor, since - len(s) + 1))) >= 0), default=None)
