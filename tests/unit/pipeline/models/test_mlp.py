"""The MLP of a long prefill pass runs MLP_ROWS tokens at a time: the same results (to float rounding)
and shapes as one call, for unpadded (tokens, hidden) and padded (rows, tokens, hidden) inputs."""

from __future__ import annotations

import pytest
import torch

from pipeline.models import mlp as mlp_module
from pipeline.models.mlp import MLP
from pipeline.models.spec import DecoderSpec


@pytest.mark.parametrize("gated", [True, False])
def test_long_passes_run_in_row_blocks_with_the_same_results(monkeypatch, gated):
    spec = DecoderSpec(family="llama", vocab_size=32, hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=2,
                       head_dim=8, intermediate_size=40, max_positions=64, position="learned", mlp="gated" if gated else "plain",
                       activation="silu" if gated else "gelu")
    torch.manual_seed(0)
    mlp = MLP(spec).eval()
    for x in (torch.randn(23, 16), torch.randn(3, 9, 16)):
        whole = mlp(x)
        monkeypatch.setattr(mlp_module, "MLP_ROWS", 5)
        calls = []
        monkeypatch.setattr(mlp, "_mlp", lambda t, *a, real=mlp._mlp: calls.append(t.shape[0]) or real(t, *a))
        blocks = mlp(x)
        monkeypatch.undo()
        assert blocks.shape == whole.shape and max(calls) <= 5 and sum(calls) == x[..., 0].numel()
        torch.testing.assert_close(blocks, whole, atol=1e-6, rtol=1e-6)
