"""Model families and tokenizers through the runner at P = 2, in one process (``--in-process``), against
HF: the generic transformers stage (StarCoder2; llama forced through it equals native), a
mixture-of-experts family (Qwen3-MoE), Gemma 3's local/global layers, echo scoring as evaluation
suites read it (P = 1 and 2), a sentencepiece-only tokenizer folder. The stages alone against HF:
tests/unit/pipeline/models/."""

from __future__ import annotations

import json

import torch

from pipeline.loading.tokenizer import load_tokenizer
from tests.unit.pipeline.loading.test_tokenizer import _sp_folder, sp_model  # noqa: F401 (a fixture)
from tests.unit.pipeline.models.test_hf_stage import _check_against_hf, _requests, llama, models  # noqa: F401
from tests.utils import (DATA, assert_consistent_results, hf_greedy, hf_logits, local_tokenizer, random_hf_model,
                         read_jsonl, run_inprocess, run_local, write_jsonl)


def test_native_backend_for_unknown_family_fails_fast(models, tmp_path):
    proc = run_local(["--model-name", models("starcoder2"), "--backend", "native", "--infer-data",
                      write_jsonl(tmp_path / "r.jsonl", [{"prompt": "hi", "max_tokens": 1}])])
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "--backend auto" in proc.stderr and "llama" in proc.stderr and "starcoder2" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_p2_generic_family_echo_and_greedy_match_hf(models, tmp_path):
    d = models("starcoder2")
    src, out = write_jsonl(tmp_path / "r.jsonl", _requests()), tmp_path / "out.jsonl"
    proc = run_local(["--model-name", d, "--infer-data", src, "--output-path", str(out), "--no-progress"], 2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    _check_against_hf(d, read_jsonl(out))


def test_p2_llama_transformers_backend_equals_native(llama, tmp_path):
    src = write_jsonl(tmp_path / "r.jsonl", _requests())
    native, generic = tmp_path / "native.jsonl", tmp_path / "generic.jsonl"
    assert run_inprocess(["--model-name", llama, "--infer-data", src, "--output-path", str(native),
                          "--no-progress", "--prefix-cache", "off"]) == 0  # the generic stage has none
    proc = run_local(["--model-name", llama, "--infer-data", src, "--output-path", str(generic), "--no-progress",
                      "--backend", "transformers"], 2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_consistent_results(read_jsonl(native), read_jsonl(generic))
    _check_against_hf(llama, read_jsonl(generic))


def test_moe_echo_scoring_and_generation_at_p2(tmp_path):
    """Qwen3-MoE at P = 2: echo scoring of prompts (max_tokens 0) and a greedy generation, against HF."""
    from tests.unit.pipeline.models.families.test_moe import tiny_moe

    d = tiny_moe(tmp_path / "q3", "qwen3_moe")
    tok = local_tokenizer()
    texts = ["The kitchen is north of the hallway.", "Question: where is the garden?\nAnswer: the garden is"]
    lines = [{"prompt": t, "echo": True, "logprobs": 1, "max_tokens": 0} for t in texts]
    lines.append({"prompt": texts[0], "max_tokens": 4, "temperature": 0, "logprobs": 1})
    req, out = write_jsonl(tmp_path / "req.jsonl", lines), tmp_path / "out.jsonl"
    proc = run_local(["--model-name", d, "--infer-data", req, "--output-path", str(out)], 2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = read_jsonl(out)
    assert len(results) == len(lines)
    for text, line in zip(texts, results[: len(texts)], strict=True):
        ids = tok(text)["input_ids"]
        lp = line["result"]["choices"][0]["logprobs"]
        ref = torch.log_softmax(hf_logits(d, ids), -1)
        expected = [float(ref[i - 1, ids[i]]) for i in range(1, len(ids))]
        assert lp["token_logprobs"][0] is None and len(lp["token_logprobs"]) == len(ids)
        assert max(abs(a - b) for a, b in zip(lp["token_logprobs"][1:], expected, strict=True)) < 1e-4
    ids = tok(texts[0])["input_ids"]
    ref_tokens, ref_lps = hf_greedy(d, ids, 4)
    choice = results[2]["result"]["choices"][0]
    assert max(abs(a - b) for a, b in zip(choice["logprobs"]["token_logprobs"], ref_lps, strict=True)) < 1e-4
    assert choice["text"] == tok.decode(ref_tokens, skip_special_tokens=True)


def test_gemma3_p2_echo_scoring_and_greedy_match_hf(tmp_path):
    """Gemma 3 (local/global layers, window 4) at P = 2 echo-scores prompts several windows long and
    generates greedily, as HF does."""
    from tests.unit.pipeline.models.families.test_qwen3_gemma_phi3_olmo2 import PROMPTS, VARIANTS

    model_type, overrides = VARIANTS["gemma3"]
    path = random_hf_model(tmp_path / "gemma3", model_type, **overrides)
    requests = [{"prompt": p, "echo": True, "logprobs": 1, "max_tokens": 0} for p in PROMPTS]
    requests += [{"prompt": p, "max_tokens": 5, "temperature": 0, "logprobs": 0} for p in PROMPTS]
    src = write_jsonl(tmp_path / "requests.jsonl", requests)
    out = tmp_path / "out.jsonl"
    proc = run_local(["--model-name", path, "--infer-data", src, "--output-path", str(out), "--no-progress"], 2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = read_jsonl(out)
    for prompt, line in zip(PROMPTS, lines[: len(PROMPTS)], strict=True):
        lps = line["result"]["choices"][0]["logprobs"]["token_logprobs"]
        ref = torch.log_softmax(hf_logits(path, prompt), -1)
        assert lps[0] is None and len(lps) == len(prompt)
        assert max(abs(lps[i] - float(ref[i - 1, prompt[i]])) for i in range(1, len(prompt))) < 1e-4
    tok = local_tokenizer()
    for prompt, line in zip(PROMPTS, lines[len(PROMPTS):], strict=True):
        toks, _ = hf_greedy(path, prompt, 5)
        assert line["result"]["choices"][0]["text"] == tok.decode(toks)


def test_echo_scoring_matches_hf_loglikelihood_p1_and_p2(make_llama, tmp_path):
    """HELM's scoring requests (echo, max_tokens 0, top logprobs): the same at P = 1 and 2, HF's
    log-likelihood, text offsets that index the prompt."""
    from tests.unit.pipeline.output.test_openai_contract import _hf_loglik, check_offsets, run

    model_dir = make_llama(num_hidden_layers=2, num_key_value_heads=2, max_position_embeddings=1024)
    requests = [json.loads(l) for l in (DATA / "helm_scoring.jsonl").read_text().splitlines()[:8]]
    tok = local_tokenizer()
    out1 = run(model_dir, tmp_path, requests)
    src = write_jsonl(tmp_path / "helm.jsonl", requests)
    p = run_local(["--model-name", model_dir, "--infer-data", src, "--output-path", str(tmp_path / "p2.jsonl")], 2)
    assert p.returncode == 0, p.stderr[-3000:]
    out2 = read_jsonl(tmp_path / "p2.jsonl")
    assert_consistent_results(out1, out2)  # scoring only: logprobs within 1e-4
    for req, line in zip(requests, out1, strict=True):
        c = line["result"]["choices"][0]
        assert c["finish_reason"] == "length" and c["text"] == req["prompt"]
        assert line["result"]["usage"]["completion_tokens"] == 0
        ids = tok(req["prompt"])["input_ids"]
        assert len(c["logprobs"]["tokens"]) == len(ids)
        ours = sum(c["logprobs"]["token_logprobs"][1:])
        assert abs(ours - _hf_loglik(model_dir, ids)) < 1e-3
        check_offsets(c)
        assert all(1 <= len(t) <= 5 for t in c["logprobs"]["top_logprobs"][1:])  # equal strings collapse


def test_sentencepiece_folder_end_to_end(sp_model, tmp_path):  # noqa: F811 (the fixture)
    d = _sp_folder(tmp_path, sp_model, True, with_model=True)
    tok = load_tokenizer(d)
    req = tmp_path / "requests.jsonl"
    prompts = ["The cat sat on", "Hello world"]
    req.write_text(json.dumps({"prompt": prompts[0], "max_tokens": 4, "temperature": 0, "echo": True, "logprobs": 1})
                   + "\n" + json.dumps({"prompt": prompts[1], "max_tokens": 3, "temperature": 0}) + "\n")
    r = run_local(["--model-name", str(d), "--infer-data", str(req), "--output-path", str(tmp_path / "out.jsonl")])
    assert r.returncode == 0, r.stderr
    lines = read_jsonl(tmp_path / "out.jsonl")
    assert [l["request"]["prompt"] for l in lines] == prompts
    for line, prompt in zip(lines, prompts, strict=True):
        res = line["result"]
        ids = tok(prompt)["input_ids"]
        assert ids[0] == 1 and res["usage"]["prompt_tokens"] == len(ids)
        ref, _ = hf_greedy(str(d), ids, line["request"]["max_tokens"])  # never EOS (min_new_tokens): all of them
        choice = res["choices"][0]
        assert res["usage"]["completion_tokens"] == len(ref)
        assert choice["text"].endswith(tok.decode(ref, skip_special_tokens=True))
    echo, usage = lines[0]["result"]["choices"][0]["logprobs"], lines[0]["result"]["usage"]
    assert len(echo["tokens"]) == usage["prompt_tokens"] + usage["completion_tokens"]
    assert echo["token_logprobs"][0] is None  # the BOS (whose text is empty: special tokens are skipped)
    assert "".join(echo["tokens"][: usage["prompt_tokens"]]) == prompts[0]
