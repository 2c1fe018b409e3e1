"""SamplingParams: the request format's per-request fields as a Python object (OpenAI's and vLLM's names).

Every field left at ``None`` is not sent, so the request format's own default applies (the same
default a JSONL line without that field gets). Fields are validated by the request parser
(tasks.requests), exactly as in a file: a bad value gives that row an error object.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace


@dataclass
class StructuredOutputsParams:
    """vLLM's structured-output constraint (``vllm.sampling_params.StructuredOutputsParams``, formerly
    ``GuidedDecodingParams``): exactly one of a JSON schema (a dict, or its JSON text), a regex, a list
    of choices, a grammar (Lark or GBNF), or ``json_object=True``; the request's ``structured_outputs``."""

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_fallback: bool | None = None
    disable_any_whitespace: bool | None = None
    disable_additional_properties: bool | None = None
    whitespace_pattern: str | None = None

    def to_request(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None}


GuidedDecodingParams = StructuredOutputsParams  # vLLM's older name


@dataclass
class SamplingParams:
    """A request's sampling fields, under OpenAI's and vLLM's names (docs/usage/formats.md); ``extra``
    passes any other request field through untouched (e.g. ``response_format``, ``model`` for a LoRA
    adapter). vLLM's fields this runner does not implement (``prompt_logprobs``, ``bad_words``, ...) are
    taken here and sent on: at their default value they change nothing, otherwise the request is refused
    naming the field (or ignored under ``lenient_fields=True``), never silently dropped."""

    n: int | None = None
    best_of: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None  # vLLM's and transformers' (prompt + generated tokens; 1: off)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    max_tokens: int | None = None
    min_tokens: int | None = None
    logprobs: int | None = None  # top alternatives per token (0: the sampled token's logprob only)
    echo: bool | None = None
    logit_bias: dict[int, float] | None = None
    structured_outputs: StructuredOutputsParams | dict | None = None
    guided_decoding: StructuredOutputsParams | dict | None = None  # vLLM's older name for structured_outputs
    model: str | None = None  # a LoRA adapter's name (--lora NAME=PATH); None: the base model
    # reasoning models (docs/usage/reasoning.md): the thinking's token budget, or OpenAI's effort (a share of
    # max_tokens); chat only: variables for the chat template, e.g. {"enable_thinking": True}
    thinking_token_budget: int | None = None
    reasoning_effort: str | None = None
    chat_template_kwargs: dict | None = None
    # vLLM's fields without an implementation here: refused unless left at their default
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    detokenize: bool | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = None
    logits_processors: list | None = None
    extra: dict = field(default_factory=dict)
    extra_args: dict | None = None  # vLLM's: not read (no custom processors here); kept on the object

    def to_request(self, chat: bool = False) -> dict:
        """The request fields this object sets (chat: ``logprobs`` becomes ``logprobs: true`` + ``top_logprobs``)."""
        out = {k: getattr(self, k) for k in self.__dataclass_fields__ if getattr(self, k) is not None
               and k not in ("extra", "extra_args", "guided_decoding")}
        constraint = self.structured_outputs if self.structured_outputs is not None else self.guided_decoding
        if self.structured_outputs is not None and self.guided_decoding is not None:
            raise ValueError("SamplingParams: give structured_outputs or guided_decoding (its older name), not both")
        if constraint is not None:
            out["structured_outputs"] = constraint.to_request() if isinstance(constraint, StructuredOutputsParams) \
                else constraint
        if "logit_bias" in out:
            out["logit_bias"] = {str(k): v for k, v in out["logit_bias"].items()}
        out.pop("echo" if chat else "chat_template_kwargs", None)  # a chat never echoes; a completion has no template
        if chat and "logprobs" in out:
            out["logprobs"], out["top_logprobs"] = True, out.pop("logprobs")
        out.update(self.extra)
        return out

    def clone(self) -> SamplingParams:
        """A copy (vLLM's ``SamplingParams.clone``)."""
        return replace(self, extra=dict(self.extra))


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
