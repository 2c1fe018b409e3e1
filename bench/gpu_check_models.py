"""What ``bench/gpu_check.py`` builds on the spot and compares against: tiny random checkpoints of
the families it checks, a 1B-class Llama made on the device, an FP8 checkpoint, and the
HuggingFace transformers reference (greedy generation in a dtype; float32 log-probabilities of a
given continuation) with the rule that says when the runner agrees with it.

Self-contained (torch, transformers, safetensors and the project's local tokenizer): nothing from
tests/, whose helpers may need test-only packages that a GPU machine lacks.
"""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

# Dimensions per scale: "gpu" is still small (seconds to build and run) but wide enough for the GPU
# kernels' shape rules (head_dim 32: FlashAttention's multiple of 8; in-features multiples of 256:
# int4 tinygemm's tiles); "cpu" keeps the suite's end-to-end run fast.
SCALES = {"gpu": dict(hidden=256, layers=4, heads=8, kv_heads=4, intermediate=512),
          "cpu": dict(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128)}
FAMILIES = ("llama", "qwen3", "gemma3", "mixtral", "gpt2")
INIT_STD = 0.64  # x hidden^-1/2: wider than HF's 0.02 (at hidden 64: 0.08), so next-token distributions are not flat
WINDOW = 8  # Gemma 3's sliding layers: shorter than the longer prompts, so windows cut them


def family_config(family: str, scale: str, vocab: int, special: dict) -> "transformers.PretrainedConfig":  # noqa: F821
    """A transformers config of ``family`` at ``scale`` with the local tokenizer's vocabulary."""
    from transformers import AutoConfig

    d = SCALES[scale]
    head_dim = d["hidden"] // d["heads"]
    common = dict(vocab_size=vocab, initializer_range=INIT_STD / d["hidden"] ** 0.5, **special)
    if family == "gpt2":
        return AutoConfig.for_model("gpt2", n_embd=d["hidden"], n_layer=d["layers"], n_head=d["heads"],
                                    n_inner=d["intermediate"], n_positions=512, **common)
    attn = dict(hidden_size=d["hidden"], num_hidden_layers=d["layers"], num_attention_heads=d["heads"],
                num_key_value_heads=d["kv_heads"], intermediate_size=d["intermediate"], max_position_embeddings=512)
    kind = {"llama": ("llama", {}),
            "qwen3": ("qwen3", dict(head_dim=head_dim)),
            "gemma3": ("gemma3_text", dict(head_dim=head_dim, sliding_window=WINDOW, query_pre_attn_scalar=head_dim,
                                           layer_types=[("sliding_attention", "full_attention")[i % 2]
                                                        for i in range(d["layers"])])),
            "mixtral": ("mixtral", dict(num_local_experts=8, num_experts_per_tok=2, sliding_window=None))}
    model_type, extra = kind[family]
    return AutoConfig.for_model(model_type, **attn, **extra, **common)


def tiny_model(out: Path, family: str, scale: str, seed: int = 0) -> str:
    """A random ``family`` checkpoint (float32 safetensors, the local tokenizer) in ``out``. Biases and
    norm weights get noise (HF zero-inits biases, sets norms to 1) so their weight maps matter; MoE
    routers are scaled up so routing is decisive (HF's init routes near-uniformly)."""
    from transformers import AutoModelForCausalLM

    from pipeline.loading.default_model import build_tokenizer

    tok = build_tokenizer()
    special = dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    cfg = family_config(family, scale, len(tok), special)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "ln" in name or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            if name.endswith("mlp.gate.weight"):
                p.mul_(30)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return str(out)


# Llama-3.2-1B's shapes: 1.24 B parameters, 2.5 GB in bfloat16 (tied embeddings); "cpu": a toy of it
LLAMA_1B = {"gpu": dict(hidden=2048, layers=16, heads=32, kv_heads=8, intermediate=8192, vocab=128256),
            "cpu": dict(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, vocab=1024)}


@torch.no_grad()
def llama_1b(out: Path, scale: str, device: torch.device, dtype: torch.dtype = torch.bfloat16) -> tuple[str, int]:
    """A random Llama of :data:`LLAMA_1B`'s shape at ``scale``: weights drawn on ``device`` (seconds on
    a GPU), saved as one safetensors file in ``dtype`` with the local tokenizer (ids past its 1024
    tokens decode to nothing, which generation does not mind). Returns (folder, bytes of weights)."""
    from safetensors.torch import save_file

    from pipeline.loading.default_model import build_tokenizer

    d = LLAMA_1B[scale]
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer()
    tok.save_pretrained(out)
    h, kv = d["hidden"], d["kv_heads"] * d["hidden"] // d["heads"]
    gen = torch.Generator(device=device).manual_seed(0)

    def rand(*shape):
        return (torch.randn(shape, generator=gen, device=device, dtype=torch.float32) * 0.02).to(dtype).cpu()

    sd = {"model.embed_tokens.weight": rand(d["vocab"], h), "model.norm.weight": torch.ones(h, dtype=dtype)}
    for i in range(d["layers"]):
        p = f"model.layers.{i}."
        sd.update({p + "input_layernorm.weight": torch.ones(h, dtype=dtype),
                   p + "post_attention_layernorm.weight": torch.ones(h, dtype=dtype),
                   p + "self_attn.q_proj.weight": rand(h, h), p + "self_attn.k_proj.weight": rand(kv, h),
                   p + "self_attn.v_proj.weight": rand(kv, h), p + "self_attn.o_proj.weight": rand(h, h),
                   p + "mlp.gate_proj.weight": rand(d["intermediate"], h),
                   p + "mlp.up_proj.weight": rand(d["intermediate"], h),
                   p + "mlp.down_proj.weight": rand(h, d["intermediate"])})
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": h,
           "intermediate_size": d["intermediate"], "num_hidden_layers": d["layers"],
           "num_attention_heads": d["heads"], "num_key_value_heads": d["kv_heads"], "vocab_size": d["vocab"],
           "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
           "torch_dtype": str(dtype).removeprefix("torch."), "tie_word_embeddings": True, "hidden_act": "silu",
           "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id}
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    return str(out), sum(t.numel() * t.element_size() for t in sd.values())


# -- quantized checkpoints ----------------------------------------------------------------------------
PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FP8_MAX = 448.0  # float8_e4m3fn's largest value
# compressed-tensors' FP8_DYNAMIC preset as llm-compressor writes it: per-channel FP8 weights, FP8
# activations quantized per token at run time (the form vLLM and the runner run with torch._scaled_mm)
FP8_CONFIG = {
    "quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
    "ignore": ["lm_head"],
    "config_groups": {"group_0": {
        "targets": ["Linear"],
        "weights": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel", "dynamic": False},
        "input_activations": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token",
                              "dynamic": True}}}}


def _projections(sd: dict) -> list[str]:
    return [k.removesuffix(".weight") for k in sd if k.endswith(".weight") and k.split(".")[-2] in PROJ]


def fp8_checkpoint(model_dir: str, out: Path, ref: Path) -> tuple[str, str]:
    """``model_dir``'s projections as compressed-tensors FP8 (:data:`FP8_CONFIG`: ``W = q * s``, one
    scale per output row, ``s = max|w_row| / 448``) in ``out``, and in ``ref`` a float checkpoint of
    the dequantized weights (what transformers runs as the reference, with :func:`fp8_activation_hooks`)."""
    from safetensors.torch import load_file, save_file

    src = Path(model_dir)
    sd = {k: v for f in sorted(src.glob("*.safetensors")) for k, v in load_file(str(f)).items()}
    packed, deq = dict(sd), dict(sd)
    for base in _projections(sd):
        w = sd[base + ".weight"].float()
        scale = w.abs().amax(1, keepdim=True).clamp(min=1e-12) / FP8_MAX  # (out, 1)
        q = (w / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        packed[base + ".weight"], packed[base + ".weight_scale"] = q, scale
        deq[base + ".weight"] = (q.float() * scale).to(sd[base + ".weight"].dtype)
    for folder, tensors, qc in ((out, packed, FP8_CONFIG), (ref, deq, None)):
        folder.mkdir(parents=True, exist_ok=True)
        for f in src.iterdir():
            if f.is_file() and not f.name.endswith((".safetensors", ".safetensors.index.json")):
                shutil.copy2(f, folder / f.name)
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"),
                  metadata={"format": "pt"})
        if qc is not None:
            cfg = json.loads((folder / "config.json").read_text())
            (folder / "config.json").write_text(json.dumps({**cfg, "quantization_config": qc}, indent=1))
    return str(out), str(ref)


def fp8_activation_hooks(model) -> None:
    """Quantize each projection's input as :data:`FP8_CONFIG` says (per token, ``scale = max|x| / 448``,
    rounded by the cast to float8_e4m3fn) before the product: the checkpoint's activations, in float32."""
    def hook(_module, inputs):
        x = inputs[0]
        flat = x.reshape(-1, x.shape[-1]).float()
        scale = (flat.abs().amax(1, keepdim=True) / FP8_MAX).clamp(min=torch.finfo(torch.float32).eps)
        q = (flat / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float() * scale
        return (q.to(x.dtype).reshape(x.shape),)

    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear) and name.split(".")[-1] in PROJ:
            m.register_forward_pre_hook(hook)


def int8_reference(model_dir: str, ref: Path) -> str:
    """``--quantize int8``'s weights as a float checkpoint: each projection's rows rounded to int8 steps
    of ``max|w_row| / 127`` (the runner's quantizer), for transformers to run as the reference."""
    from safetensors.torch import load_file, save_file

    src = Path(model_dir)
    sd = {k: v for f in sorted(src.glob("*.safetensors")) for k, v in load_file(str(f)).items()}
    for base in _projections(sd):
        w = sd[base + ".weight"].float()
        scale = w.abs().amax(1, keepdim=True).clamp(min=1e-12) / 127
        sd[base + ".weight"] = (torch.round(w / scale).clamp(-127, 127) * scale).to(sd[base + ".weight"].dtype)
    ref.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith((".safetensors", ".safetensors.index.json")):
            shutil.copy2(f, ref / f.name)
    save_file({k: v.contiguous() for k, v in sd.items()}, str(ref / "model.safetensors"), metadata={"format": "pt"})
    return str(ref)


# -- the reference ----------------------------------------------------------------------------------
class Reference:
    """transformers on ``device``: greedy generation in a dtype, and the float32 model's log-probabilities
    of a given continuation (teacher forcing). ``hooks(model)`` is applied to every model loaded (e.g.
    :func:`fp8_activation_hooks`)."""

    def __init__(self, model_dir: str, device: torch.device, hooks=None):
        self.model_dir, self.device, self.hooks = model_dir, device, hooks
        self.models: dict[torch.dtype, torch.nn.Module] = {}
        self.eos = json.loads((Path(model_dir) / "config.json").read_text()).get("eos_token_id")

    def model(self, dtype: torch.dtype):
        if dtype not in self.models:
            from transformers import AutoModelForCausalLM

            m = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=dtype).to(self.device).eval()
            if self.hooks is not None:
                self.hooks(m)
            self.models[dtype] = m
        return self.models[dtype]

    @torch.inference_mode()
    def greedy(self, prompt: list[int], steps: int, dtype: torch.dtype) -> tuple[list[int], list[float]]:
        """``steps`` greedy tokens of ``prompt`` alone (no padding), ending early at EOS (kept, as the
        last token), and each one's log-probability (float32 log-softmax of the dtype's logits)."""
        m = self.model(dtype)
        ids = torch.tensor([prompt], device=self.device)
        out = m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=steps, do_sample=False,
                         output_logits=True, return_dict_in_generate=True, eos_token_id=self.eos,
                         pad_token_id=m.config.pad_token_id or 0)
        toks = out.sequences[0, len(prompt):].tolist()[: len(out.logits)]
        lps = [float(torch.log_softmax(lg[0].float(), -1)[t]) for lg, t in zip(out.logits, toks)]
        if self.eos in toks:
            n = toks.index(self.eos) + 1
            toks, lps = toks[:n], lps[:n]
        return toks, lps

    @torch.inference_mode()
    def logprobs(self, prompt: list[int], tokens: list[int]) -> torch.Tensor:
        """(len(tokens), vocab) float32 log-probabilities the float32 model gives each next token of
        ``prompt + tokens`` (row i: the distribution ``tokens[i]`` was drawn from)."""
        ids = torch.tensor([prompt + tokens], device=self.device)
        logits = self.model(torch.float32)(ids).logits[0, len(prompt) - 1 : len(prompt) - 1 + len(tokens)]
        return torch.log_softmax(logits.float(), -1).cpu()

    def close(self) -> None:
        self.models.clear()


# How close counts as agreeing (see verdict()): the runner's mean |logprob error| against the float32
# model may be MEAN_FACTOR x transformers' own in the same dtype (plus MEAN_FLOOR), its largest
# MAX_FACTOR x transformers' largest (plus MAX_FLOOR, nats)
MEAN_FACTOR, MEAN_FLOOR, MAX_FACTOR, MAX_FLOOR = 1.5, 0.002, 3.0, 0.01


@dataclass
class Sample:
    """One prompt's greedy result from the runner against the reference's in the same dtype."""

    runner_errors: list[float]  # |runner logprob - float32 logprob| per runner token
    reference_errors: list[float]  # the same for the reference's own tokens (the yardstick)
    diverged_at: int | None  # the first step where the tokens differ (None: equal)
    tie_gap: float | None  # there: |float32 logprob of one choice - the other's|, nats


def compare(ref: Reference, prompt: list[int], ours: tuple, theirs: tuple) -> Sample:
    """The runner's greedy result ``ours`` against ``theirs`` (the reference's, or another runner
    layout's), each (tokens, logprobs) or (tokens, logprobs, ended at EOS: the runner returns no EOS
    token, transformers keeps it), both measured against the float32 model's log-probabilities of
    their own tokens (teacher forcing)."""
    (toks, lps), (other_toks, other_lps) = _with_eos(ours, ref.eos), _with_eos(theirs, ref.eos)
    mine, other = ref.logprobs(prompt, toks), ref.logprobs(prompt, other_toks)
    runner = [abs(lp - float(mine[i, t])) for i, (t, lp) in enumerate(zip(toks, lps))]
    reference = [abs(lp - float(other[i, t])) for i, (t, lp) in enumerate(zip(other_toks, other_lps))]
    d = next((i for i, (a, b) in enumerate(zip(toks, other_toks)) if a != b), None)
    if d is None and len(toks) != len(other_toks):
        d = min(len(toks), len(other_toks))  # cannot happen with EOS kept on both sides; a mismatch all the same
    gap = None
    if d is not None and d < min(len(toks), len(other_toks)):
        gap = abs(float(mine[d, toks[d]]) - float(mine[d, other_toks[d]]))
    return Sample(runner, reference, d, gap)


def _with_eos(result: tuple, eos: int | None) -> tuple[list[int], list[float]]:
    """(tokens, logprobs) with EOS as the last token when the result ended there without returning it."""
    toks, lps = list(result[0]), list(result[1])
    if len(result) > 2 and result[2] and eos is not None and (not toks or toks[-1] != eos):
        toks.append(eos)
    return toks, lps


def verdict(samples: list[Sample], factor: float = 1.0) -> dict:
    """Whether the runner agrees with transformers over ``samples`` (one case: a model in a dtype), with
    the figures. The runner's logprobs must be as faithful to the float32 model as transformers' own in
    the same dtype: mean |error| within MEAN_FACTOR x transformers' (+ MEAN_FLOOR), the largest within
    MAX_FACTOR x transformers' largest (+ MAX_FLOOR: outliers come from discontinuities, e.g. a MoE
    router's near-tie sending a token to another expert in one of the two). Greedy tokens must be equal,
    or differ first at a near-tie: the two choices' float32 logprobs within the largest error allowed
    (a rounding that size can swap them; later tokens are not comparable). ``factor`` widens both
    bounds (quantized paths whose kernels round activations the reference does not)."""
    mine = [e for s in samples for e in s.runner_errors]
    theirs = [e for s in samples for e in s.reference_errors]
    mean = sum(mine) / max(1, len(mine))
    ref_mean = sum(theirs) / max(1, len(theirs))
    mean_tol = factor * (MEAN_FACTOR * ref_mean + MEAN_FLOOR)
    top, ref_top = max(mine, default=0.0), max(theirs, default=0.0)
    max_tol = factor * (MAX_FACTOR * ref_top + MAX_FLOOR)
    splits = [(i, s.diverged_at, s.tie_gap) for i, s in enumerate(samples) if s.diverged_at is not None]
    ties_ok = all(gap is not None and gap <= max_tol for _, _, gap in splits)
    ok = mean <= mean_tol and top <= max_tol and ties_ok and not any(map(math.isnan, mine))
    r = lambda x: round(x, 5)  # noqa: E731
    return {"ok": ok, "prompts": len(samples), "tokens": len(mine), "equal_prompts": len(samples) - len(splits),
            "divergences": [{"prompt": i, "step": d, "tie_gap": None if g is None else r(g)} for i, d, g in splits],
            "mean_error": r(mean), "reference_mean_error": r(ref_mean), "mean_tolerance": r(mean_tol),
            "max_error": r(top), "reference_max_error": r(ref_top), "max_tolerance": r(max_tol)}
