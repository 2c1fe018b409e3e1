"""GPTQ checkpoints (AutoGPTQ / GPTQModel / optimum, ``quant_method: gptq``), 4 and 8 bits.

Per linear ``X``: ``X.qweight`` int32 (in * bits / 32, out), ``32 / bits`` codes per word packed
along the input dimension, code ``k`` of a word in bits ``k * bits ..``; ``X.qzeros`` int32
(groups, out * bits / 32) packed the same way along the output dimension; ``X.scales`` (groups, out)
float16; ``X.g_idx`` int32 (in,) the group of every input column (``desc_act`` checkpoints order it by
activation size; otherwise ``i // group_size``). ``W[o, i] = scales[g, o] * (q[i, o] - zero[g, o])``
with ``g = g_idx[i]``; the ``gptq`` (v1) checkpoint format stores ``zero - 1`` (AutoGPTQ's packer;
``gptq_v2`` stores the zero itself). Symmetric checkpoints store ``2^(bits-1) - 1`` (v1).
Written from AutoGPTQ's ``QuantLinear.pack`` and GPTQModel's ``dequantize_weight``.
"""

from __future__ import annotations

import torch

from pipeline.loading.quantized.common import QuantFormat, UnsupportedQuantization, unpack_int32
from pipeline.models.kernels.weight_only import IntWeight

# keys that do not change how the tensors are read (metadata, how the quantizer ran)
_METADATA = {"quant_method", "damp_percent", "damp_auto_increment", "true_sequential", "static_groups",
             "model_name_or_path", "model_file_base_name", "quantizer", "meta", "dataset", "tokenizer",
             "use_cuda_fp16", "use_exllama", "exllama_config", "max_input_length", "cache_block_outputs",
             "batch_size", "pad_token_id", "module_name_preceding_first_block", "block_name_to_quantize",
             "backend", "disable_exllama", "mse", "v2", "v2_alpha", "act_group_aware", "hyb_act",
             "modules_in_block_to_quantize", "use_marlin", "is_marlin_format", "format", "rotation", "pack_impl",
             "sym", "desc_act", "bits", "group_size", "checkpoint_format", "lm_head", "pack_dtype", "modules_to_not_convert"}


class GPTQ(QuantFormat):
    def __init__(self, qc: dict):
        unknown = sorted(set(qc) - _METADATA)
        if unknown:
            raise UnsupportedQuantization(f"GPTQ quantization_config keys this runner does not know: {unknown}")
        self.bits = int(qc.get("bits", 4))
        if self.bits not in (4, 8):
            raise UnsupportedQuantization(f"GPTQ with {self.bits} bits (supported: 4 and 8)")
        fmt = str(qc.get("checkpoint_format") or qc.get("format") or "gptq").lower()
        if fmt not in ("gptq", "gptq_v2"):
            raise UnsupportedQuantization(f"GPTQ checkpoint_format {fmt!r} (supported: gptq, gptq_v2)")
        if qc.get("lm_head"):
            raise UnsupportedQuantization("GPTQ with a quantized lm_head (lm_head: true)")
        if str(qc.get("pack_dtype", "int32")).removeprefix("torch.") != "int32":
            raise UnsupportedQuantization(f"GPTQ pack_dtype {qc['pack_dtype']!r} (supported: int32)")
        self.v1 = fmt == "gptq"
        self.group_size = int(qc.get("group_size", 128))
        self.name = f"gptq-int{self.bits}"

    def read(self, get, base: str, in_features: int, out_features: int) -> IntWeight:
        qweight, qzeros, scales = (get(n) for n in self.packed_names(base))
        codes = unpack_int32(qweight, self.bits, dim=0)[:in_features].t()  # (out, in)
        zeros = unpack_int32(qzeros, self.bits, dim=1)[:, :out_features].t().float()  # (out, groups)
        if self.v1:  # AutoGPTQ stored zero - 1; its kernels and GPTQModel's v1 -> v2 conversion add the 1 back
            zeros = zeros + 1
        g_idx = get(f"{base}.g_idx", optional=True)
        group = in_features if self.group_size <= 0 else self.group_size
        if g_idx is not None and torch.equal(g_idx.long(), torch.arange(in_features) // group):
            g_idx = None  # the trivial order (what every non-act-order checkpoint stores)
        return IntWeight(codes.to(torch.uint8).contiguous(), scales.float().t().contiguous(), zeros.contiguous(),
                         self.bits, group, None if g_idx is None else g_idx.to(torch.int32))
