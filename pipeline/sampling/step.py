"""One sampling step of a micro-batch on the device: hidden states -> logits -> tokens and logprobs.

Batched: one head matmul, the processors, one sampling call, one log-softmax/top-k and one
device->host copy. The caller (pipeline.output.head) keeps the rows' state.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pipeline.models.device import to_device
from pipeline.sampling.processors import process
from pipeline.sampling.sampler import logprob_info, sample


@dataclass
class Draw:
    """What a step chose, on the host: one entry per row."""
    chosen: list[int]
    chosen_lp: list[float]  # logprob of the chosen token in the raw distribution (see pipeline.sampling.sampler)
    top_i: list[list[int]] | None = None  # the top-k ids per row, when any row asked for logprobs
    top_v: list[list[float]] | None = None


def head_logits(model, hiddens: list[torch.Tensor], targets: list[list[int]]) -> torch.Tensor:
    """Logits (rows, V) float32 for the hidden states ``hiddens`` (each (m_i, hidden)); a hidden state
    whose entry in ``targets`` lists several rows (a best_of prefill lead) serves each of them."""
    logits = model.head(torch.cat(hiddens))  # (m, V) float32
    if any(len(rows) > 1 for rows in targets):
        expand = [i for i, rows in enumerate(targets) for _ in rows]
        logits = logits[to_device(expand, logits.device, torch.long)]
    return logits


def draw(logits: torch.Tensor, ps: list, counts: list[dict[int, int]], uniforms: list[float],
         allowed: torch.Tensor | None = None, generated: list[int] | None = None,
         prompt_ids: list[torch.Tensor | None] | None = None, stop_ids: set[int] = frozenset()) -> Draw:
    """Choose one token per row of ``logits`` (R, V) with each row's parameters ``ps`` (tasks.requests'
    Params). ``uniforms``: each row's random number for this step (ignored at temperature 0);
    ``allowed``: an optional (R, V) bool mask (structured outputs), applied before everything else;
    ``counts``, ``generated``, ``prompt_ids``, ``stop_ids``: as :func:`pipeline.sampling.processors.process`
    takes them. Raises before returning anything, so a caller may retry rows one by one.
    """
    vocab = logits.shape[-1]
    raw = logits  # reported logprobs: the model's own distribution, before any mask or penalty
    if allowed is not None:
        logits = logits.masked_fill(~allowed, float("-inf"))
    generated = generated if generated is not None else [0] * len(ps)
    prompt_ids = prompt_ids if prompt_ids is not None else [None] * len(ps)
    processed = process(logits, ps, counts, generated, prompt_ids, stop_ids, masked=allowed is not None)
    if allowed is not None and processed is not logits:  # a logit_bias must not lift a masked token back
        processed = processed.masked_fill(~allowed, float("-inf"))
    logits = processed
    # every row's sampling parameters in one host->device copy, the hot rows' indices in a second
    params = to_device([[p.temperature for p in ps], [p.top_p for p in ps],
                        [float(min(p.top_k, vocab)) for p in ps],  # top_k beyond the vocabulary: all of it
                        [u if p.temperature > 0 else 0.0 for u, p in zip(uniforms, ps)],
                        [p.min_p for p in ps]],
                       logits.device, torch.float32)
    hot = [i for i, p in enumerate(ps) if p.temperature > 0]
    chosen = sample(logits, params[0], params[2].long(), params[1], params[3],
                    to_device(hot, logits.device, torch.long) if hot else None,
                    params[4] if any(p.min_p for p in ps) else None)
    k = max((p.logprobs or 0) for p in ps)
    chosen_lp, top_v, top_i = logprob_info(raw, chosen, k)
    # one device->host copy for the pass: ids and logprobs side by side (float64 holds both exactly)
    cols = [chosen[:, None], chosen_lp[:, None]] + ([top_i, top_v] if k else [])
    host = torch.cat([c.double() for c in cols], dim=1).tolist()
    out = Draw([int(h[0]) for h in host], [h[1] for h in host])
    if k:
        out.top_i, out.top_v = [[int(x) for x in h[2 : 2 + k]] for h in host], [h[2 + k :] for h in host]
    return out
