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
        if value is None or value is False:
            continue
        if value is True:
            argv.append(flag)
        elif key == "lora":  # {"name": path} or ["name=path", ...]
            pairs = [f"{k}={v}" for k, v in value.items()] if isinstance(value, dict) else [str(v) for v in value]
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
        lines = [x for x in err.getvalue().splitlines() if x.strip()]
        message = lines[-1].split("error: ", 1)[-1] if lines else "invalid options"
        raise UsageError(message) from None
