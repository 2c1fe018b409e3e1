"""What the GPU paths rely on, checked on the CPU: parameters are allocated once, in the run's
dtype (never materialized in float32 and cast); the causal fast path of attention equals the
masked path; the head computes logprobs of bf16 runs from float32 logits."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from pipeline.loading import build_stage
from tests.utils import save_hf_model


class Allocations(TorchDispatchMode):
    """Every new CPU storage an operation returns: its bytes and dtype."""

    def __init__(self):
        super().__init__()
        self.storages: dict[int, tuple[int, torch.dtype]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.untyped_storage().data_ptr() not in inputs:
                self.storages.setdefault(t.untyped_storage().data_ptr(), (t.untyped_storage().nbytes(), t.dtype))
        return out


@pytest.fixture(scope="module")
def bf16_llama(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.utils import local_tokenizer

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(local_tokenizer()), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    return save_hf_model(LlamaForCausalLM(cfg).to(torch.bfloat16).eval(), tmp_path_factory.mktemp("bf16"))


@pytest.mark.parametrize("backend", ["native", "transformers"])
def test_parameters_are_allocated_once_in_the_run_dtype(bf16_llama, backend):
    with Allocations() as seen:
        model, _ = build_stage(bf16_llama, 0, 2, True, True, torch.bfloat16, "cpu", backend=backend)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    allocated = sum(n for n, _ in seen.storages.values())
    float32 = sum(n for n, dtype in seen.storages.values() if dtype == torch.float32)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    # the parameters once, the one-at-a-time temporaries of fused tensors (q/k/v, gate/up) and small
    # tables (rotary, at 32 positions); materializing in float32, then casting, allocates 3x params
    assert allocated < 2 * params, (allocated, params)
    assert float32 < 0.1 * params, (float32, params)
