"""``--backend``: native code for a model family, or transformers' own layers (the generic stage,
:mod:`pipeline.models.hf_stage`). ``auto`` takes the native family when there is one and it reads the
config (a variant it lacks falls back), ``native`` refuses a model without native code, ``transformers``
forces the generic stage. Everything but the stage model is the same for both.
"""

from __future__ import annotations

from pipeline.models.hf_stage import ModelShape, model_shape
from pipeline.models.spec import DecoderSpec
from pipeline.models.families import family_for, supported_model_types

BACKENDS = ("auto", "native", "transformers")  # --backend: native family code, or transformers' own layers


def native_family(cfg: dict, model_type: str | None = None):
    """The native family module for a config, or None."""
    try:
        return family_for(cfg, model_type)
    except ValueError as e:
        if "unsupported model type" in str(e):
            return None
        raise


def choose_backend(cfg: dict, model_type: str | None = None, backend: str = "auto") -> str:
    """'native' or 'transformers' for this model; ValueError (a usage error) when ``backend`` cannot run it."""
    if backend == "transformers":
        return "transformers"
    family = native_family(cfg, model_type)
    if family is not None:
        try:
            family.to_spec(cfg)
            return "native"
        except ValueError:  # a variant the native code lacks (e.g. a rope scaling): transformers has it
            if backend == "native":
                raise
            return "transformers"
    if backend == "native":
        wanted = model_type or cfg.get("model_type")
        raise ValueError(f"--backend native: model type {wanted!r} has no native code (native: "
                         f"{', '.join(supported_model_types())}); use --backend auto to run it with "
                         "transformers' own layers")
    return "transformers"


def stage_shape(cfg: dict, model_type: str | None = None, backend: str = "auto") -> DecoderSpec | ModelShape:
    """Layers, vocabulary and context length of the model, from whichever backend runs it.

    Raises ValueError (UnsupportedModel included) for a model the backend cannot run."""
    if choose_backend(cfg, model_type, backend) == "native":
        return native_family(cfg, model_type).to_spec(cfg)
    return model_shape(cfg, model_type)

