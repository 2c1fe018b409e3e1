"""SamplingParams: the request format's per-request fields as a Python object.

Every field left at ``None`` is not sent, so the request format's own default applies (the same
default a JSONL line without that field gets). Fields are validated by the request parser
(tasks.requests), exactly as in a file: a bad value gives that row an error object.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class SamplingParams:
    """OpenAI completion parameters (see docs/usage/formats.md); ``extra`` passes any other request
    field through untouched (e.g. ``response_format`` for structured outputs, ``model`` for a LoRA adapter)."""

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    n: int | None = None
    best_of: int | None = None
    logprobs: int | None = None  # top alternatives per token (0: the sampled token's logprob only)
    echo: bool | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[int, float] | None = None
    model: str | None = None  # a LoRA adapter's name (--lora NAME=PATH); None: the base model
    # reasoning models (docs/usage/reasoning.md): the thinking's token budget, or OpenAI's effort (a share of
    # max_tokens); chat only: variables for the chat template, e.g. {"enable_thinking": True}
    thinking_token_budget: int | None = None
    reasoning_effort: str | None = None
    chat_template_kwargs: dict | None = None
    extra: dict = field(default_factory=dict)

    def to_request(self, chat: bool = False) -> dict:
        """The request fields this object sets (chat: ``logprobs`` becomes ``logprobs: true`` + ``top_logprobs``)."""
        out = {k: v for k, v in asdict(self).items() if v is not None and k != "extra"}
        if "logit_bias" in out:
            out["logit_bias"] = {str(k): v for k, v in out["logit_bias"].items()}
        if chat:
            out.pop("echo", None)  # a chat completion never echoes its prompt
        else:
            out.pop("chat_template_kwargs", None)  # a completion has no template
        if chat and "logprobs" in out:
            top = out.pop("logprobs")
            out["logprobs"] = True
            out["top_logprobs"] = top
        out.update(self.extra)
        return out


def params_for(params: SamplingParams | dict | list | None, count: int) -> list[SamplingParams | dict | None]:
    """One parameter object per prompt: ``params`` alone for all, or a list of ``count``."""
    if isinstance(params, (list, tuple)):
        if len(params) != count:
            raise ValueError(f"{len(params)} SamplingParams for {count} prompts: pass one for all, or one per prompt")
        return list(params)
    return [params] * count


def fields_of(params: SamplingParams | dict | None, chat: bool = False) -> dict:
    """Request fields from a SamplingParams or a plain dict of request fields."""
    if params is None:
        return {}
    if isinstance(params, SamplingParams):
        return params.to_request(chat)
    if isinstance(params, dict):
        return dict(params)
    raise TypeError(f"params must be SamplingParams, a dict of request fields or a list of them, got {type(params).__name__}")
