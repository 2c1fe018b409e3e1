"""vLLM's sampling fields (repetition_penalty, min_p, min_tokens, ignore_eos, stop_token_ids) in whole runs,
every stage in this process: greedy outputs equal transformers' generate with its own processors (at
P = 1 and 2), reported logprobs stay the model's raw distribution, and the fields combine with n/best_of,
echo, logprobs and structured outputs; a seeded row's sample does not depend on its neighbours or P."""

from __future__ import annotations

import pytest
import torch

from tests.utils import _hf_model, local_tokenizer, read_jsonl, run_local, write_jsonl

FLAGS = ["--no-progress", "--num-threads", "1", "--budget", "4096"]


@pytest.fixture(scope="module")
def model_dir(make_llama):
    return make_llama(num_hidden_layers=2, num_key_value_heads=2, max_position_embeddings=512)


def run(model_dir, tmp_path, requests, stages=1, *flags, name="r.jsonl") -> list[dict]:
    src = write_jsonl(tmp_path / name, requests)
    out = tmp_path / f"out_{stages}_{name}"
    r = run_local(["--model-name", model_dir, "--infer-data", src, "--output-path", str(out), *FLAGS, *flags], stages)
    assert r.returncode == 0, r.stderr[-3000:]
    return read_jsonl(out)


@torch.inference_mode()
def hf_generate(model_dir, prompt: list[int], steps: int, stops: list[int], **kwargs) -> list[int]:
    """transformers' greedy generate with its processors; the tokens before the first stop token."""
    model = _hf_model(model_dir)
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=steps, do_sample=False,
                         eos_token_id=stops, pad_token_id=0, **kwargs)[0, len(prompt):].tolist()
    return out[: next((i for i, t in enumerate(out) if t in stops), len(out))]


@pytest.mark.parametrize("stages", [1, 2])
def test_greedy_with_the_fields_equals_transformers_generate(model_dir, tmp_path, stages):
    tok = local_tokenizer()
    eos = tok.eos_token_id
    p1 = tok("Once upon a time there was")["input_ids"]
    p2 = tok("The garden is west of the kitchen")["input_ids"]
    plain = hf_generate(model_dir, p2, 8, [eos])
    stop_tok = plain[3]  # what greedy decoding takes fourth: ends the row there
    cases = [  # (request fields, transformers' generate arguments)
        ({"repetition_penalty": 1.8}, {"repetition_penalty": 1.8}),
        ({"repetition_penalty": 0.6, "logprobs": 2}, {"repetition_penalty": 0.6}),
        ({"logit_bias": {str(eos): 30}, "min_tokens": 4}, {"sequence_bias": {(eos,): 30.0}, "min_new_tokens": 4}),
        ({"stop_token_ids": [stop_tok]}, {"extra_stops": [stop_tok]}),
        ({"stop_token_ids": [stop_tok], "min_tokens": 6, "repetition_penalty": 1.3},
         {"extra_stops": [stop_tok], "min_new_tokens": 6, "repetition_penalty": 1.3}),
    ]
    requests = [{"prompt": p, "max_tokens": 8, "temperature": 0, **fields} for fields, _ in cases for p in (p1, p2)]
    out = run(model_dir, tmp_path, requests, stages)
    for (fields, hf_args), prompt, line in zip([c for c in cases for _ in (0, 1)], [p1, p2] * len(cases), out,
                                               strict=True):
        hf_args = dict(hf_args)
        stops = [eos] + hf_args.pop("extra_stops", [])
        want = hf_generate(model_dir, prompt, 8, stops, **hf_args)
        choice = line["result"]["choices"][0]
        got = tok(choice["text"], add_special_tokens=False)["input_ids"] if choice["text"] else []
        assert tok.decode(got) == tok.decode(want), (fields, choice["text"], tok.decode(want))
        assert choice["finish_reason"] == ("stop" if len(want) < 8 else "length"), (fields, choice)
    # min_tokens held EOS back for exactly four tokens; the stop token ended its row before it
    assert out[4]["result"]["usage"]["completion_tokens"] == 5 and out[4]["result"]["choices"][0]["text"]
    assert out[7]["result"]["usage"]["completion_tokens"] == 4


def test_reported_logprobs_stay_the_models_raw_distribution(model_dir, tmp_path):
    tok = local_tokenizer()
    prompt = tok("Once upon a time")["input_ids"]
    out = run(model_dir, tmp_path, [{"prompt": prompt, "max_tokens": 6, "temperature": 0, "repetition_penalty": 2.5,
                                     "min_p": 0.3, "logprobs": 1, "echo": True, "return_token_ids": True}])
    choice = out[0]["result"]["choices"][0]
    ids = choice["token_ids"]
    assert ids[: len(prompt)] == prompt
    with torch.no_grad():
        ref = torch.log_softmax(_hf_model(model_dir)(torch.tensor([ids])).logits[0].float(), -1)
    want = [None] + [float(ref[i - 1, t]) for i, t in enumerate(ids) if i > 0]
    got = choice["logprobs"]["token_logprobs"]
    assert got[0] is None and max(abs(a - b) for a, b in zip(got[1:], want[1:], strict=True)) < 1e-4


def test_ignore_eos_generates_through_eos(model_dir, tmp_path):
    eos = local_tokenizer().eos_token_id
    base = {"prompt": "Once upon a time", "max_tokens": 5, "temperature": 0, "logit_bias": {str(eos): 50},
            "return_token_ids": True}
    stopped, through = run(model_dir, tmp_path, [base, {**base, "ignore_eos": True}])
    assert stopped["result"]["choices"][0]["finish_reason"] == "stop"
    assert stopped["result"]["usage"]["completion_tokens"] == 1 and stopped["result"]["choices"][0]["text"] == ""
    c = through["result"]["choices"][0]
    assert c["finish_reason"] == "length" and c["token_ids"] == [eos] * 5


def test_the_fields_combine_with_n_best_of_structured_outputs_and_stop_strings(model_dir, tmp_path):
    reqs = [
        {"prompt": "Pick:", "max_tokens": 6, "temperature": 1.0, "seed": 3, "n": 2, "best_of": 3, "min_p": 0.1,
         "repetition_penalty": 1.2, "structured_outputs": {"choice": ["red", "green", "blue"]}, "logprobs": 1},
        {"prompt": "Count:", "max_tokens": 12, "temperature": 0.8, "seed": 9, "min_tokens": 5, "stop": [" "],
         "frequency_penalty": 0.5, "presence_penalty": 0.5},
        {"prompt": "Say", "max_tokens": 8, "temperature": 0, "guided_regex": "(yes|no)!", "min_tokens": 1},
    ]
    a = run(model_dir, tmp_path, reqs, 1, "--batch-invariant", name="a.jsonl")
    first, second, third = (line["result"] for line in a)
    assert [c["text"] in ("red", "green", "blue") for c in first["choices"]] == [True, True]
    assert first["usage"]["completion_tokens"] >= 3
    # stop strings are looked for only after min_tokens tokens
    assert second["usage"]["completion_tokens"] >= 5
    assert third["choices"][0]["text"] in ("yes!", "no!")
    # a seeded row samples the same alone, beside others, and at P = 2 (--batch-invariant: exact)
    b = run(model_dir, tmp_path, reqs, 2, "--batch-invariant", name="a.jsonl")
    alone = run(model_dir, tmp_path, reqs[1:2], 1, "--batch-invariant", name="c.jsonl")
    for x in (b, alone):
        assert x[-1 if x is alone else 1]["result"]["choices"] == second["choices"]
    assert [line["result"]["choices"] for line in b] == [line["result"]["choices"] for line in a]


def test_unusable_values_are_the_lines_errors(model_dir, tmp_path):
    out = run(model_dir, tmp_path, [
        {"prompt": "x", "stop_token_ids": [10**6]}, {"prompt": "x", "min_tokens": 20, "max_tokens": 4},
        {"prompt": "x", "repetition_penalty": 0}, {"prompt": "x", "min_p": 1.5}, {"prompt": "x", "ignore_eos": "yes"},
        {"prompt": "x", "max_tokens": 1, "min_p": 0.5}])
    assert [line.get("error", {}).get("param") for line in out] == [
        "stop_token_ids", "min_tokens", "repetition_penalty", "min_p", "ignore_eos", None]
