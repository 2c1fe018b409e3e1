"""End to end through real processes (gloo on loopback): parity with HF for P = 1, 2, 3,
torchrun vs the seed's per-rank launch, the shared request files, tiny budgets, bad flags."""

import json
from pathlib import Path

import pytest
import torch

from tests.utils import (DATA, assert_consistent_results, assert_identical_results, hf_greedy, local_tokenizer, read_jsonl,
                         run_inprocess, run_legacy, run_single, run_torchrun, write_jsonl)

PROMPTS = ["The kitchen is north of the hallway.", "Question: where is the garden?\nAnswer:",
           "a", "Passage: The office is east of the hallway. The bedroom is west of the garden. The garden is"]
STEPS = 5


@pytest.fixture(scope="module")
def model_dir(make_llama):
    return make_llama(num_hidden_layers=3, num_key_value_heads=2, max_position_embeddings=2048)


@pytest.fixture(scope="module")
def requests_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("req") / "greedy.jsonl"
    lines = [{"prompt": p, "max_tokens": STEPS, "temperature": 0, "logprobs": 2} for p in PROMPTS]
    lines.append({"prompt": [5, 17, 300, 42], "max_tokens": STEPS, "temperature": 0})
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def _check_against_hf(model_dir, out_path):
    tok = local_tokenizer()
    lines = read_jsonl(out_path)
    assert len(lines) == len(PROMPTS) + 1
    prompts = [tok(p)["input_ids"] for p in PROMPTS] + [[5, 17, 300, 42]]
    for line, ids in zip(lines, prompts, strict=True):
        choice = line["result"]["choices"][0]
        ref_tokens, ref_lps = hf_greedy(model_dir, ids, STEPS)
        assert choice["text"] == tok.decode(ref_tokens, skip_special_tokens=True)
        got = choice["logprobs"]["token_logprobs"]
        assert len(got) == STEPS
        assert max(abs(a - b) for a, b in zip(got, ref_lps, strict=True)) < 1e-4
        assert line["result"]["usage"] == {"prompt_tokens": len(ids), "completion_tokens": STEPS,
                                           "total_tokens": len(ids) + STEPS,
                                           "prompt_tokens_details": {"cached_tokens": 0}}


@pytest.mark.parametrize("stages", [1, 2, 3])
def test_greedy_parity_with_hf(model_dir, requests_file, tmp_path, stages):
    out = tmp_path / "out.jsonl"
    args = ["--model-name", model_dir, "--infer-data", str(requests_file), "--output-path", str(out)]
    proc = run_single(args) if stages == 1 else run_torchrun(args, stages)
    assert proc.returncode == 0, proc.stderr[-3000:]
    _check_against_hf(model_dir, out)
    top = read_jsonl(out)[0]["result"]["choices"][0]["logprobs"]["top_logprobs"]
    assert all(len(t) <= 2 for t in top) and len(top) == STEPS


def test_legacy_launch_equals_torchrun(model_dir, tmp_path):
    src = tmp_path / "mixed.jsonl"
    src.write_text((DATA / "mixed_params.jsonl").read_text())
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    base = ["--model-name", model_dir, "--infer-data", str(src)]
    p = run_torchrun(base + ["--output-path", str(a)], 2)
    assert p.returncode == 0, p.stderr[-3000:]
    procs = run_legacy(base + ["--output-path", str(b)], 2)
    assert all(x.returncode == 0 for x in procs), procs[0].stderr[-3000:] + procs[1].stderr[-3000:]
    assert_identical_results(read_jsonl(a), read_jsonl(b))  # one layout, run twice


SHARED = ["babi_fewshot.jsonl", "mixed_params.jsonl", "helm_scoring.jsonl"]
TINY = ["--budget", "1200", "--max-micro-batch-size", "3"]  # barely above the largest request: requests queue


@pytest.fixture(scope="module")
def shared_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("shared")
    for name in SHARED:
        (folder / name).write_text((DATA / name).read_text())
    return folder


def _run_shared(model_dir, shared_files, out_dir, stages: int, *flags) -> dict[str, list[dict]]:
    args = ["--model-name", model_dir, "--infer-data", *[str(shared_files / n) for n in SHARED],
            "--output-path", str(out_dir), "--no-progress", "--num-threads", "1", *flags]  # thread counts: test_batch_invariant
    p = run_single(args, timeout=900) if stages == 1 else run_torchrun(args, stages, timeout=900)
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


@pytest.mark.parametrize("stages, flags", [(1, TINY), (2, []), (3, TINY)], ids=["P1-tiny", "P2", "P3-tiny"])
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


def test_default_output_path_and_default_model(tmp_path):
    src = tmp_path / "two.jsonl"
    src.write_text('{"prompt": "Hello", "max_tokens": 3}\n{"prompt": "World", "max_tokens": 2, "temperature": 0}\n')
    p = run_single(["--infer-data", str(src)])
    assert p.returncode == 0, p.stderr[-3000:]
    out = read_jsonl(tmp_path / "output_two.jsonl")
    assert [x["result"]["model"] for x in out] == ["tiny-llama-default-v5"] * 2
    assert out[1]["result"]["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize("flags, message", [
    (["--pp-mode", "bogus"], "bogus"),  # argparse words the refusal; the bad value is in it
    (["--num-layers", "1"], "--num-layers 1 x 1 stages"),
    (["--max-layers", "0"], "--max-layers must be at least 1"),
    (["--budget", "0"], "--budget must be a positive"),
    (["--prefill-chunk", "many"], "expected a number of prompt tokens (0: off) or auto"),
    (["--prefill-chunk", "64", "--batch-invariant"], "drop --prefill-chunk"),
    (["--model-name", "/nonexistent/model"], "no such folder"),
    (["--infer-data", "/nonexistent.jsonl"], "no such file"),
])
def test_bad_flags_fail_fast_with_a_fix(model_dir, flags, message, capsys):
    """In-process: every flag problem is found before anything loads (no process group needed)."""
    import dist_inference_runner

    args = (["--model-name", model_dir] if "--model-name" not in flags else []) + flags
    if "--infer-data" not in flags:
        args += ["--infer-data", str(DATA / "bad_lines.jsonl")]
    try:
        code = dist_inference_runner.main(args, signals=False)
    except SystemExit as e:  # argparse's own errors
        code = e.code
    err = capsys.readouterr().err
    assert code == 2
    assert message in err
    assert "Traceback" not in err


def test_bad_flag_exit_code_of_the_process(model_dir):
    p = run_single(["--model-name", model_dir, "--infer-data", "/nonexistent.jsonl"], timeout=120)
    assert p.returncode == 2 and "no such file" in p.stderr and "Traceback" not in p.stderr


def test_chunked_long_prompts_at_p2_run_ahead_and_match_hf(model_dir, tmp_path):
    """Long prompts computed 32 tokens a pass at P = 2: a micro-batch that only computes prompts has its
    next chunks' pass in flight before the last stage answers the previous one (the first stage does
    not wait), and every answer still equals HF's greedy tokens and logprobs."""
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 500, (n,), generator=gen).tolist() for n in (150, 170, 190, 210, 160, 200)]
    path = write_jsonl(tmp_path / "long.jsonl", [{"prompt": p, "max_tokens": 3, "temperature": 0, "logprobs": 1}
                                                 for p in prompts])
    out = tmp_path / "out.jsonl"
    p = run_torchrun(["--model-name", model_dir, "--infer-data", path, "--output-path", str(out), "--profiling",
                      "--prefill-chunk", "32", "--max-micro-batch-size", "2"], 2)
    assert p.returncode == 0, p.stderr[-3000:]
    trace = json.loads(Path(f"{out}.trace-rank0.json").read_text())["traceEvents"]
    assert any(e["name"] == "forward" and e["args"].get("ahead") for e in trace)
    for line, ids in zip(read_jsonl(out), prompts, strict=True):
        tokens, lps = hf_greedy(model_dir, ids, 3)
        choice = line["result"]["choices"][0]
        assert choice["text"] == local_tokenizer().decode(tokens)
        assert max(abs(a - b) for a, b in zip(choice["logprobs"]["token_logprobs"], lps, strict=True)) < 1e-4


def test_a_chunked_prompt_beside_decoding_rows_matches_hf(model_dir, tmp_path):
    """A 200-token prompt computed 32 tokens a pass in a micro-batch whose other row already decodes:
    the decode segment must not touch the cache row holding its earlier chunks (a dense segment, every
    slot row, writes column 0 of idle rows); its answer equals HF's."""
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 500, (n,), generator=gen).tolist() for n in (40, 200)]
    path = write_jsonl(tmp_path / "r.jsonl", [{"prompt": p, "max_tokens": 6, "temperature": 0, "logprobs": 1}
                                              for p in prompts])
    out = tmp_path / "out.jsonl"
    assert run_inprocess(["--model-name", model_dir, "--infer-data", path, "--output-path", str(out),
                          "--prefill-chunk", "32", "--max-micro-batch-size", "2", "--no-progress"]) == 0
    for line, ids in zip(read_jsonl(out), prompts, strict=True):
        tokens, lps = hf_greedy(model_dir, ids, 6)
        choice = line["result"]["choices"][0]
        assert choice["text"] == local_tokenizer().decode(tokens)
        assert max(abs(a - b) for a, b in zip(choice["logprobs"]["token_logprobs"], lps, strict=True)) < 1e-4


def test_one_micro_batch_splits_its_decode_rows_over_the_stages(model_dir, requests_file, tmp_path):
    """P = 2 with one micro-batch holding every request (the end of a file looks like this): its decode
    rows split over two passes in flight together (``Scheduler.parts``), each with at most half the
    rows and never the dense layout; the answers still equal HF's."""
    out = tmp_path / "out.jsonl"
    p = run_torchrun(["--model-name", model_dir, "--infer-data", str(requests_file), "--output-path", str(out),
                      "--num-micro-batches", "1", "--profiling"], 2)
    assert p.returncode == 0, p.stderr[-3000:]
    _check_against_hf(model_dir, out)
    forward = [e["args"] for e in json.loads(Path(f"{out}.trace-rank0.json").read_text())["traceEvents"]
               if e["name"] == "forward"]
    assert sum(1 for a in forward if a["decode"] and a.get("ahead")) >= STEPS - 1
    assert all(a["decode"] <= 3 for a in forward)  # 5 rows: 3 + 2
