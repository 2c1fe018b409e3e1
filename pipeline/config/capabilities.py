"""Which feature runs with which model family, backend, device and other features: one table, one check.

Each feature that changes what a stage computes says what it needs (:class:`Needs`): a native family, a
device, the features it does not run with. :func:`refusals` reads the table, once from the flags alone
(pipeline.config.options) and again once the plan knows the model, its format and the device
(pipeline.config.plan). Each refusal says what to drop.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Needs:
    native: str | None = None  # what the generic transformers stage lacks for it (None: it runs there)
    device: str | None = None  # the only device type it runs on, and why
    not_with: tuple[tuple[str, str], ...] = ()  # (a feature it does not run with, why)


# A feature is its flag; "checkpoint" is a pre-quantized checkpoint (GPTQ, AWQ, compressed-tensors).
TABLE: dict[str, Needs] = {
    "--batch-invariant": Needs(
        native="there are no fixed-shape kernels",
        not_with=(("--lora", "does not apply LoRA adapters: its fixed-shape kernels have no per-row adapter path"),
                  ("--quantize", "has no fixed-shape int8 kernels"),
                  ("checkpoint", "has no fixed-shape kernels for packed weights"))),
    "--quantize": Needs(
        native="the layers are not quantized",
        not_with=(("--lora", "does not apply LoRA adapters: they wrap float projections"),
                  ("checkpoint", "applies to float weights: the checkpoint is quantized already"))),
    "--kv-cache-dtype": Needs(
        native="the cache is transformers' own",
        device="cpu: its decode attention is the native CPU kernel; a GPU would dequantize the cache every step"),
    "--lora": Needs(native="adapters are not applied"),
    "checkpoint": Needs(native="packed weights do not load"),
}


def enabled(opts, checkpoint: str | None = None) -> dict[str, str]:
    """The table's features these options (and a checkpoint's format) turn on -> how each is named."""
    named = {"--batch-invariant": "--batch-invariant" if opts.batch_invariant else None,
             "--quantize": f"--quantize {opts.quantize}" if opts.quantize != "none" else None,
             "--kv-cache-dtype": f"--kv-cache-dtype {opts.kv_cache_dtype}" if opts.kv_cache_dtype != "auto" else None,
             "--lora": "--lora" if opts.lora else None,
             "checkpoint": f"a {checkpoint} checkpoint" if checkpoint else None}
    return {f: name for f, name in named.items() if name}


def refusals(opts, generic: str | None = None, device: str | None = None, checkpoint: str | None = None) -> list[str]:
    """What cannot run, one message each saying what to drop. ``generic``: what runs on transformers' own
    layers (a family, or ``--backend transformers``; None: a native family, or not known yet); ``device``:
    the stages' device type (None: not known yet); ``checkpoint``: a pre-quantized checkpoint's format."""
    on = enabled(opts, checkpoint)
    out = []
    for f, name in on.items():
        needs = TABLE[f]
        drop = "use a float checkpoint" if f == "checkpoint" else f"drop {f}"
        if needs.native and generic:
            out.append(f"{name} needs a native family; {generic} runs on transformers' own layers, where "
                       f"{needs.native}: {drop}")
        if needs.device and device is not None and device != needs.device.split(":")[0]:
            kind, why = needs.device.split(": ", 1)
            out.append(f"{name} runs on {kind.upper()} stages only ({why}): {drop}")
        for other, why in needs.not_with:
            if other in on:
                fix = "drop --quantize" if f == "--quantize" and other == "checkpoint" else f"drop {f} or {other}" \
                    if other != "checkpoint" else f"drop {f}"
                out.append(f"{name} {why}: {fix}")
    return out
