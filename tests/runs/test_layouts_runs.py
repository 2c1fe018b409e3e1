"""What repeats across layouts, in one process: the shared request files answered completely and in
order; under --batch-invariant byte-identical results whatever the budget, micro-batch size and
pipeline size (P = 1, 2, 3); in default mode agreement up to float rounding across budgets; generated files
(Hypothesis, seeded and bounded) answered line by line in every layout, bit-identical under --batch-invariant."""

import json

import pytest
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

from tests import fuzz_requests as gen
from tests.utils import DATA, assert_consistent_results, assert_identical_results, read_jsonl, run_local, write_jsonl

SHARED = ["babi_fewshot.jsonl", "mixed_params.jsonl", "helm_scoring.jsonl"]
TINY = ["--budget", "1200", "--max-micro-batch-size", "3"]  # barely above the largest request: requests queue


@pytest.fixture(scope="module")
def model_dir(make_llama):
    return make_llama(num_hidden_layers=3, num_key_value_heads=2, max_position_embeddings=2048)


@pytest.fixture(scope="module")
def shared_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("shared")
    for name in SHARED:
        (folder / name).write_text((DATA / name).read_text())
    return folder


def _run_shared(model_dir, shared_files, out_dir, stages: int, *flags) -> dict[str, list[dict]]:
    args = ["--model-name", model_dir, "--infer-data", *[str(shared_files / n) for n in SHARED],
            "--output-path", str(out_dir), "--no-progress", "--num-threads", "1", *flags]
    p = run_local(args, stages)
    assert p.returncode == 0, p.stderr[-3000:]
    return {n: read_jsonl(out_dir / f"output_{n}") for n in SHARED}


@pytest.fixture(scope="module")
def exact_reference(model_dir, shared_files, tmp_path_factory):
    """--batch-invariant, one stage, the default budget."""
    return _run_shared(model_dir, shared_files, tmp_path_factory.mktemp("exact_ref"), 1, "--batch-invariant")


def test_shared_files_complete_in_order(exact_reference, shared_files):
    for name, out in exact_reference.items():
        src = [json.loads(l) for l in (shared_files / name).read_text().splitlines() if l.strip()]
        assert [x["request"] for x in out] == src
        assert all("result" in x for x in out), [x.get("error") for x in out if "error" in x]


TURNS = ["--num-micro-batches", "1", "--num-threads", "2"]  # stages taking turns with the cores (big stages' default)


@pytest.mark.parametrize("stages, flags", [(1, TINY), (2, []), (3, TINY), (2, TURNS)],
                         ids=["P1-tiny", "P2", "P3-tiny", "P2-turns"])
def test_batch_invariant_results_are_identical_across_budgets_and_stages(model_dir, shared_files, exact_reference,
                                                                         tmp_path, stages, flags):
    """Sampled, greedy and scored requests: byte-identical (ids and timing aside) to one stage at the
    default budget, whatever the budget, micro-batch size and pipeline size."""
    got = _run_shared(model_dir, shared_files, tmp_path, stages, "--batch-invariant", *flags)
    for name in SHARED:
        assert_identical_results(got[name], exact_reference[name])


def test_default_mode_agrees_across_budgets_up_to_rounding(model_dir, shared_files, tmp_path):
    """Default mode promises less: a row's logits move by float rounding when its micro-batch changes,
    so a near-tie may flip; everything before it agrees (tests.utils.assert_consistent_results)."""
    big = _run_shared(model_dir, shared_files, tmp_path / "big", 1)
    small = _run_shared(model_dir, shared_files, tmp_path / "small", 1, *TINY)
    for name in SHARED:
        assert_consistent_results(big[name], small[name])


def _batch_chat(body: dict) -> dict:
    return {"custom_id": "c", "method": "POST", "url": "/v1/chat/completions", "body": body}


GENERATED = {  # name: (stages, flags); the first two must give identical bits
    "exact-P1": (1, ["--batch-invariant"]),
    "exact-P2-tiny": (2, ["--batch-invariant", "--budget", "1200", "--max-micro-batch-size", "3"]),
    "P2-blocks-chunks": (2, ["--prefix-block-size", "2", "--prefill-chunk", "3", "--max-micro-batch-size", "2"]),
    "transformers-P2": (2, ["--backend", "transformers"]),
}


def _check_answers(lines: list[dict], out: list[dict], name: str) -> None:
    """One answer per line in order; a completion's tokens join to its text, one logprob and offset each."""
    assert len(out) == len(lines), name
    for i, (line, o) in enumerate(zip(lines, out, strict=True)):
        if "custom_id" in line:
            assert o["custom_id"] == line["custom_id"] and ("response" in o), (name, i, o)
            continue
        assert o["request"] == line and ("result" in o) != ("error" in o), (name, i, o)
        for c in (o.get("result") or {}).get("choices", []):
            lp = c["logprobs"]
            assert "".join(lp["tokens"]) == c["text"], (name, i, c)
            assert len(lp["token_logprobs"]) == len(lp["tokens"]) == len(lp["text_offset"]), (name, i, c)


@settings(derandomize=True, database=None, max_examples=10, deadline=None, suppress_health_check=list(HealthCheck),
          phases=(Phase.explicit, Phase.reuse, Phase.generate))
@given(lines=st.lists(gen.valid_bodies() | gen.valid_bodies(chat=True).map(_batch_chat), min_size=1, max_size=5))
@example(lines=[{"prompt": [998, 343], "max_tokens": 0, "echo": True, "best_of": 2}])  # a fork of the whole cache
def test_generated_files_answer_every_line_in_every_layout(model_dir, tmp_path_factory, lines):
    """Generated files of completion and chat requests with every field: each layout answers every line once,
    in order, with tokens that make its text; under --batch-invariant P = 2 with a tiny budget gives the bits
    of P = 1."""
    folder = tmp_path_factory.mktemp("generated")
    src = write_jsonl(folder / "in.jsonl", lines)
    outs = {}
    for name, (stages, flags) in GENERATED.items():
        out = folder / f"{name}.jsonl"
        p = run_local(["--model-name", model_dir, "--infer-data", src, "--output-path", str(out), "--no-progress",
                       "--num-threads", "1", *flags], stages)
        assert p.returncode == 0, p.stderr[-3000:]
        outs[name] = read_jsonl(out)
        _check_answers(lines, outs[name], name)
    assert_identical_results(outs["exact-P1"], outs["exact-P2-tiny"])
