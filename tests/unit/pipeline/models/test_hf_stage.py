"""The generic transformers stage (--backend): HF parity for families without native code (StarCoder2
with a sliding window shorter than the prompts, Granite with its multipliers, Cohere, StableLM) and
for llama forced through it, per-stage loading, refusals, and end-to-end runs with echo scoring."""

import json

import pytest
import torch

from pipeline.loading.stage_weights import build_stage
from pipeline.models.decoder import StageModel
from pipeline.models.hf_stage import HFKVCache, HFStageModel, UnsupportedModel
from pipeline.config.options import RunOptions, UsageError, build_parser
from pipeline.config.partition import stage_ranges
from pipeline.config.plan import make_plan
from tests.utils import REPO, assert_consistent_results, assert_hf_parity, chain_logits, hf_greedy, hf_logits, local_tokenizer, read_jsonl, run_inprocess, save_hf_model, stage_chain

WINDOW = 4  # StarCoder2's sliding window: most prompts below are longer
PROMPTS = [[5, 17, 300, 42, 9, 11, 1000, 7, 13], [100, 200], [31, 1020, 8, 99, 900],
           list(range(40, 61))]  # ids < 1024 (the local vocab)
COMMON = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96, num_hidden_layers=3)
FAMILIES = {
    "starcoder2": dict(COMMON, sliding_window=WINDOW),
    "granite": dict(COMMON, embedding_multiplier=6.0, residual_multiplier=0.4, attention_multiplier=0.3,
                    logits_scaling=3.0, tie_word_embeddings=True),
    "cohere": dict(COMMON, logit_scale=0.5, tie_word_embeddings=True),
    "stablelm": dict(COMMON, partial_rotary_factor=0.5, use_qkv_bias=True, tie_word_embeddings=False),
}


def tiny_model(out_dir, model_type: str, seed: int = 0, **overrides) -> str:
    from transformers import AutoConfig, AutoModelForCausalLM

    tok = local_tokenizer()
    cfg = AutoConfig.for_model(model_type, vocab_size=len(tok), max_position_embeddings=256,
                               bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                               pad_token_id=tok.pad_token_id, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():  # HF zero-inits biases and sets norms to 1: randomize them so the maps are checked
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return save_hf_model(model, out_dir)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    built = {}

    def get(family: str) -> str:
        if family not in built:
            built[family] = tiny_model(tmp_path_factory.mktemp(family), family, **FAMILIES[family])
        return built[family]

    return get


@pytest.fixture(scope="module")
def llama(make_llama):
    return make_llama(num_hidden_layers=3, num_key_value_heads=2)


@pytest.mark.parametrize("stages", [1, 2, 3])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_generic_stage_matches_hf(models, family, stages):
    """Mixed-length micro-batch logits within 1e-4, greedy tokens equal, logprobs within 1e-4."""
    assert_hf_parity(models(family), PROMPTS, stages, steps=6)


# More families, each for a code path of its own: GLM-4 / SmolLM3 / OLMo-2 / Qwen3 (norm placements,
# NoPE layers, q/k norms), Gemma 2 (eager attention with soft-capping: additive masks; embedding scale
# buffer), Gemma 3 (per-layer-type rotary, sliding and full layers), Phi (final_layernorm, partial
# rotary, lm_head bias), Persimmon (no grouped KV in its config).
SWEEP = {
    "glm4": {}, "smollm3": {}, "olmo2": {}, "qwen3": {},
    "gemma2": dict(sliding_window=WINDOW, attn_logit_softcapping=20.0, final_logit_softcapping=10.0),
    "gemma3_text": dict(sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"]),
    "phi": {}, "persimmon": {},
}


@pytest.mark.parametrize("family", sorted(SWEEP))
def test_more_families_match_hf_at_p2(family, tmp_path):
    over = dict(COMMON, num_hidden_layers=2, head_dim=16, **SWEEP[family])
    d = tiny_model(tmp_path / family, family, **over)
    chain = stage_chain(d, [(0, 1), (1, 2)], backend="transformers")  # some have native code too
    assert all(isinstance(s, HFStageModel) for s in chain)
    for prompt, ours in zip(PROMPTS, chain_logits(chain, PROMPTS), strict=True):
        torch.testing.assert_close(ours, hf_logits(d, prompt), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("stages", [1, 2, 3])
def test_llama_forced_through_transformers_matches_hf_and_native(llama, stages):
    assert_hf_parity(llama, PROMPTS, stages, backend="transformers")
    ranges = stage_ranges(3, stages)
    generic = stage_chain(llama, ranges, backend="transformers")
    assert all(isinstance(s, HFStageModel) for s in generic)
    for a, b in zip(chain_logits(generic, PROMPTS), chain_logits(stage_chain(llama, ranges), PROMPTS), strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_a_fork_of_every_column_copies_the_lead_row():
    """best_of / n > 1 with max_tokens 0, the cache exactly the prompt's columns: the lead row's slice is a
    contiguous view of the destination, which torch refused (the request failed; found by the differential
    fuzz, at P = 1 as at P = 2)."""
    cache = HFKVCache(2, 3, 4, torch.float32, "cpu")
    for i in range(2):
        for t in cache.layer(i, torch.zeros(1, 2, 1, 8)):
            t[0] = torch.randn(t[0].shape)
    getattr(cache, "fork")(0, [1, 2], 4)  # by name: tests/conftest.py takes a call named fork for a process
    for t in (*cache.k, *cache.v):
        assert torch.equal(t[1], t[0]) and torch.equal(t[2], t[0])


def test_sliding_window_really_cuts(models):
    """The window is in force: without it, the long prompt's logits differ from HF's."""
    d = models("starcoder2")
    chain = stage_chain(d, [(0, 3)])
    assert chain[0].kinds == ["sliding"] * 3 and chain[0].window == WINDOW
    chain[0].kinds = ["full"] * 3
    ours = chain_logits(chain, PROMPTS[:1])[0]
    assert (ours - hf_logits(d, PROMPTS[0])).abs().max() > 1e-3


def test_extras_read_from_the_hf_forwards(models):
    granite = build_stage(models("granite"), 0, 3, True, True)[0].extras
    assert (granite.embed_scale, granite.logits_divide, granite.logits_multiply) == (6.0, 3.0, None)
    cohere = build_stage(models("cohere"), 0, 3, True, True)[0].extras
    assert (cohere.embed_scale, cohere.logits_divide, cohere.logits_multiply) == (None, None, 0.5)


def test_auto_backend_picks_native_where_it_exists(llama, models):
    assert isinstance(build_stage(llama, 0, 1, True, False)[0], StageModel)
    assert isinstance(build_stage(llama, 0, 1, True, False, backend="native")[0], StageModel)
    assert isinstance(build_stage(models("starcoder2"), 0, 1, True, False)[0], HFStageModel)
    with pytest.raises(ValueError, match="--backend auto"):
        build_stage(models("starcoder2"), 0, 1, True, False, backend="native")


def test_auto_falls_back_for_a_variant_native_code_lacks(tmp_path):
    """A Llama with YaRN rope scaling: no native support, so auto runs the generic stage (equal to HF)
    and --backend native says why."""
    from tests.utils import tiny_llama

    d = tiny_llama(tmp_path / "yarn", rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                       "original_max_position_embeddings": 64})
    with pytest.raises(ValueError, match="yarn"):
        build_stage(d, 0, 3, True, True, backend="native")
    assert isinstance(build_stage(d, 0, 1, True, False)[0], HFStageModel)
    assert_hf_parity(d, PROMPTS, 2, steps=3)


@pytest.mark.parametrize("first_last", [(False, False), (True, False), (False, True), (True, True)])
def test_generic_stage_reads_only_its_tensors(tmp_path, first_last):
    """Sharded safetensors: a stage of layer 1 reads exactly its HF tensors and opens only their shards;
    a tied last stage without the embedding reads the embedding table for lm_head."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    has_embed, has_head = first_last
    d = tiny_model(tmp_path / "m", "granite", **FAMILIES["granite"])
    sharded = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).save_pretrained(sharded, max_shard_size="60KB")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(index.values())) >= 4
    _, store = build_stage(sharded, 1, 2, has_embed, has_head)
    expected = {n for n in index if n.startswith("model.layers.1.")}
    expected |= {"model.embed_tokens.weight"} if has_embed or has_head else set()  # tied lm_head
    expected |= {"model.norm.weight"} if has_head else set()
    assert sorted(store.loaded) == sorted(expected)
    assert {p.name for p in store.opened_files} == {index[n] for n in expected}
    with safe_open(str(sharded / index["model.layers.1.self_attn.q_proj.weight"]), "pt") as f:
        assert f.get_tensor("model.layers.1.self_attn.q_proj.weight").shape == (64, 64)


def test_pre_split_layout_of_a_generic_model(models, tmp_path):
    """split_checkpoint writes the pre-split layout of a model without native code; a stage opens only
    its parts' files (the tied head needs no pytorch_embs.pt) and computes the same logits."""
    from pipeline.loading.stage_weights import split_checkpoint

    d = models("granite")
    split_checkpoint(d, tmp_path / "split")
    _, store = build_stage(tmp_path / "split", 2, 3, False, True)
    assert sorted(p.name for p in store.opened_files) == ["pytorch_2.pt", "pytorch_lm_head.pt"]
    for a, b in zip(chain_logits(stage_chain(str(tmp_path / "split"), [(0, 2), (2, 3)]), PROMPTS),
                    chain_logits(stage_chain(d, [(0, 3)]), PROMPTS), strict=True):
        assert torch.equal(a, b)


def test_generic_stage_refuses_batch_invariant_and_what_it_cannot_run(models, tmp_path):
    with pytest.raises(UnsupportedModel, match="--batch-invariant"):
        build_stage(models("granite"), 0, 3, True, True, batch_invariant=True)
    with pytest.raises(UsageError, match="--batch-invariant"):
        make_plan(RunOptions(model_name=models("granite"), batch_invariant=True), env={})
    for kind, why in (("t5", "encoder-decoder"), ("gemma3", "multimodal"), ("not_a_model", "does not know"),
                      ("mixtral", "converts")):
        (tmp_path / kind).mkdir()
        (tmp_path / kind / "config.json").write_text(json.dumps({"model_type": kind, "vocab_size": 64}))
        with pytest.raises(UsageError, match=why):  # gemma3 and mixtral have native code: force the generic stage
            make_plan(RunOptions(model_name=str(tmp_path / kind), backend="transformers"), env={})
    # a misspelt --model-type: one short line naming the close types, not transformers' list of them all
    with pytest.raises(UsageError, match=r"'lama' .*did you mean llama\b") as e:
        make_plan(RunOptions(model_name=models("granite"), model_type="lama"), env={})
    assert len(str(e.value)) < 300
    (tmp_path / "untyped").mkdir()  # a config.json without model_type: the fix is --model-type
    (tmp_path / "untyped" / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(UsageError, match="model_type None .*--model-type"):
        make_plan(RunOptions(model_name=str(tmp_path / "untyped")), env={})
    from transformers import BertConfig

    bert = BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, is_decoder=True)
    with pytest.raises(UnsupportedModel, match="plain decoder stack"):
        HFStageModel(bert, 0, 2, True, True)


def test_backend_flag_documented():
    help_text = build_parser().format_help()
    assert "--backend {auto,native,transformers}" in help_text
    readme = (REPO / "README.md").read_text()
    assert "| `--backend auto\\|native\\|transformers` |" in readme


ECHO_PROMPTS = ["The kitchen is north of the hallway. The garden is south of the kitchen.",
                "Question: where is the garden?\nAnswer:", "a b"]


def _requests() -> list[dict]:
    echo = [{"prompt": p, "echo": True, "logprobs": 1, "max_tokens": 0} for p in ECHO_PROMPTS]
    greedy = [{"prompt": p, "max_tokens": 5, "temperature": 0, "logprobs": 1} for p in ECHO_PROMPTS]
    return echo + greedy


def _check_against_hf(model_dir: str, lines: list[dict]) -> None:
    tok = local_tokenizer()
    n = len(ECHO_PROMPTS)
    for prompt, line in zip(ECHO_PROMPTS, lines[:n], strict=True):  # echo scoring: every prompt token's logprob
        ids = tok(prompt)["input_ids"]
        c = line["result"]["choices"][0]
        assert c["text"] == prompt and c["logprobs"]["token_logprobs"][0] is None
        ref = torch.log_softmax(hf_logits(model_dir, ids), -1)
        ref_lps = [float(ref[i, ids[i + 1]]) for i in range(len(ids) - 1)]
        assert max(abs(a - b) for a, b in zip(c["logprobs"]["token_logprobs"][1:], ref_lps, strict=True)) < 1e-4
    for prompt, line in zip(ECHO_PROMPTS, lines[n:], strict=True):
        ids = tok(prompt)["input_ids"]
        toks, lps = hf_greedy(model_dir, ids, 5)
        got = line["result"]["choices"][0]["logprobs"]
        assert got["tokens"] == [tok.decode([t]) for t in toks]
        assert max(abs(a - b) for a, b in zip(got["token_logprobs"], lps, strict=True)) < 1e-4


def test_mixed_params_file_same_on_both_backends(llama, tmp_path):
    """Part of the shared mixed-parameter file (best_of forks of the cache, n, stops, penalties, sampling)
    gives the same results through the generic stage as through native code, up to float rounding."""
    from tests.utils import DATA

    lines = (DATA / "mixed_params.jsonl").read_text().splitlines()
    picked = [x for x in lines if "best_of" in x][:6] + [x for x in lines if "best_of" not in x][:6]
    src = tmp_path / "mixed.jsonl"
    src.write_text("\n".join(picked) + "\n")
    outs = {}
    for backend in ("native", "transformers"):
        outs[backend] = tmp_path / f"{backend}.jsonl"
        assert run_inprocess(["--model-name", llama, "--infer-data", str(src), "--output-path", str(outs[backend]),
                              "--no-progress", "--backend", backend, "--budget", "600",
                              "--prefix-cache", "off"]) == 0  # the generic stage has none: same budget errors
    assert_consistent_results(read_jsonl(outs["native"]), read_jsonl(outs["transformers"]))


def test_building_on_meta_in_two_threads_leaves_other_modules_real():
    """Stages of one process (``--in-process``) build their HF models side by side: the replaced
    ``register_parameter`` acts only inside the building threads and is put back once both are done
    (it used to stay replaced when the threads interleaved: every later model came out on meta)."""
    import threading

    from torch import nn

    from pipeline.models import hf_stage

    original = nn.Module.register_parameter
    inside, release, seen = threading.Barrier(3), threading.Event(), {}

    def build(name):
        with hf_stage._parameters_on_meta():
            inside.wait()
            release.wait()
            seen[name] = nn.Linear(2, 2).weight.device.type

    threads = [threading.Thread(target=build, args=(n,)) for n in ("a", "b")]
    for t in threads:
        t.start()
    inside.wait()  # both threads are inside: this one is not
    assert nn.Linear(2, 2).weight.device.type == "cpu"
    release.set()
    for t in threads:
        t.join()
    assert seen == {"a": "meta", "b": "meta"}
    assert nn.Module.register_parameter is original and nn.Linear(2, 2).weight.device.type == "cpu"
