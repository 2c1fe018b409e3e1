"""LoRA adapters applied per row, never merged into the base weights.

A stage holds every adapter's factors ``A`` (r, in) and ``B`` (out, r, the scaling folded in) for each
projection an adapter targets, in our fused layouts (built by :mod:`pipeline.loading.adapters`). Rows
of one micro-batch may use different adapters (index 0: the base model): a projection's output gets
``x @ A_k.T @ B_k.T`` added for each adapter ``k``'s rows, grouped by adapter, so a micro-batch costs
one base matmul plus two thin matmuls per adapter present.
"""

from __future__ import annotations

import torch

from pipeline.models.device import to_device

MODULES = ("attn.qkv", "attn.o", "mlp.up", "mlp.down")  # the projections an adapter may target


class StageAdapters:
    """Every adapter's factors for one stage's layers. ``factors[(local layer, module)][k - 1]`` is
    adapter ``k``'s ``(A, B)`` there, or None when that adapter leaves the projection alone."""

    def __init__(self, names: list[str], factors: dict[tuple[int, str], list[tuple[torch.Tensor, torch.Tensor] | None]]):
        self.names = names  # adapter k is names[k - 1]
        self.factors = factors

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for fs in self.factors.values() for f in fs if f for t in f)

    def rows(self, adapters: list[int] | None, device: torch.device,
             lens: list[int] | None = None) -> LoraRows | None:
        """What a segment whose rows use ``adapters`` (one index per row) needs; None: all base.
        ``lens``: the segment runs unpadded (row i's ``lens[i]`` real tokens, row after row), so the
        groups index tokens instead of rows."""
        if not adapters or not any(adapters):
            return None
        present = sorted(set(adapters) - {0})
        if len(present) == 1 and all(a == present[0] for a in adapters):
            return LoraRows(self, [(present[0], None)])  # every row the same adapter: no gather
        each = adapters if lens is None else [a for a, n in zip(adapters, lens) for _ in range(n)]
        groups = [(k, to_device([i for i, a in enumerate(each) if a == k], device, torch.long)) for k in present]
        return LoraRows(self, groups)


class LoraRows:
    """The adapter groups of one segment: (adapter index, its rows in the segment or None for all)."""

    def __init__(self, adapters: StageAdapters, groups: list[tuple[int, torch.Tensor | None]]):
        self.adapters, self.groups = adapters, groups

    def add(self, layer: int, module: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``y`` = base projection of ``x`` (b, t, in) -> (b, t, out), or of an unpadded segment's
        tokens (n, in) -> (n, out), plus each row's low-rank update."""
        per_adapter = self.adapters.factors.get((layer, module))
        if per_adapter is None:
            return y
        y2 = y.view(-1, y.shape[-1])  # y is the projection's fresh output: updated in place
        for k, idx in self.groups:
            f = per_adapter[k - 1]
            if f is None:
                continue
            a, b = f
            if idx is None:
                y2.addmm_(x.reshape(-1, x.shape[-1]) @ a.t(), b.t())
            else:
                xs = x.index_select(0, idx)  # (b_k, t, in)
                y.index_add_(0, idx, (xs @ a.t()) @ b.t())
        return y
