"""The stage's memory account (pipeline/runtime/memory.py): tensor bytes with shared storage once,
weights vs kernel copies vs tables, KV bytes, and a breakdown whose parts add up to the peak."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from pipeline.cache.kv_cache import KVCache
from pipeline.cache.prefix import PrefixStore
from pipeline.models.hf_stage import HFKVCache
from pipeline.runtime.memory import (MIB, MemoryLedger, cache_bytes, model_tensors, reachable_tensors, tensor_bytes,
                                     weight_bytes)


class Tied(nn.Module):
    """An embedding and a head sharing one (vocab, hidden) table, a norm, and a non-persistent table."""

    def __init__(self, vocab: int = 64, hidden: int = 16):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.norm = nn.LayerNorm(hidden, bias=False)
        self.head = nn.Linear(hidden, vocab, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("slopes", torch.ones(4), persistent=False)


def test_tied_tensors_and_views_count_once():
    t = torch.zeros(10, 8)  # 320 bytes
    assert tensor_bytes([t, t]) == 320
    assert tensor_bytes([t[:5], t[5:]]) == 320  # two halves of one storage: the union
    assert tensor_bytes([t[:6], t[4:]]) == 320  # overlapping views
    assert tensor_bytes([t[:2]]) == 64
    assert tensor_bytes([t, torch.zeros(3, dtype=torch.bfloat16)]) == 326  # distinct storages add up
    assert tensor_bytes([t.t()]) == 320  # a transposed view spans its storage
    assert tensor_bytes([torch.empty(0), torch.empty(5, device="meta")]) == 0


def test_weights_count_a_tied_table_once_and_leave_out_non_persistent_buffers():
    m = Tied(vocab=64, hidden=16)
    assert weight_bytes(m) == (64 * 16 + 16) * 4  # one table, the norm's weight; not the slopes
    kinds = model_tensors(m)
    assert tensor_bytes(kinds["tables"]) == 16
    assert kinds["kernel"] == []
    half = Tied().to(torch.bfloat16)
    assert weight_bytes(half) == (64 * 16 + 16) * 2  # the dtype as loaded


def test_kernel_copies_are_tensors_kept_as_plain_attributes():
    m = Tied()
    m.head.packed = m.embed.weight.detach().t().contiguous()  # a kernel's second copy of the table
    m.norm.scales = [torch.ones(16)]  # inside a container
    kinds = model_tensors(m)
    assert tensor_bytes(kinds["kernel"]) == 64 * 16 * 4 + 16 * 4
    assert tensor_bytes(kinds["weights"] + [m.embed.weight.detach()]) == weight_bytes(m)  # same storage: once


def test_an_opaque_prepacked_weight_counts_its_bytes():
    if not torch.backends.mkldnn.is_available():
        pytest.skip("no oneDNN in this torch build")
    w = torch.randn(64, 32)
    packed = torch.ops.mkldnn._reorder_linear_weight(w, 8)  # no storage: counted by its nbytes
    assert tensor_bytes([packed, packed]) == 64 * 32 * 4


def test_kv_bytes_are_the_caches_keys_values_and_row_flags():
    spec = SimpleNamespace(head_dim=16, num_kv_heads=2)  # the cache reads only the head sizes
    caches = [KVCache(3, 4, 10, spec, torch.float32, "cpu"), KVCache(3, 2, 700, spec, torch.bfloat16, "cpu")]
    expected = 2 * 3 * 4 * 2 * 10 * 16 * 4 + 4 + 2 * 3 * 2 * 2 * 700 * 16 * 2 + 2  # k + v (+ one bool per row)
    assert cache_bytes(caches) == expected
    int8 = KVCache(3, 4, 10, spec, torch.float32, "cpu", int8=True)  # records of head_dim + 4 bytes
    assert cache_bytes([int8]) == 2 * 3 * 4 * 2 * 10 * 20 + 4


def test_the_ledger_keeps_the_most_kv_bytes_and_their_split():
    spec = SimpleNamespace(head_dim=16, num_kv_heads=2)
    ledger = MemoryLedger()
    small, big = KVCache(2, 1, 8, spec, torch.float32, "cpu"), KVCache(2, 8, 64, spec, torch.float32, "cpu")
    pool = PrefixStore(4, keep_hidden=False)
    pool.resize(3, small.k, 32)
    pool_bytes = 2 * 2 * 2 * 12 * 16 * 4  # k + v: (layers, kv heads, blocks x block, head dim)
    assert tensor_bytes(reachable_tensors(pool)) == pool_bytes
    ledger.note_kv([small], pool)
    assert ledger.kv_at_peak == (cache_bytes([small]), pool_bytes)
    ledger.note_kv([big], None)
    ledger.note_kv([small], None)  # less than before: the peak stays
    assert ledger.kv_at_peak == (cache_bytes([big]), 0) and ledger.kv_peak == cache_bytes([big])


def test_the_breakdown_adds_up_to_the_peak():
    ledger = MemoryLedger()
    m = Tied(vocab=4096, hidden=256)
    ledger.loaded(m)
    ledger.ready()
    m.head.packed = torch.ones(1024, 256)  # 1 MiB of kernel copy
    spec = SimpleNamespace(head_dim=64, num_kv_heads=4)
    ledger.note_kv([KVCache(2, 4, 512, spec, torch.float32, "cpu")], None)
    b = ledger.breakdown(m, torch.device("cpu"), extra_buffers=3 * MIB)
    assert b["device"] == "cpu"
    assert b["weights"] == round((4096 * 256 + 256) * 4 / MIB, 1) and b["packed"] == 1.0
    assert b["kv_cache"] == 8.0 and b["prefix_pool"] == 0 and b["adapters"] == 0
    assert b["buffers"] == round((3 * MIB + 16) / MIB, 1)
    parts = ("process", "weights", "packed", "adapters", "kv_cache", "prefix_pool", "buffers", "other")
    assert abs(sum(b[k] for k in parts) - b["rss_peak"]) < 0.5  # each part rounded to 0.1 MiB
    assert b["rss_peak"] >= b["rss_ready"] >= b["process"] > 0


def test_the_generic_stage_cache_counts_the_layers_it_allocated():
    cache = HFKVCache(3, 2, 40, torch.float32, "cpu")  # layers allocate at their first update
    assert cache_bytes([cache]) == 0
    cache.layer(0, torch.zeros(2, 4, 1, 8))  # (b, kv heads, t, head dim)
    assert cache_bytes([cache]) == 2 * 2 * 4 * 40 * 8 * 4


def test_the_walk_stays_out_of_code_and_submodules():
    holder = SimpleNamespace(table=torch.zeros(4), nested={"a": [torch.zeros(2)]}, lib=torch.nn.functional,
                             fn=test_tied_tensors_and_views_count_once, sub=nn.Linear(2, 2))
    assert tensor_bytes(reachable_tensors(holder)) == 16 + 8
    assert reachable_tensors(SimpleNamespace(deep=[[[[torch.zeros(1)]]]])) == []  # deeper than the walk goes
