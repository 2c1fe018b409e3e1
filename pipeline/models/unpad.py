"""Prefill without padding: the new prompts of a pass are right-padded to the longest for
attention's (b, t) layout, but a layer's projections and MLP run on the real tokens only.

Prompts of different lengths share a prefill: a pass of prompts of 9..241 tokens is about half
padding, which every projection and MLP would otherwise compute. Attention: fresh prompts under
plain causal attention go row by row over each prompt's own length, as views of the real tokens
(``Attention._prompt_rows``: causal attention costs a row its length squared, so the padded batch
paid ~2.5x); layers with a mask (sliding windows, ALiBi, soft-capping) and prompts resuming after a
cached prefix scatter into the padded (b, t) layout.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..upload import to_device

if TYPE_CHECKING:
    from .decoder import Segment

UNPAD_ABOVE = 0.9  # a prefill with more real tokens than this share of b * t keeps its padding


def real_tokens(seg: "Segment") -> torch.Tensor | None:
    """Flat indices (into b * t) of a prefill segment's real tokens, or None when there is no right
    padding worth skipping."""
    if not seg.prefill or seg.lens is None or seg.t == 1:
        return None
    b, t = len(seg.lens), seg.t
    if sum(seg.lens) > UNPAD_ABOVE * b * t:
        return None
    lens = torch.tensor(seg.lens)
    flat = (torch.arange(t)[None, :] < lens[:, None]).flatten().nonzero().squeeze(1)
    return to_device(flat, seg.rows.device)
