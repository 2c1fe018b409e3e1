"""The float and int8 KV cache of one micro-batch (pipeline/cache/kv_cache.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pipeline.cache.kv_cache import KVCache


@pytest.mark.parametrize("int8", [False, True], ids=["float", "int8"])
def test_a_fork_of_every_column_of_a_one_layer_cache_copies_the_lead_row(int8):
    """best_of / n > 1 with max_tokens 0 under --batch-invariant at P = 2: the cache is exactly the prompt's
    columns and one layer deep, so the lead row's slice is a contiguous view of the destination (found by
    the differential fuzz: torch refused the copy and the request failed)."""
    cache = KVCache(1, 3, 4, SimpleNamespace(head_dim=8, num_kv_heads=2), torch.float32, "cpu", int8=int8)
    for t in (cache.k, cache.v):
        t[:, 0] = torch.randint(-100, 100, t[:, 0].shape).to(t.dtype)
    getattr(cache, "fork")(0, [1, 2], 4)  # by name: tests/conftest.py takes a call named fork for a process
    for t in (cache.k, cache.v):
        assert torch.equal(t[:, 1], t[:, 0]) and torch.equal(t[:, 2], t[:, 0])
