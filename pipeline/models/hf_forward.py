"""What a HF ``*ForCausalLM`` forward does outside its decoder layers, read from its source: the
generic stage (:mod:`pipeline.models.hf_stage`) runs transformers' own layers, and :func:`forward_extras`
recognizes the multipliers around them (embedding scale, logit scaling, final soft-capping); any other
statement raises :class:`UnsupportedModel`, so a model either matches HF or does not load.
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass

from torch import nn


class UnsupportedModel(ValueError):
    """The model cannot run through the generic transformers stage; the message says why."""


@dataclass(frozen=True)
class ForwardExtras:
    """What the HF forwards do outside the decoder layers."""

    embed_scale: float | None = None  # inputs_embeds * scale (Granite's embedding_multiplier)
    logits_divide: float | None = None  # logits / x (Granite's logits_scaling)
    logits_multiply: float | None = None  # logits * x (Cohere's logit_scale)
    softcap: float | None = None  # tanh soft-capping of the logits (final_logit_softcapping)


_EMBED_SCALE = re.compile(r"^inputs_embeds = inputs_embeds \* self\.(\w+)$")
_LOGITS = re.compile(r"^logits = logits (\*|/) self\.(config\.)?(\w+)$")
_HARMLESS = re.compile(r"^(hidden_states|inputs_embeds) = (\w+\.)*(\w*dropout\w*)\(")


def _statements(fn) -> list[str]:
    """The code lines of a function, comments dropped, continuation lines joined (roughly)."""
    src = inspect.getsource(fn)
    out, depth = [], 0
    for raw in src.splitlines():
        line = raw.split("  #")[0].strip()
        if not line or line.startswith("#"):
            continue
        if depth > 0:
            out[-1] += " " + line
        else:
            out.append(line)
        depth += line.count("(") + line.count("[") - line.count(")") - line.count("]")
    return out


def forward_extras(full: nn.Module, base: nn.Module, config, norm: str = "norm",
                   embed: str = "embed_tokens") -> ForwardExtras:
    """Read the base model's and the CausalLM's forward for what they do besides embed -> layers ->
    norm -> lm_head; UnsupportedModel for anything not reproduced here."""
    kind = config.model_type
    embed_scale = logits_divide = logits_multiply = softcap = None
    before_layers, layer_var = True, "decoder_layer"
    for line in _statements(type(base).forward):
        if m := (re.match(r"^for (\w+) in self\.layers\b", line)
                 or re.match(r"^for \w+, (\w+) in enumerate\(self\.layers", line)):
            before_layers, layer_var = False, m.group(1)
            continue
        if not re.match(r"^(hidden_states|inputs_embeds) =", line):
            continue
        if (m := _EMBED_SCALE.match(line)) and before_layers:
            embed_scale = float(getattr(base, m.group(1)))
        elif _HARMLESS.match(line) or line in ("hidden_states = inputs_embeds",
                                               f"inputs_embeds = self.{embed}(input_ids)",
                                               f"hidden_states = self.{norm}(hidden_states)"):
            continue
        elif not before_layers and line.startswith(f"hidden_states = {layer_var}("):
            continue
        else:
            raise UnsupportedModel(f"{kind}: {type(base).__name__}.forward does `{line[:100]}` outside its decoder "
                                   "layers, which the generic stage does not reproduce")
    if before_layers:
        raise UnsupportedModel(f"{kind}: {type(base).__name__}.forward does not loop over self.layers")
    for line in _statements(type(full).forward):
        if not line.startswith("logits ="):
            continue
        if (m := _LOGITS.match(line)):
            raw = getattr(config if m.group(2) else full, m.group(3))
            if raw is None:  # under an `if ... is not None` (soft-capping switched off)
                continue
            value = float(raw)
            if m.group(1) == "/" and "softcap" in m.group(3):
                softcap = value
            elif m.group(1) == "/":
                logits_divide = value
            elif "softcap" not in m.group(3):
                logits_multiply = value
        elif line.startswith("logits = self.lm_head(") or line == "logits = torch.tanh(logits)":
            continue
        else:
            raise UnsupportedModel(f"{kind}: {type(full).__name__}.forward does `{line[:100]}` to the logits, "
                                   "which the generic stage does not reproduce")
    return ForwardExtras(embed_scale, logits_divide, logits_multiply, softcap)
