"""The OpenAI completions contract as evaluation suites read it: types, echo scoring, text_offset,
prompt forms, n/best_of, seeds, penalties, stops, Batch API."""

import json
import math

import openai.types as openai_types  # a declared test dependency (requirements-test.txt)
import pytest
import torch

from tests.utils import DATA, assert_identical_results, hf_logits, local_tokenizer, read_jsonl, run_inprocess, write_jsonl


@pytest.fixture(scope="module")
def model_dir(make_llama):
    return make_llama(num_hidden_layers=2, num_key_value_heads=2, max_position_embeddings=1024)


def run(model_dir, tmp_path, requests, *flags, name="r.jsonl") -> list[dict]:
    src = write_jsonl(tmp_path / name, requests)
    out = tmp_path / ("out_" + name)
    assert run_inprocess(["--model-name", model_dir, "--infer-data", src, "--output-path", str(out),
                          "--no-progress", *flags]) == 0
    return read_jsonl(out)


def validate_completion(result: dict) -> None:
    """openai's own Completion type; a null first echo logprob is the one permitted deviation."""
    r = json.loads(json.dumps(result))
    for c in r["choices"]:
        lp = c["logprobs"]
        lp["token_logprobs"] = [0.0 if v is None else v for v in lp["token_logprobs"]]
        if lp["top_logprobs"] is not None:
            lp["top_logprobs"] = [{} if v is None else v for v in lp["top_logprobs"]]
    openai_types.Completion.model_validate(r)


def check_offsets(choice: dict) -> None:
    lp = choice["logprobs"]
    assert "".join(lp["tokens"]) == choice["text"]
    pos = 0
    for tok, off in zip(lp["tokens"], lp["text_offset"], strict=True):
        assert off == pos
        pos += len(tok)
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["text_offset"])


def test_mixed_params_all_answered_and_valid_openai_types(model_dir, tmp_path):
    requests = [json.loads(l) for l in (DATA / "mixed_params.jsonl").read_text().splitlines() if l.strip()]
    out = run(model_dir, tmp_path, requests)
    assert len(out) == len(requests)
    for req, line in zip(requests, out, strict=True):
        assert line["request"] == req  # unknown keys are kept
        assert "result" in line, line.get("error")
        res = line["result"]
        validate_completion(res)
        p = req["prompt"]
        n_prompts = len(p) if isinstance(p, list) and p and not isinstance(p[0], int) else 1
        n = req.get("n", 1)
        assert [c["index"] for c in res["choices"]] == list(range(n_prompts * n))
        for c in res["choices"]:
            check_offsets(c)
            if req.get("logprobs"):
                assert all(t is None or len(t) <= req["logprobs"] for t in c["logprobs"]["top_logprobs"])
            if req.get("echo"):
                assert c["logprobs"]["token_logprobs"][0] is None
                assert all(v is not None for v in c["logprobs"]["token_logprobs"][1:])
            if not req.get("echo"):
                assert len(c["logprobs"]["tokens"]) <= req["max_tokens"]
            stops = req.get("stop") or []
            stops = [stops] if isinstance(stops, str) else stops
            generated = c["text"][len(p):] if req.get("echo") and isinstance(p, str) else c["text"]
            assert not any(s in generated for s in stops)
        assert res["usage"]["total_tokens"] == res["usage"]["prompt_tokens"] + res["usage"]["completion_tokens"]


def _hf_loglik(model_dir, ids: list[int]) -> float:
    lp = torch.log_softmax(hf_logits(model_dir, ids), -1)
    return sum(float(lp[i, ids[i + 1]]) for i in range(len(ids) - 1))  # float64 sum


def test_lm_eval_recipe_loglikelihood_and_greedy_flag(model_dir, tmp_path):
    """lm-eval local-completions: token-id prompt = context + continuation, echo, max_tokens 1, logprobs 1."""
    tok = local_tokenizer()
    context = tok("The kitchen is north of the hallway. The garden is")["input_ids"]
    hf = torch.log_softmax(hf_logits(model_dir, context), -1)
    greedy_next = int(hf[-1].argmax())
    cases = [[greedy_next], tok(" west of the office", add_special_tokens=False)["input_ids"]]
    out = run(model_dir, tmp_path, [{"prompt": context + cont, "max_tokens": 1, "echo": True, "logprobs": 1,
                                     "temperature": 0} for cont in cases])
    for cont, line in zip(cases, out, strict=True):
        lp = line["result"]["choices"][0]["logprobs"]
        ctxlen = len(context)
        # what lm-eval does with the response
        ours = sum(lp["token_logprobs"][ctxlen:-1])
        is_greedy = all(max(top, key=top.get) == tok_s
                        for tok_s, top in zip(lp["tokens"][ctxlen:-1], lp["top_logprobs"][ctxlen:-1], strict=True))
        ids = context + cont
        ref_lp = torch.log_softmax(hf_logits(model_dir, ids), -1)
        ref = float(sum(ref_lp[i - 1, ids[i]] for i in range(ctxlen, len(ids))))
        ref_greedy = all(int(ref_lp[i - 1].argmax()) == ids[i] for i in range(ctxlen, len(ids)))
        assert abs(ours - ref) < 1e-3
        assert is_greedy == ref_greedy
    assert [is_g for is_g in [True]] and len(out) == 2


def test_prompt_forms_and_choice_indexing(model_dir, tmp_path):
    tok = local_tokenizer()
    ids = tok("one two")["input_ids"]
    out = run(model_dir, tmp_path, [
        {"prompt": "one two", "max_tokens": 3, "temperature": 0},
        {"prompt": ids, "max_tokens": 3, "temperature": 0},
        {"prompt": ["one two", "three"], "max_tokens": 3, "n": 2, "temperature": 0},
        {"prompt": [ids, ids[:2]], "max_tokens": 3, "temperature": 0},
        {"prompt": [1, 2, 99999], "max_tokens": 1},
        {"prompt": [], "max_tokens": 1},
        {"prompt": [["a"]], "max_tokens": 1},
    ])
    text = out[0]["result"]["choices"][0]["text"]
    assert out[1]["result"]["choices"][0]["text"] == text
    choices = out[2]["result"]["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    assert choices[0]["text"] == choices[1]["text"] == text  # greedy n=2: the same twice
    assert out[3]["result"]["choices"][0]["text"] == text and len(out[3]["result"]["choices"]) == 2
    assert "outside the vocabulary" in out[4]["error"]["message"]
    assert out[5]["error"]["param"] == "prompt" and out[6]["error"]["param"] == "prompt"


def test_best_of_returns_the_n_best_by_mean_logprob(model_dir, tmp_path):
    base = {"prompt": "Pick one:", "max_tokens": 6, "temperature": 1.0, "seed": 3, "logprobs": 0}
    all4 = run(model_dir, tmp_path, [dict(base, n=4, best_of=4)], name="a.jsonl")[0]["result"]["choices"]
    best2 = run(model_dir, tmp_path, [dict(base, n=2, best_of=4)], name="b.jsonl")[0]["result"]["choices"]
    mean = lambda c: sum(c["logprobs"]["token_logprobs"]) / len(c["logprobs"]["token_logprobs"])
    expected = sorted(all4, key=mean, reverse=True)[:2]
    assert [c["text"] for c in best2] == [c["text"] for c in expected]
    assert [c["index"] for c in best2] == [0, 1]
    assert len({c["text"] for c in all4}) > 1  # the candidates differ


def test_seeded_sampling_is_independent_of_budget_and_neighbours(model_dir, tmp_path):
    reqs = [{"prompt": f"Story {i}:", "max_tokens": 8, "temperature": 1.0, "top_p": 0.9, "logprobs": 1,
             **({"seed": 1000 + i} if i % 2 else {})} for i in range(12)]
    a = run(model_dir, tmp_path, reqs, "--batch-invariant", name="a.jsonl")
    b = run(model_dir, tmp_path, reqs, "--budget", "100", "--max-micro-batch-size", "2", "--batch-invariant", name="b.jsonl")
    assert_identical_results(a, b)
    # a request with its own seed gives the same sample wherever it stands
    alone = run(model_dir, tmp_path, [reqs[5]], "--batch-invariant", name="c.jsonl")
    assert alone[0]["result"]["choices"][0]["text"] == a[5]["result"]["choices"][0]["text"]
    assert len({x["result"]["choices"][0]["text"] for x in a}) > 6


def test_logit_bias_and_penalties_leave_reported_logprobs_raw(model_dir, tmp_path):
    tok = local_tokenizer()
    forced = tok(" garden", add_special_tokens=False)["input_ids"][0]
    out = run(model_dir, tmp_path, [
        {"prompt": "The", "max_tokens": 4, "temperature": 0, "logit_bias": {str(forced): 100}},
        {"prompt": "The", "max_tokens": 12, "temperature": 0, "frequency_penalty": 2.0},
        {"prompt": "The", "max_tokens": 12, "temperature": 0},
        {"prompt": "The", "max_tokens": 1, "logit_bias": {"5": 101}},
    ])
    c = out[0]["result"]["choices"][0]
    assert c["text"] == " garden" * 4
    ids = tok("The")["input_ids"] + [forced] * 4
    ref = torch.log_softmax(hf_logits(model_dir, ids), -1)
    raw = [float(ref[len(ids) - 5 + i, forced]) for i in range(4)]
    assert max(abs(a - b) for a, b in zip(c["logprobs"]["token_logprobs"], raw, strict=True)) < 1e-4
    assert all(v < -1 for v in c["logprobs"]["token_logprobs"])  # raw model, not the biased one
    penalized, plain = (out[i]["result"]["choices"][0]["logprobs"]["tokens"] for i in (1, 2))
    assert len(set(penalized)) >= len(set(plain))
    assert out[3]["error"]["param"] == "logit_bias"


def test_stop_strings_across_token_boundaries(model_dir, tmp_path):
    plain = run(model_dir, tmp_path, [{"prompt": "Once upon", "max_tokens": 12, "temperature": 0, "logprobs": 0}],
                name="plain.jsonl")[0]["result"]["choices"][0]
    toks = plain["logprobs"]["tokens"]
    k = next(i for i in range(2, len(toks) - 1) if len(toks[i]) >= 2 and toks[i + 1])
    stop = toks[k][-2:] + toks[k + 1][:1]  # spans the boundary between tokens k and k+1
    cut = plain["text"].find(stop)
    out = run(model_dir, tmp_path, [{"prompt": "Once upon", "max_tokens": 12, "temperature": 0, "logprobs": 0,
                                     "stop": ["never-there", stop]}], name="stop.jsonl")[0]["result"]["choices"][0]
    assert out["finish_reason"] == "stop"
    assert out["text"] == plain["text"][:cut] and stop not in out["text"]
    check_offsets(out)
    assert len(out["logprobs"]["tokens"]) <= k + 1
    bad = run(model_dir, tmp_path, [{"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}], name="bad.jsonl")[0]
    assert "at most 4" in bad["error"]["message"]


def test_text_offset_with_non_ascii(model_dir, tmp_path):
    prompts = ["naïve café — 日本語のテキスト 😀🎉", "Ünïcödé ✓ ok"]
    out = run(model_dir, tmp_path, [{"prompt": p, "max_tokens": 8, "echo": True, "logprobs": 1, "temperature": 0.9,
                                     "seed": 1} for p in prompts])
    for p, line in zip(prompts, out, strict=True):
        c = line["result"]["choices"][0]
        assert c["text"].startswith(p)
        check_offsets(c)


def test_batch_api_lines_mixed_endpoints(model_dir, tmp_path):
    lines = [
        {"custom_id": "a", "method": "POST", "url": "/v1/completions",
         "body": {"model": "m", "prompt": "Hello", "max_tokens": 3, "logprobs": 2}},
        {"custom_id": "b", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": "m", "messages": [{"role": "user", "content": "Hi there"}], "max_tokens": 4,
                  "logprobs": True, "top_logprobs": 2}},
        {"custom_id": "c", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": "m", "messages": "not a list"}},
        {"custom_id": "d", "method": "POST", "url": "/v1/embeddings", "body": {"input": "x"}},
        {"custom_id": "e", "method": "POST", "url": "/v1/completions", "Body": {"prompt": "x"}},  # misspelt
        {"custom_id": "f", "method": "POST", "url": "/v1/completions"},
        {"custom_id": "g", "method": "GET", "url": "/v1/completions", "body": {"prompt": "x"}},
    ]
    out = run(model_dir, tmp_path, lines)
    assert [x["custom_id"] for x in out] == ["a", "b", "c", "d", "e", "f", "g"]  # a broken line keeps its custom_id
    assert all(x["error"]["message"] == "Batch API line: 'body' must be an object" for x in out[4:6])
    assert out[6]["error"]["message"] == 'Batch API line: \'method\' must be "POST", got "GET"'
    assert out[0]["response"]["status_code"] == 200 and out[0]["error"] is None
    validate_completion(out[0]["response"]["body"])
    chat = out[1]["response"]["body"]
    openai_types.chat.ChatCompletion.model_validate(chat)
    assert chat["object"] == "chat.completion" and chat["choices"][0]["message"]["role"] == "assistant"
    content = chat["choices"][0]["logprobs"]["content"]
    assert len(content) == chat["usage"]["completion_tokens"] and all(len(t["top_logprobs"]) == 2 for t in content)
    assert "".join(t["token"] for t in content) == chat["choices"][0]["message"]["content"]
    for bad in out[2:]:
        assert bad["response"]["status_code"] == 400 and bad["error"]["message"]


def test_sampling_matches_the_exact_truncated_distribution():
    """Seeded inverse-CDF sampling at temperature 1 / top_p 0.9 vs the exact truncated distribution
    (a chi-square test on a fixed seed: deterministic, not flaky)."""
    from pipeline.sampling.sampler import sample, stream_key, truncated_probs, uniform

    logits = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0]])
    n = 20000
    t, k, p = torch.tensor([1.0]), torch.tensor([0]), torch.tensor([0.9])
    ids, probs = truncated_probs(logits, t, k, p)
    exact = torch.zeros(8)
    exact[ids[0]] = probs[0]
    counts = torch.zeros(8)
    for i in range(n):
        u = torch.tensor([uniform(stream_key(42, None, i, 0, 0), 0)])
        counts[int(sample(logits, t, k, p, u))] += 1
    kept = exact > 0
    assert counts[~kept].sum() == 0  # nothing outside the nucleus
    expected = exact[kept] * n
    chi2 = float(((counts[kept] - expected) ** 2 / expected).sum())
    dof = int(kept.sum()) - 1
    assert chi2 < dof + 4 * math.sqrt(2 * dof) + 10, (chi2, dof)
