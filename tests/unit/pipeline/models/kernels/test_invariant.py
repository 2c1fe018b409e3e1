"""Batch-invariant mode (--batch-invariant): a row's logits are bit-identical whatever shares its
micro-batch, wherever it sits, however long its neighbours are, and with 1, 2 or 3 threads; and the
mode still matches HuggingFace. (Default mode makes no such promise: see test_runner_e2e.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pipeline.models.decoder import Segment
from pipeline.models.kernels.invariant import ROW_TILE, fixed_elementwise, fixed_linear, map_rows
from pipeline.config.partition import stage_ranges
from tests.unit.pipeline.models.families.test_opt_bloom_gpt2 import build as build_family
from tests.utils import hf_logits, stage_chain, tiny_llama

TARGET = [5, 17, 300, 42, 9, 11, 200, 7, 13, 64, 3]
OTHERS = [[100, 200], [31, 400, 8, 99, 150, 7, 7, 7, 7, 7, 7, 7, 7, 7, 1, 2, 3, 4, 5], [9] * 40, [12, 13, 14],
          [(3 * i) % 500 + 3 for i in range(260)]]  # past SDPA's 192-query block


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def _variants(x: torch.Tensor, fn, tile: int) -> list[torch.Tensor]:
    """fn's output for row x placed at several positions among random neighbours, 1-3 threads."""
    outs = []
    for th in (1, 2, 3):
        torch.set_num_threads(th)
        for m, pos in ((1, 0), (5, 4), (16, 7), (37, 36), (37, 0)):
            batch = torch.randn(m, x.shape[-1])
            batch[pos] = x
            outs.append(map_rows(fn, batch, tile)[pos] if tile else fn(batch)[pos])
    return outs


@pytest.mark.parametrize("k, n", [(256, 768), (688, 256), (1024, 4096), (2048, 768), (4096, 1024), (2048, 32000)])
def test_tiled_linear_is_row_invariant(k, n, threads):
    """The batch-invariant linear: bit-identical at every position and for 1-3 threads (a BLAS may split
    a long reduction among threads: MKL on an AVX-512 Xeon does from K = 1024), and the plain product
    up to float rounding."""
    torch.manual_seed(0)
    w, x = torch.randn(n, k) / k**0.5, torch.randn(k)
    outs = _variants(x, lambda t: fixed_linear(t, w), ROW_TILE)
    assert all(torch.equal(o, outs[0]) for o in outs)
    torch.testing.assert_close(outs[0], F.linear(x, w), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("width", [688, 4096, 14336, 40000])
def test_fixed_elementwise_is_row_and_thread_invariant(width, threads):
    torch.manual_seed(0)
    for act in (F.silu, lambda a: F.gelu(a, approximate="tanh")):
        outs = _variants(torch.randn(width) * 3, lambda t: fixed_elementwise(act, t), 0)
        assert all(torch.equal(o, outs[0]) for o in outs)


@torch.inference_mode()
def _prefill_and_decode(chain, prompts: list[list[int]], order: list[int], steps: int = 3):
    """Prompts prefilled together (rows permuted by ``order``), then ``steps`` greedy decode steps.
    Returns per prompt: (last-position logits after prefill, logits of each decode step)."""
    b, t = len(prompts), max(len(p) for p in prompts)
    rows = [order.index(i) for i in range(b)]  # prompt i sits in cache row rows[i]
    ids = torch.zeros(b, t, dtype=torch.long)
    lens = [len(prompts[order[r]]) for r in range(b)]
    for r in range(b):
        ids[r, : lens[r]] = torch.tensor(prompts[order[r]])
    caches = [st.new_cache(b, t + steps) for st in chain]
    seg = Segment(torch.arange(b), torch.zeros(b, dtype=torch.long), t, t, all_rows=True, fresh=True, lens=lens)
    x = ids
    for st, c in zip(chain, caches, strict=True):
        x = st(x, seg, c)
    logits = chain[-1].head(x[torch.arange(b), torch.tensor(lens) - 1])
    out = [[logits[rows[i]]] for i in range(b)]
    cur = list(lens)
    for _ in range(steps):
        nxt = logits.argmax(-1)
        seg = Segment(torch.arange(b), torch.tensor(cur), 1, max(cur) + 1, all_rows=True, lens=[1] * b)
        x = nxt[:, None]
        for st, c in zip(chain, caches, strict=True):
            x = st(x, seg, c)
        logits = chain[-1].head(x[:, -1])
        for i in range(b):
            out[i].append(logits[rows[i]])
        cur = [c + 1 for c in cur]
    return out


def _llama(tmp_path):
    return tiny_llama(tmp_path, num_key_value_heads=2)


def _llama_head10(tmp_path):  # a head of 40 bytes: where a row's keys sit follows the micro-batch's shape
    return tiny_llama(tmp_path, hidden_size=30, num_attention_heads=3, num_key_value_heads=3, intermediate_size=50)


def _bloom(tmp_path):  # ALiBi
    return build_family(tmp_path, "bloom", hidden_size=48, n_layer=3, n_head=6)


def _gptj(tmp_path):  # parallel residual, interleaved partial rotary
    return build_family(tmp_path, "gptj", n_embd=64, n_layer=3, n_head=4, rotary_dim=8, n_positions=128)


@pytest.mark.parametrize("make", [_llama, _llama_head10, _bloom, _gptj], ids=["llama", "llama-head10", "bloom", "gptj"])
def test_stage_chain_is_batch_invariant_and_matches_hf(make, tmp_path, threads):
    model_dir = make(tmp_path)
    alone = None
    for stages in (1, 2, 3):
        chain = stage_chain(model_dir, stage_ranges(3, stages), batch_invariant=True)
        for th in (1, 2, 3):
            torch.set_num_threads(th)
            layouts = [([TARGET], [0]), ([TARGET] + OTHERS, [0, 1, 2, 3, 4, 5]),
                       ([TARGET] + OTHERS, [3, 1, 5, 4, 0, 2]), ([TARGET] + OTHERS[2:], [2, 3, 1, 0])]
            for prompts, order in layouts:
                got = _prefill_and_decode(chain, prompts, order)[0]
                if alone is None:
                    alone = got
                    ref = hf_logits(model_dir, TARGET)[-1]
                    torch.testing.assert_close(got[0], ref, atol=1e-4, rtol=1e-4)
                assert all(torch.equal(a, b) for a, b in zip(got, alone, strict=True)), (stages, th, order)


def _gemma2(tmp_path):  # soft-capping, a sliding window of 4 on alternate layers
    from tests.utils import random_hf_model
    return random_hf_model(tmp_path, "gemma2", hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                           intermediate_size=96, head_dim=16, sliding_window=4, query_pre_attn_scalar=24,
                           attn_logit_softcapping=0.05, final_logit_softcapping=0.5)


@torch.inference_mode()
@pytest.mark.parametrize("make", [_llama, _bloom, _gemma2], ids=["llama-gqa", "bloom-alibi", "gemma2-window-softcap"])
def test_a_resumed_prefill_gives_the_decode_steps_bits(make, tmp_path, threads):
    """A row stopped after k decode steps and resumed as prompt + its k tokens (``Segment.replay``): the
    prefill's last logits equal the k-th decode step's bit for bit, and so does the next decode step; the
    row sits beside another prompt in another cache row. (Without the replay the prompt's attention
    computes those positions, and the last bits differ.)"""
    torch.set_num_threads(2)
    chain = stage_chain(make(tmp_path), stage_ranges(3, 2), batch_invariant=True)
    other, steps = OTHERS[1], 6

    def run(prompts, replay, decode):
        b, t = len(prompts), max(map(len, prompts))
        ids = torch.zeros(b, t, dtype=torch.long)
        for r, p in enumerate(prompts):
            ids[r, : len(p)] = torch.tensor(p)
        caches = [st.new_cache(b, t + decode + 1) for st in chain]
        lens = [len(p) for p in prompts]
        x = ids
        seg = Segment(torch.arange(b), torch.zeros(b, dtype=torch.long), t, t, all_rows=True, fresh=True,
                      prefill=True, lens=lens, replay=replay)
        for st, c in zip(chain, caches, strict=True):
            x = st(x, seg, c)
        logits, out, cur = chain[-1].head(x[torch.arange(b), torch.tensor(lens) - 1]), [], list(lens)
        out.append(logits[1])
        for _ in range(decode):
            seg = Segment(torch.arange(b), torch.tensor(cur), 1, max(cur) + 1, all_rows=True, lens=[1] * b)
            x = logits.argmax(-1)[:, None]
            for st, c in zip(chain, caches, strict=True):
                x = st(x, seg, c)
            logits, cur = chain[-1].head(x[:, -1]), [c + 1 for c in cur]
            out.append(logits[1])
        return out

    first = run([other, TARGET], None, steps)
    tokens = [int(lg.argmax()) for lg in first[:steps - 1]]
    again = run([other, TARGET + tokens], [0, len(tokens)], 1)
    assert torch.equal(again[0], first[steps - 1]) and torch.equal(again[1], first[steps])
