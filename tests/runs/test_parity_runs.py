"""What a run computes equals HF, at P = 1, 2 and 3, in one process (``--in-process``: every rank a
thread, the same rank loops and messages as under torchrun): greedy tokens and logprobs, top
logprobs and usage, long prompts in chunks with passes ahead, a chunked prompt beside decoding rows,
one micro-batch's decode rows split over the stages."""

import json
from pathlib import Path

import pytest
import torch

from tests.utils import hf_greedy, local_tokenizer, read_jsonl, run_inprocess, run_local, write_jsonl

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
    p = run_local(["--model-name", model_dir, "--infer-data", str(requests_file), "--output-path", str(out)], stages)
    assert p.returncode == 0, p.stderr[-3000:]
    assert f"stage {stages - 1}/{stages}" in p.stderr  # really that many stages
    _check_against_hf(model_dir, out)
    top = read_jsonl(out)[0]["result"]["choices"][0]["logprobs"]["top_logprobs"]
    assert all(len(t) <= 2 for t in top) and len(top) == STEPS


def test_chunked_long_prompts_at_p2_run_ahead_and_match_hf(model_dir, tmp_path):
    """Long prompts computed 32 tokens a pass at P = 2: a micro-batch that only computes prompts has its
    next chunks' pass in flight before the last stage answers the previous one (the first stage does
    not wait), and every answer still equals HF's greedy tokens and logprobs."""
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 500, (n,), generator=gen).tolist() for n in (150, 170, 190, 210, 160, 200)]
    path = write_jsonl(tmp_path / "long.jsonl", [{"prompt": p, "max_tokens": 3, "temperature": 0, "logprobs": 1}
                                                 for p in prompts])
    out = tmp_path / "out.jsonl"
    p = run_local(["--model-name", model_dir, "--infer-data", path, "--output-path", str(out), "--profiling",
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
    p = run_local(["--model-name", model_dir, "--infer-data", str(requests_file), "--output-path", str(out),
                   "--num-micro-batches", "1", "--profiling"], 2)
    assert p.returncode == 0, p.stderr[-3000:]
    _check_against_hf(model_dir, out)
    forward = [e["args"] for e in json.loads(Path(f"{out}.trace-rank0.json").read_text())["traceEvents"]
               if e["name"] == "forward"]
    assert sum(1 for a in forward if a["decode"] and a.get("ahead")) >= STEPS - 1
    assert all(a["decode"] <= 3 for a in forward)  # 5 rows: 3 + 2
