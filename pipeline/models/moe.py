"""Mixture-of-experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE), tokens grouped by expert.

The router scores tokens in float32 (as HF does) and keeps the ``top_k`` best; each expert that
received tokens runs one matmul pair over exactly its tokens, in ascending expert order like HF
(experts no token chose cost nothing). Qwen2-MoE adds a shared expert scaled by
``sigmoid(shared_gate(x))``. Expert weights are fused as transformers 5 holds them: ``gate_up``
(E, 2I, H), each expert's gate rows first, and ``down`` (E, H, I). With ``tile`` > 0 (batch-invariant)
routing and every expert's rows run on fixed tiles, so a token's output depends only on itself.
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.models.kernels.invariant import fixed_elementwise, fixed_linear, map_rows
from pipeline.models.spec import DecoderSpec
from pipeline.models.mlp import ACTIVATIONS, MLP


class SparseMoE(nn.Module):
    """Router + ``num_experts`` SwiGLU experts (+ an optional gated shared expert) of one layer."""

    def __init__(self, spec: DecoderSpec, tile: int = 0):
        super().__init__()

        m = spec.moe
        assert m is not None and spec.mlp == "gated", "experts are SwiGLU MLPs"
        self.moe, self.tile = m, tile
        h, e, i = spec.hidden_size, m.num_experts, m.expert_size
        self.router = nn.Linear(h, e, bias=False)
        self.gate_up = nn.Parameter(torch.empty(e, 2 * i, h))  # expert j: rows [gate_j; up_j]
        self.down = nn.Parameter(torch.empty(e, h, i))
        self.act = ACTIVATIONS[spec.activation]
        self.shared = self.shared_gate = None
        if m.shared_expert_size:
            self.shared = MLP(replace(spec, intermediate_size=m.shared_expert_size, mlp_bias=False, moe=None), tile)
            self.shared_gate = nn.Linear(h, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., hidden) -> (..., hidden)."""
        flat = x.reshape(-1, x.shape[-1])  # (n, H)
        weights, experts = self.route(flat)  # (n, k) each
        out = self.experts(flat, weights, experts)
        if self.shared is not None:
            out = out + map_rows(self._shared, flat, self.tile)
        return out.reshape(x.shape)

    def route(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(n, H) -> routing weights (n, k) and chosen experts (n, k), best first."""
        if not self.tile:
            return self._route(flat)
        k = self.moe.top_k
        # weights and expert ids travel through map_rows as one float32 tensor (ids < 2**24 are exact)
        packed = map_rows(lambda p: torch.cat([w.float() for w in self._route(p)], dim=-1), flat, self.tile)
        return packed[:, :k].to(self._weight_dtype(flat)), packed[:, k:].long()

    def _route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs = torch.softmax(self.router(x).float(), dim=-1)  # (n, E) float32
        weights, experts = probs.topk(self.moe.top_k, dim=-1)
        if self.moe.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(self._weight_dtype(x)), experts

    def _weight_dtype(self, x: torch.Tensor) -> torch.dtype:
        return torch.float32 if self.moe.fp32_weights else x.dtype

    def experts(self, flat: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """Sum over each token's chosen experts of weight * expert(token): one call per used expert."""
        k = self.moe.top_k
        assignment = experts.reshape(-1)  # (n*k,) token t's choices at t*k .. t*k+k-1
        order = assignment.argsort(stable=True)  # assignments grouped by expert
        counts = torch.bincount(assignment, minlength=self.moe.num_experts).tolist()
        token = order // k  # (n*k,) the token of each sorted assignment
        scale = weights.reshape(-1)[order, None]  # (n*k, 1)
        out = torch.zeros_like(flat)
        begin = 0
        for e, n in enumerate(counts):
            if n == 0:  # no token chose this expert in this pass
                continue
            rows = token[begin : begin + n]
            h = flat.index_select(0, rows)  # (n, H)
            y = map_rows(partial(self._expert, e), h, self.tile)
            out.index_add_(0, rows, (y * scale[begin : begin + n]).to(out.dtype))
            begin += n
        return out

    def _expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert ``e``'s SwiGLU on x (n, H) -> (n, H)."""
        linear = fixed_linear if self.tile else F.linear
        gate, up = linear(x, self.gate_up[e]).chunk(2, dim=-1)
        act = fixed_elementwise(self.act, gate.contiguous()) if self.tile else self.act(gate)
        return linear(act * up, self.down[e])

    def _shared(self, x: torch.Tensor) -> torch.Tensor:
        g = self.shared_gate(x)  # (n, 1)
        g = fixed_elementwise(torch.sigmoid, g) if self.tile else torch.sigmoid(g)
        return g * self.shared._mlp(x)
