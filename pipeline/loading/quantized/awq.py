"""AWQ checkpoints in the GEMM layout (AutoAWQ, ``quant_method: awq``, ``version: gemm``), 4 bits.

Per linear ``X``: ``X.qweight`` int32 (in, out / 8), eight 4-bit codes per word packed along the
output dimension in AutoAWQ's interleaved order (code ``k`` of word ``c``, bits ``4k ..``, is output
column ``8c + [0, 2, 4, 6, 1, 3, 5, 7][k]``); ``X.qzeros`` int32 (groups, out / 8) packed the same
way; ``X.scales`` (groups, out) float16. ``W[o, i] = scales[g, o] * (q[i, o] - zero[g, o])`` with
``g = i // group_size``. Written from AutoAWQ's ``WQLinear_GEMM.from_linear`` and transformers'
AWQ integration. GEMV, Marlin, ExLlama and IPEX layouts are refused.
"""

from __future__ import annotations

import torch

from pipeline.loading.quantized.common import QuantFormat, UnsupportedQuantization, unpack_int32
from pipeline.models.kernels.weight_only import IntWeight

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # output column (within 8) of each nibble
_METADATA = {"quant_method", "bits", "w_bit", "group_size", "q_group_size", "zero_point", "version",
             "modules_to_not_convert", "backend", "do_fuse", "fuse_max_seq_len", "modules_to_fuse",
             "exllama_config", "quant_type"}


class AWQ(QuantFormat):
    def __init__(self, qc: dict):
        unknown = sorted(set(qc) - _METADATA)
        if unknown:
            raise UnsupportedQuantization(f"AWQ quantization_config keys this runner does not know: {unknown}")
        self.bits = int(qc.get("bits", qc.get("w_bit", 4)))
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise UnsupportedQuantization(f"AWQ version {version!r} (supported: gemm)")
        if self.bits != 4:
            raise UnsupportedQuantization(f"AWQ with {self.bits} bits (supported: 4)")
        if not qc.get("zero_point", True):
            raise UnsupportedQuantization("AWQ without zero points (zero_point: false)")
        if qc.get("do_fuse") or qc.get("modules_to_fuse"):
            raise UnsupportedQuantization("AWQ with fused modules (do_fuse / modules_to_fuse)")
        self.group_size = int(qc.get("group_size", qc.get("q_group_size", 128)))
        self.name = "awq-int4"

    def read(self, get, base: str, in_features: int, out_features: int) -> IntWeight:
        qweight, qzeros, scales = (get(n) for n in self.packed_names(base))
        group = in_features if self.group_size <= 0 else self.group_size
        return IntWeight(_unpack_awq(qweight).t().to(torch.uint8).contiguous(), scales.float().t().contiguous(),
                         _unpack_awq(qzeros).t().float().contiguous(), 4, group)


def _unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """(rows, cols / 8) int32 -> (rows, cols) codes in column order."""
    nibbles = unpack_int32(packed, 4, dim=1).reshape(packed.shape[0], -1, 8)  # (rows, words, nibble k)
    out = torch.empty_like(nibbles)
    out[:, :, AWQ_ORDER] = nibbles  # nibble k holds column AWQ_ORDER[k]
    return out.reshape(packed.shape[0], -1)
