"""Logprobs and token choice for a whole micro-batch at once, with per-row parameters.

Reported logprobs are ``log_softmax`` of the raw float32 logits, as OpenAI reports them. Sampling draws
from a counter-based random stream: a row's uniform at step ``t`` hashes (row key, t), the key from the
run seed, the request's ``seed`` (or its position in the file) and the choice index, so a request's
output never depends on the micro-batch it shared, the budget or pipeline size.
"""

from __future__ import annotations

import torch

_MASK64 = (1 << 64) - 1


def splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def stream_key(run_seed: int, request_seed: int | None, request_index: int, prompt_i: int, choice: int) -> int:
    """The random stream of one choice of one prompt of one request."""
    base = splitmix64(request_seed & _MASK64) if request_seed is not None else splitmix64(run_seed ^ splitmix64(request_index))
    return splitmix64(splitmix64(base ^ prompt_i) ^ choice)


def uniform(key: int, step: int) -> float:
    """A uniform in [0, 1) for step ``step`` of the stream ``key`` (53 random bits)."""
    return (splitmix64(key ^ splitmix64(step)) >> 11) * (1.0 / (1 << 53))


def truncated_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                    min_p: torch.Tensor | None = None):
    """Sorted candidate ids and their probabilities after temperature, top-k, top-p and min-p.

    logits (R, V) float32; temperature/top_p/min_p (R,) float; top_k (R,) long (0 = off). Returns (ids
    (R, V) by descending logit, probs (R, V) renormalized, zero outside the kept set), as transformers'
    warpers (in that order) and vLLM compute them: top-p's mass is counted within the top-k, min-p keeps
    the tokens at least min_p times as likely as the likeliest; the top token is always kept.
    """
    sorted_logits, ids = logits.sort(dim=-1, descending=True)
    probs = torch.softmax(sorted_logits / temperature[:, None], dim=-1)
    rank = torch.arange(logits.shape[-1], device=logits.device)[None, :]
    keep = (top_k[:, None] <= 0) | (rank < top_k[:, None])
    within = probs * keep  # top-p over the top-k's renormalized distribution
    before = within.cumsum(-1) - within  # mass strictly above each candidate
    keep &= (before < top_p[:, None] * within.sum(-1, keepdim=True)) | (top_p[:, None] >= 1)
    if min_p is not None:
        keep &= probs >= min_p[:, None] * probs[:, :1]
    keep[:, 0] = True
    probs = probs * keep
    # the kept mass summed in order (cumsum's last entry), not by sum(): ATen splits a reduction to one
    # value (a single hot row) of 32768+ entries among its threads, so its last bits followed the thread count
    return ids, probs / probs.cumsum(-1)[:, -1:]


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    uniforms: torch.Tensor,
    hot: torch.Tensor | None = ...,
    min_p: torch.Tensor | None = None,
) -> torch.Tensor:
    """Choose one token per row: argmax where temperature is 0, else inverse-CDF sampling.
    ``hot``: the rows with a temperature (None: none), when the caller knows them on the host;
    left out, they are found on the device (a device->host sync). ``min_p`` (R,): None is off."""
    out = logits.argmax(-1)
    if hot is ...:
        hot = (temperature > 0).nonzero().flatten()
    if hot is not None and hot.numel():
        ids, probs = truncated_probs(logits[hot], temperature[hot], top_k[hot], top_p[hot],
                                     min_p[hot] if min_p is not None else None)
        cdf = probs.cumsum(-1)
        target = uniforms[hot, None] * cdf[:, -1:]
        j = torch.searchsorted(cdf, target, right=True).clamp(max=cdf.shape[-1] - 1)
        # never land on a zero-probability candidate past the kept set
        j = torch.minimum(j, (probs > 0).sum(-1, keepdim=True) - 1).clamp(min=0)  # NaN probs: the top token
        out[hot] = ids.gather(-1, j).flatten()
    return out


def logprob_info(logits: torch.Tensor, chosen: torch.Tensor, k: int):
    """log_softmax of raw logits: the chosen tokens' logprobs and (if k) the top-k ids/values."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen_lp = lp.gather(-1, chosen[:, None]).flatten()
    if k:
        top_v, top_i = lp.topk(k, dim=-1)
        return chosen_lp, top_v, top_i
    return chosen_lp, None, None
