"""The logits processors a row's parameters ask for, for a whole micro-batch at once: ``logit_bias``,
``min_tokens`` (EOS and ``stop_token_ids`` masked until then), ``repetition_penalty`` (over the prompt's
and the generated tokens) and OpenAI's ``frequency_penalty`` / ``presence_penalty`` (over the generated
tokens), in vLLM's order: logit_bias and min_tokens first, then the penalties.

Each is one tensor operation over the rows that ask for it (sparse index_put for bias, counts and the
min_tokens mask; one masked ``where`` for the repetition penalty); Python only lists each row's
entries (its bias, its distinct generated tokens), never the vocabulary. tests/unit/pipeline/sampling/
test_processors.py checks each against transformers' logits processors on the same logits.
Reported logprobs never see any of this (pipeline.sampling.sampler).
"""

from __future__ import annotations

import torch

from pipeline.loading.upload import to_device


def process(logits: torch.Tensor, ps: list, counts: list[dict[int, int]], generated: list[int],
            prompt_seen: list[torch.Tensor | None], stop_ids: set[int]) -> torch.Tensor:
    """``logits`` (R, V) float32 after each row's processors (a new tensor; ``logits`` is left as it is
    when a row asks for nothing). ``ps``: each row's parameters (tasks.requests.Params); ``counts``: its
    generated tokens' counts; ``generated``: how many tokens it generated; ``prompt_seen``: a (V,) bool
    mask of its prompt's tokens where its repetition_penalty is on (else None); ``stop_ids``: the model's
    EOS ids (min_tokens masks them with the row's stop_token_ids)."""
    out = logits
    if any(p.logit_bias for p in ps):
        out = _bias(out.clone(), ps)
    early = [i for i, (p, n) in enumerate(zip(ps, generated)) if n < p.min_tokens]
    if early:
        out = _min_tokens(out if out is not logits else out.clone(), early, ps, stop_ids)
    rep = [i for i, p in enumerate(ps) if p.repetition_penalty != 1.0]
    if rep:
        out = _repetition(out if out is not logits else out.clone(), rep, ps, counts, prompt_seen)
    if any(p.presence_penalty or p.frequency_penalty for p in ps):
        out = _frequency_presence(out if out is not logits else out.clone(), ps, counts)
    return out


def _bias(logits: torch.Tensor, ps: list) -> torch.Tensor:
    rows, toks, vals = [], [], []
    for i, p in enumerate(ps):
        for t, v in p.logit_bias.items():
            rows.append(i)
            toks.append(t)
            vals.append(v)
    dev = logits.device
    logits.index_put_((to_device(rows, dev, torch.long), to_device(toks, dev, torch.long)),
                      to_device(vals, dev, logits.dtype), accumulate=True)
    return logits


def _min_tokens(logits: torch.Tensor, early: list[int], ps: list, stop_ids: set[int]) -> torch.Tensor:
    """EOS and each early row's stop_token_ids to -inf; a row the mask would leave with nothing (a grammar
    that can only end) keeps its logits: it ends, as its constraint says."""
    vocab, dev = logits.shape[-1], logits.device
    rows, toks = [], []
    for i in early:
        for t in stop_ids.union(ps[i].stop_token_ids):
            if t < vocab:
                rows.append(i)
                toks.append(t)
    if not rows:
        return logits
    idx = to_device(early, dev, torch.long)
    before = logits[idx]
    logits.index_put_((to_device(rows, dev, torch.long), to_device(toks, dev, torch.long)),
                      torch.tensor(float("-inf"), device=dev))
    after = logits[idx]
    logits[idx] = torch.where((after > float("-inf")).any(-1, keepdim=True), after, before)
    return logits


def _repetition(logits: torch.Tensor, rep: list[int], ps: list, counts: list[dict[int, int]],
                prompt_seen: list[torch.Tensor | None]) -> torch.Tensor:
    """HF's and vLLM's repetition penalty: a seen token's logit divided by the penalty where positive,
    multiplied where negative (both make it less likely for a penalty above 1)."""
    vocab, dev = logits.shape[-1], logits.device
    seen = torch.stack([m if m is not None else torch.zeros(vocab, dtype=torch.bool, device=dev)
                        for m in (prompt_seen[i] for i in rep)])  # (r, V)
    rows = [j for j, i in enumerate(rep) for _ in counts[i]]
    if rows:
        toks = [t for i in rep for t in counts[i]]
        seen[to_device(rows, dev, torch.long), to_device(toks, dev, torch.long)] = True
    idx = to_device(rep, dev, torch.long)
    penalty = to_device([ps[i].repetition_penalty for i in rep], dev, logits.dtype)[:, None]
    sub = logits[idx]
    logits[idx] = torch.where(seen, torch.where(sub < 0, sub * penalty, sub / penalty), sub)
    return logits


def _frequency_presence(logits: torch.Tensor, ps: list, counts: list[dict[int, int]]) -> torch.Tensor:
    """OpenAI's formula: logit[j] -= count[j] * frequency_penalty + (count[j] > 0) * presence_penalty."""
    rows, toks, vals = [], [], []
    for i, p in enumerate(ps):
        if p.presence_penalty or p.frequency_penalty:
            for t, c in counts[i].items():
                rows.append(i)
                toks.append(t)
                vals.append(-(p.frequency_penalty * c + p.presence_penalty))
    if rows:
        dev = logits.device
        logits.index_put_((to_device(rows, dev, torch.long), to_device(toks, dev, torch.long)),
                          to_device(vals, dev, logits.dtype), accumulate=True)
    return logits


def prompt_mask(prompt_ids: list[int], vocab: int, device: torch.device) -> torch.Tensor:
    """(V,) bool: the tokens of a prompt (the repetition penalty counts them), ids beyond V left out."""
    mask = torch.zeros(vocab, dtype=torch.bool, device=device)
    ids = [t for t in prompt_ids if 0 <= t < vocab]
    if ids:
        mask[to_device(ids, device, torch.long)] = True
    return mask
