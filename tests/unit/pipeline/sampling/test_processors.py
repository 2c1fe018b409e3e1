"""The sampling fields against transformers' logits processors on the same logits: logit_bias
(SequenceBiasLogitsProcessor), min_tokens (MinNewTokensLengthLogitsProcessor), repetition_penalty
(RepetitionPenaltyLogitsProcessor), temperature / top_k / top_p / min_p (the warpers), and OpenAI's
frequency and presence penalties against OpenAI's formula. Each row is processed as it would be alone,
whatever shares its micro-batch."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import (LogitsProcessorList, MinNewTokensLengthLogitsProcessor, MinPLogitsWarper,
                          RepetitionPenaltyLogitsProcessor, SequenceBiasLogitsProcessor, TemperatureLogitsWarper,
                          TopKLogitsWarper, TopPLogitsWarper)

from pipeline.sampling.processors import process, prompt_tokens
from pipeline.sampling.sampler import sample, truncated_probs
from pipeline.sampling.step import draw
from tasks.requests import Params

V = 64
EOS = 2


def rows(seed: int, n: int) -> torch.Tensor:
    return torch.randn(n, V, generator=torch.Generator().manual_seed(seed)) * 3


def history(seed: int) -> tuple[list[int], list[int]]:
    g = torch.Generator().manual_seed(seed + 1)
    return torch.randint(0, V, (12,), generator=g).tolist(), torch.randint(0, V, (7,), generator=g).tolist()


def counts_of(ids: list[int]) -> dict[int, int]:
    out: dict[int, int] = {}
    for t in ids:
        out[t] = out.get(t, 0) + 1
    return out


def ours(logits, ps, prompts, gens):
    seen = [prompt_tokens(p, V, logits.device) if q.repetition_penalty != 1 else None for p, q in zip(prompts, ps)]
    return process(logits, ps, [counts_of(g) for g in gens], [len(g) for g in gens], seen, {EOS})


@pytest.mark.parametrize("penalty", [1.3, 0.7, 2.0, 1.0])
def test_repetition_penalty_is_hfs_over_prompt_and_generated_tokens(penalty):
    logits = rows(0, 3)
    prompts, gens = zip(*(history(s) for s in range(3)))
    ps = [Params(repetition_penalty=penalty), Params(), Params(repetition_penalty=1.5)]
    got = ours(logits.clone(), ps, prompts, gens)
    for i, p in enumerate(ps):
        ids = torch.tensor([prompts[i] + gens[i]])
        want = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(ids, logits[i : i + 1].clone())[0] \
            if p.repetition_penalty != 1 else logits[i]
        torch.testing.assert_close(got[i], want)


def test_frequency_and_presence_penalties_follow_openais_formula():
    logits = rows(1, 2)
    prompts, gens = zip(*(history(s) for s in (5, 6)))
    ps = [Params(frequency_penalty=0.5, presence_penalty=1.25), Params(presence_penalty=-0.5)]
    got = ours(logits.clone(), ps, prompts, gens)
    for i, p in enumerate(ps):
        want = logits[i].clone()
        for t, c in counts_of(gens[i]).items():  # prompt tokens do not count
            want[t] -= c * p.frequency_penalty + (c > 0) * p.presence_penalty
        torch.testing.assert_close(got[i], want)


def test_logit_bias_is_hfs_sequence_bias_of_single_tokens():
    logits = rows(2, 2)
    bias = {3: 5.0, 17: -100.0, 40: 0.25}
    got = ours(logits.clone(), [Params(logit_bias=bias), Params()], [[1], [1]], [[], []])
    hf = SequenceBiasLogitsProcessor([[[t], v] for t, v in bias.items()])
    torch.testing.assert_close(got[0], hf(torch.tensor([[1]]), logits[:1].clone())[0])
    torch.testing.assert_close(got[1], logits[1])


@pytest.mark.parametrize("made", [0, 2, 3, 5])
def test_min_tokens_masks_eos_and_stop_token_ids_as_hf_does(made):
    logits = rows(3, 1)
    prompt, gen = [1, 9, 9, 4], list(range(10, 10 + made))
    p = Params(min_tokens=3, max_tokens=8, stop_token_ids=[7, 11])
    got = ours(logits.clone(), [p], [prompt], [gen])[0]
    hf = MinNewTokensLengthLogitsProcessor(len(prompt), 3, [EOS, 7, 11])
    want = hf(torch.tensor([prompt + gen]), logits.clone())[0]
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    torch.testing.assert_close(got, want)


def test_min_tokens_leaves_a_row_whose_grammar_can_only_end():
    """A constraint that allows only EOS (complete, not yet stopped): masking EOS too would leave nothing,
    so the row keeps its logits and ends, as its constraint says."""
    logits = rows(4, 2)
    allowed = torch.zeros(2, V, dtype=torch.bool)
    allowed[0, EOS] = True
    allowed[1] = True
    ps = [Params(min_tokens=4), Params(min_tokens=4)]
    d = draw(logits, ps, [{}, {}], [0.0, 0.0], allowed, [0, 0], [None, None], {EOS})
    assert d.chosen[0] == EOS and d.chosen[1] != EOS


def hf_warped(logits: torch.Tensor, t: float, k: int, p: float, m: float) -> torch.Tensor:
    chain = [TemperatureLogitsWarper(t)] + ([TopKLogitsWarper(k)] if k else []) + \
            ([TopPLogitsWarper(p)] if p < 1 else []) + ([MinPLogitsWarper(m)] if m else [])
    return torch.softmax(LogitsProcessorList(chain)(torch.zeros(1, 1, dtype=torch.long), logits[None].clone())[0], -1)


def near_boundary(logits: torch.Tensor, t: float, k: int, p: float, m: float) -> bool:
    """Whether float rounding could decide a token's fate here (a top-p or min-p threshold within 1e-5)."""
    probs = torch.softmax(logits.double() / t, -1).sort(descending=True).values
    kept = probs[: k or V]
    within = kept / kept.sum()
    above = within.cumsum(0) - within
    return bool((p < 1 and ((above - p).abs() < 1e-5).any()) or (m and ((probs / probs[0] - m).abs() < 1e-5).any()))


@pytest.mark.parametrize("t,k,p,m", [(1.0, 0, 0.9, 0.0), (0.7, 5, 0.5, 0.0), (1.3, 10, 0.8, 0.05),
                                     (1.0, 0, 1.0, 0.1), (0.5, 0, 0.95, 0.3), (2.0, 8, 1.0, 0.0),
                                     (1.0, 3, 0.3, 0.9), (1.0, 100, 0.7, 0.02)])
def test_temperature_top_k_top_p_min_p_give_hfs_distribution(t, k, p, m):
    checked = 0
    for seed in range(40):
        logits = rows(10 + seed, 1)[0]
        if near_boundary(logits, t, k, p, m):
            continue
        ids, probs = truncated_probs(logits[None], torch.tensor([t]), torch.tensor([min(k, V)]), torch.tensor([p]),
                                     torch.tensor([m]))
        got = torch.zeros(V).scatter(0, ids[0], probs[0])
        want = hf_warped(logits, t, min(k, V), p, m)
        assert torch.equal(got > 0, want > 0), (seed, (got > 0).sum(), (want > 0).sum())
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
        checked += 1
    assert checked >= 30


def test_processing_a_row_does_not_depend_on_its_neighbours():
    logits = rows(7, 4)
    prompts, gens = zip(*(history(s) for s in range(4)))
    ps = [Params(repetition_penalty=1.4, min_tokens=9, max_tokens=9), Params(frequency_penalty=1.0),
          Params(logit_bias={5: 3.0}, presence_penalty=0.5), Params(min_p=0.2, repetition_penalty=0.8)]
    together = ours(logits.clone(), ps, prompts, gens)
    for i in range(4):
        alone = ours(logits[i : i + 1].clone(), ps[i : i + 1], prompts[i : i + 1], gens[i : i + 1])
        assert torch.equal(together[i], alone[0])


def test_greedy_takes_the_processed_argmax_and_reports_raw_logprobs():
    logits = rows(8, 2)
    prompts, gens = zip(*(history(s) for s in (1, 2)))
    ps = [Params(temperature=0.0, repetition_penalty=3.0), Params(temperature=0.0, logit_bias={0: 50.0})]
    seen = [prompt_tokens(prompts[0], V, logits.device), None]
    d = draw(logits, ps, [counts_of(g) for g in gens], [0.0, 0.0], None, [len(g) for g in gens], seen, {EOS})
    processed = ours(logits.clone(), ps, prompts, gens)
    assert d.chosen == processed.argmax(-1).tolist() and d.chosen[1] == 0
    raw = torch.log_softmax(logits, -1)
    assert all(math.isclose(d.chosen_lp[i], float(raw[i, d.chosen[i]]), abs_tol=1e-6) for i in range(2))


def test_min_p_sampling_never_draws_below_the_threshold():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.12, 0.05, 0.03]]))
    seen = set()
    for u in torch.linspace(0, 0.999, 200).tolist():
        tok = sample(logits, torch.tensor([1.0]), torch.tensor([0]), torch.tensor([1.0]), torch.tensor([u]),
                     min_p=torch.tensor([0.2]))
        seen.add(int(tok))
    assert seen == {0, 1, 2}  # 0.05 and 0.03 are below 0.2 x 0.5
