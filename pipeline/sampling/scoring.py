"""Echo scoring on the device: the logprob of every prompt token given the ones before it.

The head runs over the prompt in chunks (no prompt x vocabulary float32 tensor beyond one chunk); the
positions the prefix cache served are scored from the pool, and the blocks a prompt saves keep its scores.
"""

from __future__ import annotations

import torch

from pipeline.sampling.sampler import logprob_info

ECHO_CHUNK = 256  # prompt positions per head call when scoring


class PromptScorer:
    def __init__(self, model):
        self.model = model  # its .head(h (rows, hidden)) -> (rows, V) float32 logits

    def score(self, h: torch.Tensor, ids: list[int], k: int, item=None, pool=None) -> dict:
        """Logprob of every prompt token given the ones before it (the first is None) and the top ``k``.

        ``h``: final hidden states of the positions this pass computed (from ``item.cached`` on; ``item``:
        the prompt's pipeline.runtime.messages.Prefill, None when nothing was cached). Cached positions
        are scored from the pool (:meth:`_cached_scores`); the blocks this prompt saves keep its scores."""
        cached = item.cached if item is not None else 0
        parts = [self._cached_scores(ids, k, item, pool)] if cached else []
        if len(ids) - 1 > cached:
            parts.append(self.head_scores(h[: len(ids) - 1 - cached], ids[cached + 1 :], k))
        if not parts:
            return {"ids": ids, "logprobs": [None], "top": [None] if k else None}
        lp, top_v, top_i = (torch.cat([p[j] for p in parts]) if k or j == 0 else None for j in range(3))
        if item is not None and item.save and pool is not None:
            pool.put_scores(item.save, lp, top_v, top_i, k)
        tops = [None] + [list(zip(i, v)) for i, v in zip(top_i.tolist(), top_v.tolist())] if k else None
        return {"ids": ids, "logprobs": [None] + lp.tolist(), "top": tops}

    def head_scores(self, h: torch.Tensor, following: list[int], k: int):
        """(logprob of ``following[j]`` at position ``j``, top-k values, top-k ids), the head in chunks."""
        out = []
        for a in range(0, h.shape[0], ECHO_CHUNK):
            chunk = self.model.head(h[a : a + ECHO_CHUNK])  # (rows, V) float32
            out.append(logprob_info(chunk, torch.tensor(following[a : a + ECHO_CHUNK], device=chunk.device), k))
        return tuple(torch.cat([o[j] for o in out]) if k or j == 0 else None for j in range(3))

    def _cached_scores(self, ids: list[int], k: int, item, pool):
        """Scores of the first ``item.cached`` positions, which the pool holds: its stored scores (the head
        then runs only over each block's last position, whose next token is the next block's), else the
        head over its hidden states, kept."""
        cached, bs = item.cached, pool.block_size
        stored = pool.scores(item.load, cached, k)
        if stored is None:  # first echo over these blocks: the head over their hidden states, kept
            scores = self.head_scores(pool.hidden(item.load, cached), ids[1 : cached + 1], k)
            pool.put_scores(list(enumerate(item.load)), *scores, k)
            return scores
        lp, top_v, top_i = stored
        ends = list(range(bs - 1, cached, bs))  # each block's last position: its next token is the next block's
        if ends:
            rows = [item.load[j // bs] * bs + j % bs for j in ends]
            e_lp, e_v, e_i = self.head_scores(pool.h[rows], [ids[j + 1] for j in ends], k)
            lp[ends] = e_lp
            if k:
                top_v[ends], top_i[ends] = e_v, e_i
        return lp, top_v, top_i
