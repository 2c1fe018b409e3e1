"""The logits processors a row's parameters ask for, for a whole micro-batch at once: ``logit_bias``,
``min_tokens`` (EOS and ``stop_token_ids`` masked until then), ``repetition_penalty`` (over the prompt's
and the generated tokens) and ``frequency_penalty`` / ``presence_penalty`` (over the generated tokens),
in vLLM's order. Each is one sparse tensor operation over the (row, token) pairs that need it, never a
loop over the vocabulary; each is checked against transformers' own (tests/unit/pipeline/sampling/
test_processors.py). Reported logprobs never see any of this (pipeline.sampling.sampler).
"""

from __future__ import annotations

import torch

from pipeline.models.device import to_device


def process(logits: torch.Tensor, ps: list, counts: list[dict[int, int]], generated: list[int],
            prompt_ids: list[torch.Tensor | None], stop_ids: set[int], masked: bool = False) -> torch.Tensor:
    """``logits`` (R, V) float32 after each row's processors (a new tensor; ``logits`` is left as it is
    when a row asks for nothing). ``ps``: each row's parameters (tasks.requests.Params); ``counts``: its
    generated tokens' counts; ``generated``: how many tokens it generated; ``prompt_ids``: its prompt's
    distinct token ids on the device (:func:`prompt_tokens`) where its repetition_penalty is on (else
    None); ``stop_ids``: the model's EOS ids (min_tokens masks them with the row's stop_token_ids);
    ``masked``: some logits are -inf already (an output constraint), so min_tokens may not leave a row
    with nothing."""
    out = logits
    if any(p.logit_bias for p in ps):
        out = _add_at(out.clone(), [(i, t, v) for i, p in enumerate(ps) for t, v in p.logit_bias.items()])
    early = [i for i, (p, n) in enumerate(zip(ps, generated)) if n < p.min_tokens]
    if early:
        out = _min_tokens(out if out is not logits else out.clone(), early, ps, stop_ids, masked)
    rep = [i for i, p in enumerate(ps) if p.repetition_penalty != 1.0]
    if rep:
        out = _repetition(out if out is not logits else out.clone(), rep, ps, counts, prompt_ids)
    if any(p.presence_penalty or p.frequency_penalty for p in ps):
        out = _frequency_presence(out if out is not logits else out.clone(), ps, counts)
    return out


def _add_at(logits: torch.Tensor, triples: list[tuple[int, int, float]]) -> torch.Tensor:
    """``logits[row, token] += value`` for each (row, token, value), in one scatter."""
    if triples:
        rows, toks, vals = (list(x) for x in zip(*triples))
        dev = logits.device
        logits.index_put_((to_device(rows, dev, torch.long), to_device(toks, dev, torch.long)),
                          to_device(vals, dev, logits.dtype), accumulate=True)
    return logits


def _min_tokens(logits: torch.Tensor, early: list[int], ps: list, stop_ids: set[int], masked: bool) -> torch.Tensor:
    """EOS and each early row's stop_token_ids to -inf. Under an output constraint (``masked``), a row the
    mask would leave with nothing (a grammar that can only end) keeps its logits: it ends, as its
    constraint says; raw logits are finite, so elsewhere a row always keeps the rest of the vocabulary."""
    vocab, dev = logits.shape[-1], logits.device
    pairs = [(i, t) for i in early for t in stop_ids.union(ps[i].stop_token_ids) if t < vocab]
    if not pairs:
        return logits
    rows, toks = (list(x) for x in zip(*pairs))
    if masked:
        idx = to_device(early, dev, torch.long)
        before = logits[idx]
    logits.index_put_((to_device(rows, dev, torch.long), to_device(toks, dev, torch.long)),
                      torch.tensor(float("-inf"), device=dev))
    if masked:
        after = logits[idx]
        logits[idx] = torch.where((after > float("-inf")).any(-1, keepdim=True), after, before)
    return logits


def _repetition(logits: torch.Tensor, rep: list[int], ps: list, counts: list[dict[int, int]],
                prompt_ids: list[torch.Tensor | None]) -> torch.Tensor:
    """HF's and vLLM's repetition penalty: a seen token's logit divided by the penalty where positive,
    multiplied where negative (both make it less likely for a penalty above 1). Sparse: the (row, token)
    pairs seen, each once (a prompt token also generated is penalized once)."""
    vocab, dev = logits.shape[-1], logits.device
    parts = [prompt_ids[i] + i * vocab for i in rep if prompt_ids[i] is not None and prompt_ids[i].numel()]
    generated = [i * vocab + t for i in rep for t in counts[i]]
    if generated:
        parts.append(to_device(generated, dev, torch.long))
    if not parts:
        return logits
    flat = torch.unique(torch.cat(parts))  # (row, token) pairs as row * V + token, each once
    rows, toks = flat // vocab, flat % vocab
    penalty = torch.ones(logits.shape[0], dtype=logits.dtype, device=dev)
    penalty[to_device(rep, dev, torch.long)] = to_device([ps[i].repetition_penalty for i in rep], dev, logits.dtype)
    seen, p = logits[rows, toks], penalty[rows]
    logits[rows, toks] = torch.where(seen < 0, seen * p, seen / p)
    return logits


def _frequency_presence(logits: torch.Tensor, ps: list, counts: list[dict[int, int]]) -> torch.Tensor:
    """OpenAI's formula: logit[j] -= count[j] * frequency_penalty + (count[j] > 0) * presence_penalty."""
    return _add_at(logits, [(i, t, -(p.frequency_penalty * c + p.presence_penalty)) for i, p in enumerate(ps)
                            if p.presence_penalty or p.frequency_penalty for t, c in counts[i].items()])


def prompt_tokens(prompt_ids: list[int], vocab: int, device: torch.device) -> torch.Tensor:
    """A prompt's distinct token ids (ids beyond V left out), on ``device``: what the repetition penalty
    counts besides the generated tokens."""
    ids = sorted({t for t in prompt_ids if 0 <= t < vocab})
    return to_device(ids, device, torch.long) if ids else torch.zeros(0, dtype=torch.long, device=device)
