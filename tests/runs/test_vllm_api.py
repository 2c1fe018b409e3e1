"""vLLM's Python API shapes on the runner (issue 58), every stage in this process: a vLLM offline-inference
script in the style of vLLM's quickstart runs with only its import line changed; LLM(model=...,
pipeline_parallel_size=...), generate(prompts, sampling_params) with strings, token ids and
{"prompt_token_ids": ...}, results read as RequestOutput / CompletionOutput (prompt, prompt_token_ids,
outputs[i].text / token_ids / logprobs / finish_reason), chat(messages, sampling_params), get_tokenizer(),
use_tqdm; vLLM's fields without an implementation are refused by name, never dropped."""

from __future__ import annotations

import contextlib
import io
import logging

import pytest

from dist_inference_runner import LLM, SamplingParams, StructuredOutputsParams
from tests.utils import REPO

DEFAULT_MODEL = str(REPO / "examples" / "tiny-llama-default")

# vLLM's quickstart (docs/getting_started/quickstart.md, "Offline Batched Inference") with its import line
# changed, and its model: the embedded default model stands in for facebook/opt-125m (no downloads here)
QUICKSTART = f'''
from dist_inference_runner import LLM, SamplingParams

prompts = [
    "Hello, my name is",
    "The president of the United States is",
    "The capital of France is",
    "The future of AI is",
]
sampling_params = SamplingParams(temperature=0.8, top_p=0.95)

llm = LLM(model={DEFAULT_MODEL!r})

outputs = llm.generate(prompts, sampling_params)

for output in outputs:
    prompt = output.prompt
    generated_text = output.outputs[0].text
    print(f"Prompt: {{prompt!r}}, Generated text: {{generated_text!r}}")
'''

# vLLM's examples/offline_inference (basic/chat.py, the logprobs and token-prompt forms), likewise
CHAT_AND_TOKENS = f'''
from dist_inference_runner import LLM, SamplingParams

llm = LLM(model={DEFAULT_MODEL!r}, pipeline_parallel_size=2, in_process=True)
sampling_params = SamplingParams(temperature=0, max_tokens=8, logprobs=2)
conversation = [
    {{"role": "system", "content": "You are a helpful assistant"}},
    {{"role": "user", "content": "Tom has 3 apples. Ann has 2 apples. How many apples in all?"}},
]
outputs = llm.chat(conversation, sampling_params=sampling_params, use_tqdm=False)
print("CHAT", repr(outputs[0].outputs[0].text), outputs[0].outputs[0].finish_reason)

tokenizer = llm.get_tokenizer()
ids = tokenizer.encode("Once upon a time")
outputs = llm.generate([{{"prompt_token_ids": ids}}, "Once upon a time"], sampling_params=sampling_params)
for output in outputs:
    completion = output.outputs[0]
    first = completion.logprobs[0]
    print("TOKENS", output.prompt_token_ids == ids, completion.token_ids[:2], len(first),
          completion.token_ids[0] in first, round(completion.cumulative_logprob, 4) <= 0)
llm.close()
'''


def run_script(code: str) -> str:
    out = io.StringIO()
    scope: dict = {"__name__": "__main__"}
    try:
        with contextlib.redirect_stdout(out):
            exec(compile(code, "<vllm script>", "exec"), scope)
    finally:
        if isinstance(scope.get("llm"), LLM):
            scope["llm"].close()
    return out.getvalue()


def test_vllms_quickstart_runs_with_only_its_import_changed():
    lines = run_script(QUICKSTART).splitlines()
    assert len(lines) == 4
    assert lines[0].startswith("Prompt: 'Hello, my name is', Generated text: '") and lines[0] != \
        "Prompt: 'Hello, my name is', Generated text: ''"
    assert lines[2].startswith("Prompt: 'The capital of France is', Generated text: ")


def test_vllms_chat_logprobs_and_token_prompts_at_p2():
    lines = run_script(CHAT_AND_TOKENS).splitlines()
    assert lines[0].startswith("CHAT '") and lines[0].split()[-1] in ("stop", "length")
    tokens = [line.split(" ", 1)[1] for line in lines[1:]]
    assert len(tokens) == 2 and tokens[0] == tokens[1]  # ids or text: the same prompt, the same greedy answer
    assert tokens[0].startswith("True [") and tokens[0].endswith(" 2 True True")  # sampled token among the top 2


@pytest.fixture(scope="module")
def llm():
    with LLM(pipeline_parallel_size=2, in_process=True, no_progress=True) as llm:
        yield llm


def test_results_read_as_vllms_request_outputs(llm):
    tok = llm.get_tokenizer()
    sp = SamplingParams(max_tokens=6, temperature=0, logprobs=3, repetition_penalty=1.2, n=1)
    text, ids = "The garden is west of the kitchen.", tok("The garden is west of the kitchen.")["input_ids"]
    a, b, c = llm.generate([text, ids, {"prompt_token_ids": ids}], sp)
    assert a.prompt == text and b.prompt is None and a.prompt_token_ids == b.prompt_token_ids == ids == \
        c.prompt_token_ids
    assert a.outputs[0].token_ids == b.outputs[0].token_ids == c.outputs[0].token_ids
    out = a.outputs[0]
    assert out.text == tok.decode(out.token_ids) and out.finish_reason in ("stop", "length") and a.finished
    assert len(out.logprobs) == len(out.token_ids)
    for tid, lp, step in zip(out.token_ids, out.token_logprobs, out.logprobs, strict=True):
        assert step[tid].logprob == lp and 1 <= len(step) <= 4
        ranks = sorted(x.rank for x in step.values() if x.rank is not None)
        assert ranks == list(range(1, len(ranks) + 1)) and all(x.decoded_token is not None for x in step.values())
    assert out.cumulative_logprob == pytest.approx(sum(out.token_logprobs))
    plain = llm.generate("The garden", SamplingParams(max_tokens=2))[0].outputs[0]
    assert plain.logprobs is None and plain.cumulative_logprob is None  # not asked for, as vLLM


def test_chat_results_carry_the_rendered_prompt(llm):
    (r,) = llm.chat([{"role": "user", "content": "Who has the ball?"}], SamplingParams(max_tokens=4, temperature=0))
    assert r.ok and r.prompt and "Who has the ball?" in r.prompt
    assert llm.get_tokenizer()(r.prompt, add_special_tokens=False)["input_ids"] == r.prompt_token_ids
    with_kwargs = llm.chat([{"role": "user", "content": "hi"}], sampling_params=SamplingParams(max_tokens=2),
                           add_generation_prompt=True, chat_template_kwargs={})
    assert with_kwargs[0].ok
    (refused,) = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=2),
                          continue_final_message=True)
    assert refused.error["param"] == "continue_final_message"


def test_vllm_fields_without_an_implementation_are_refused_by_name(llm):
    refused = llm.generate(["x"] * 4, [SamplingParams(prompt_logprobs=1), SamplingParams(bad_words=["no"]),
                                       SamplingParams(extra={"temprature": 0.5}),
                                       SamplingParams(extra={"tools": [{"type": "function"}]})])
    assert [r.error["param"] for r in refused] == ["prompt_logprobs", "bad_words", "temprature", "tools"]
    assert "tool calling is not supported" in refused[3].error["message"]
    # at their defaults they change nothing and are taken
    ok = llm.generate("x", SamplingParams(max_tokens=2, skip_special_tokens=True, include_stop_str_in_output=False,
                                          detokenize=True, structured_outputs=StructuredOutputsParams(choice=["a"])))
    assert ok[0].ok and ok[0].outputs[0].text == "a"


def test_score_refuses_vllms_cross_encoder_form(llm):
    with pytest.raises(TypeError, match="cross-encoder"):
        llm.score("The cat sat on the", " mat")
    assert llm.score([("The cat sat on the", " mat")])[0].logprob < 0


def test_engine_arguments_of_vllm():
    with pytest.raises(TypeError, match="pipeline_parallel_size"):
        LLM(tensor_parallel_size=2)
    with pytest.raises(TypeError, match="context window"):
        LLM(max_model_len=128)
    with pytest.raises(TypeError, match="disagree"):
        LLM(pipeline_size=1, pipeline_parallel_size=2)
    for size in ({"pipeline_size": 0}, {"pipeline_parallel_size": 0}, {"pipeline_size": 0, "in_process": True},
                 {"pipeline_size": -1, "in_process": True}):  # 0 ran one stage
        with pytest.raises(ValueError, match="pipeline_size must be at least 1"):
            LLM(**size)


def test_lenient_fields_ignore_and_log(caplog):
    with LLM(in_process=True, lenient_fields=True, no_progress=True, dtype="float", gpu_memory_utilization=0.9,
             enforce_eager=True) as llm, caplog.at_level(logging.WARNING, logger="api"):
        (r,) = llm.generate("x", SamplingParams(max_tokens=2, extra={"mirostat": 2}), use_tqdm=False)
    assert r.ok and "mirostat" in caplog.text
