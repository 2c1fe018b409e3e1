"""The runner's flags as keyword arguments: ``LLM(model, pipeline_size=2, budget=4096, lora={"a": path})``
becomes the argv the runner parses (pipeline.config.options), so every check, default and message is
the command line's, and the worker processes get the very same flags."""

from __future__ import annotations

import contextlib
import dataclasses
import io

from pipeline.config.options import RunOptions, UsageError, parse_options

# flags that belong to the API itself, or to a mode the API is not
NOT_KWARGS = {
    "infer_data": "pass prompts to generate(), or a file to generate_file()",
    "output_path": "generate_file(input, output) takes the output path",
    "job_name": "pass prompts to generate(), or a file to generate_file()",
    "serve": "the API is its own front end; run the runner with --serve for HTTP",
    "rank": "LLM starts its ranks itself (pipeline_size=P), or joins torchrun's",
    "world_size": "use pipeline_size=P",
    "pipeline_group_size": "use pipeline_size=P",
    "dist_url": "LLM picks a loopback rendezvous itself",
    "cuda_id": "each worker takes the GPU of its rank",
    "config": "pass the options as keyword arguments",
}
FIELDS = {f.name: f for f in dataclasses.fields(RunOptions)}

# vLLM's LLM(...) engine arguments (docs/usage/from-vllm.md): those that are a runner flag under another name
# or in another form, those that only tune vLLM's own engine (speed and memory; no answer changes), and
# those accepted at one value. Any other keyword is refused by to_argv, naming it.
VLLM_DTYPES = {"auto": "auto", "half": "float16", "float16": "float16", "bfloat16": "bfloat16", "float": "float32",
               "float32": "float32"}
VLLM_TUNING = frozenset({
    "gpu_memory_utilization", "enforce_eager", "swap_space", "cpu_offload_gb", "disable_log_stats",
    "max_num_seqs", "max_num_batched_tokens", "max_seq_len_to_capture", "block_size", "enable_chunked_prefill",
    "compilation_config", "disable_custom_all_reduce", "distributed_executor_backend", "disable_async_output_proc",
    "use_v2_block_manager", "num_scheduler_steps", "hf_token", "worker_cls",
})
VLLM_ONLY_AT = {"tensor_parallel_size": (1,), "quantization": (None,), "load_format": ("auto", "safetensors"),
                "tokenizer_mode": ("auto",), "skip_tokenizer_init": (False,), "max_model_len": (None,)}


def from_vllm(model: str | None, kwargs: dict) -> tuple[dict, list[str]]:
    """vLLM's engine arguments among ``kwargs`` as the runner's flags: (flags, the tuning arguments left
    aside). A vLLM argument that would change the answer and has no equivalent raises TypeError."""
    flags, aside = {}, []
    for key, value in kwargs.items():
        if key in VLLM_TUNING:
            aside.append(key)
        elif key in VLLM_ONLY_AT:
            if value not in VLLM_ONLY_AT[key]:
                hint = {"tensor_parallel_size": "this runner splits a model by layers: use pipeline_parallel_size",
                        "max_model_len": "the model's own context window applies (longer prompts are each refused; "
                                         "truncate_prompts=True cuts them)"}.get(key, "leave it out")
                raise TypeError(f"LLM() does not take {key}={value!r}: {hint}")
        elif key == "dtype" and not isinstance(value, str) and value is not None:  # a torch.dtype
            flags["dtype"] = VLLM_DTYPES.get(str(value).removeprefix("torch."), str(value))
        elif key == "dtype":
            flags["dtype"] = VLLM_DTYPES.get(value, value)
        elif key == "enable_prefix_caching":
            flags["prefix_cache"] = "on" if value else "off"
        elif key == "download_dir":
            flags["cache_dir"] = value
        elif key == "tokenizer":
            if value is not None and value != model:
                raise TypeError("LLM() does not take a separate tokenizer: the model folder's tokenizer is used")
        else:
            flags[key] = value
    return flags, aside


def to_argv(model: str | None, kwargs: dict) -> list[str]:
    """Runner flags for ``model`` and ``kwargs`` (``None``/``False`` values are left out)."""
    argv = [] if model is None else ["--model-name", str(model)]
    for key, value in kwargs.items():
        if key in NOT_KWARGS:
            raise TypeError(f"LLM() does not take {key!r}: {NOT_KWARGS[key]}")
        f = FIELDS.get(key)
        if f is None:
            raise TypeError(f"LLM() got an unexpected keyword argument {key!r}: it takes the runner's flags "
                            "(docs/usage/flags.md) with underscores, e.g. budget=4096, prefix_cache='off'")
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool) and f.type != "bool":  # prefix_cache=False would be dropped: the cache stays on
            raise TypeError(f"LLM() got {key}={value!r}, but {flag} takes a value, not a switch: e.g. "
                            f"{key}={f.default!r} (docs/usage/flags.md)")
        if value is None or value is False:
            continue
        if value is True:
            argv.append(flag)
        elif key == "lora":  # {"name": path}, ["name=path", ...] or one "name=path"
            pairs = [f"{k}={v}" for k, v in value.items()] if isinstance(value, dict) else \
                [value] if isinstance(value, str) else [str(v) for v in value]
            for pair in pairs:
                argv += [flag, pair]
        elif isinstance(value, (list, tuple)):
            argv += [flag, *(str(v) for v in value)]
        else:
            argv += [flag, str(value)]
    return argv


def parse(argv: list[str]) -> RunOptions:
    """RunOptions from flags; a flag that cannot work raises ValueError with the runner's message."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return parse_options(argv)
    except SystemExit:
        lines = [x for x in err.getvalue().splitlines() if "error: " in x]
        message = lines[-1].split("error: ", 1)[-1] if lines else "invalid options"
        raise UsageError(message) from None
