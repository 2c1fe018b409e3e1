"""The command line in one process (``dist_inference_runner.main``, as ``python dist_inference_runner.py``
runs it; tests.utils.run_local): every flag problem found before anything loads, with exit code 2,
one line that says how to fix it and no traceback; the defaults (output path, model); a config file;
``--help``. The exit code a shell sees from a real process: tests/integration/test_launch.py."""

import json
import re

import pytest

from tests.utils import DATA, assert_identical_results, read_jsonl, run_local


@pytest.fixture(scope="module")
def model_dir(make_llama):
    return make_llama(num_hidden_layers=3, num_key_value_heads=2, max_position_embeddings=2048)


@pytest.mark.parametrize("flags, message", [
    (["--pp-mode", "bogus"], "bogus"),  # argparse words the refusal; the bad value is in it
    (["--num-layers", "1"], "--num-layers 1 x 1 stages"),
    (["--max-layers", "0"], "--max-layers must be at least 1"),
    (["--num-threads", "-1"], "--num-threads must be at least 0"),  # was torch's RuntimeError after planning
    (["--seed", str(2**64)], "--seed must be an integer between"),  # was orjson's TypeError writing the status
    (["--budget", "0"], "--budget must be a positive"),
    (["--status-file", ""], "--status-file needs a file path"),  # was pathlib's ValueError at the first status
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


def test_default_output_path_and_default_model(tmp_path):
    src = tmp_path / "two.jsonl"
    src.write_text('{"prompt": "Hello", "max_tokens": 3}\n{"prompt": "World", "max_tokens": 2, "temperature": 0}\n')
    p = run_local(["--infer-data", str(src)])
    assert p.returncode == 0, p.stderr[-3000:]
    out = read_jsonl(tmp_path / "output_two.jsonl")
    assert [x["result"]["model"] for x in out] == ["tiny-llama-default-v5"] * 2
    assert out[1]["result"]["usage"]["completion_tokens"] == 2


def test_stage_size_mistakes_exit_2_before_loading(llama_2l):
    for flags, message in [(["--layers-per-stage", "3"], "adds up to 3, but the sizes must add up to 2"),
                           (["--layers-per-stage", "1,x"], "expected layer counts separated by commas"),
                           (["--stage-memory", "10KiB"], "short"),
                           (["--num-layers", "1", "--layers-per-stage", "2"], "pass only one of them")]:
        res = run_local(["--model-name", llama_2l, *flags])
        assert res.returncode == 2 and message in res.stderr, res.stderr[-2000:]
        assert "loaded" not in res.stderr and "Traceback" not in res.stderr


def test_run_configured_by_yaml(tmp_path, llama_2l):
    """--config run.yaml: keys are the long flag names, the command line overrides the file."""
    from tests.unit.pipeline.config.test_options import config

    data = tmp_path / "requests.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "max_tokens": 4, "temperature": 0}) + "\n"
                            for p in ("hello", "Once upon a time", "The kitchen is north of")))
    out = tmp_path / "results" / "out.jsonl"
    out.parent.mkdir()
    cfg = config(tmp_path, f"model-name: {llama_2l}\ninfer-data: {data}\noutput-path: {out}\n"
                           "num-threads: 1\nno-progress: true\nbudget: 100\nmax-micro-batch-size: 1\n")
    p = run_local(["--config", cfg, "--max-micro-batch-size", "2"])
    assert p.returncode == 0, p.stderr[-3000:]
    lines = read_jsonl(out)
    assert [x["request"]["prompt"] for x in lines] == ["hello", "Once upon a time", "The kitchen is north of"]
    assert all(len(x["result"]["choices"][0]["logprobs"]["tokens"]) == 4 for x in lines)
    assert max(x["result"]["request_time"]["batch_size"] for x in lines) == 2  # the command line's 2, not the file's 1


def test_help_lists_the_parser_flags():
    """``--help`` (the entry's main, as the script runs it) lists exactly the parser's flags
    (tests/unit/test_docs_flags.py checks them against the docs)."""
    from tests.unit.test_docs_flags import parser_actions

    p = run_local(["--help"])
    assert p.returncode == 0, p.stderr[-2000:]
    listed = set(re.findall(r"^  (--[a-z][a-z0-9-]*)", p.stdout, flags=re.M)) - {"--help"}
    assert listed == set(parser_actions())


def test_broken_checkpoint_is_reported_naming_the_file_and_tensor(tmp_path):
    """A sharded checkpoint with a shard missing: refused before loading (exit 2), naming the shard; a
    shard that is there but broken is named with its tensor: tests/unit/pipeline/loading."""
    import shutil

    from tests.utils import tiny_llama

    d = tmp_path / "sharded"
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(tiny_llama(tmp_path / "base")).save_pretrained(d, max_shard_size="300KB")
    for f in (tmp_path / "base").glob("tokenizer*"):
        shutil.copy(f, d / f.name)
    index = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]
    shard = index["model.layers.0.self_attn.q_proj.weight"]
    (d / shard).unlink()
    req = tmp_path / "req.jsonl"
    req.write_text(json.dumps({"prompt": "hello", "max_tokens": 2}) + "\n")
    r = run_local(["--model-name", str(d), "--infer-data", str(req)])
    assert r.returncode == 2 and shard in r.stderr and "listed in the shard index" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_job_name_path_is_the_input(llama_2l, tmp_path):
    """A job named ``name#path`` (LSF's ``bsub -J``, or --job-name) runs the file at ``path``: the same
    answers as ``--infer-data path``."""
    data = tmp_path / "request_7.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in [
        {"prompt": "The kitchen is north of the hallway.", "max_tokens": 6, "temperature": 0, "logprobs": 2},
        {"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0.8, "top_p": 0.9, "seed": 7},
        {"prompt": "The quick brown fox jumps over the lazy dog.", "max_tokens": 0, "echo": True, "logprobs": 3}]))
    fast = ["--num-threads", "1", "--no-progress", "--batch-invariant"]
    ref = tmp_path / "ref.jsonl"
    p = run_local(["--model-name", llama_2l, "--infer-data", str(data), "--output-path", str(ref), *fast])
    assert p.returncode == 0, p.stderr[-3000:]
    job = f"x#{data}"
    for env, args in (({"LSB_JOBNAME": job}, []), ({}, ["--job-name", job])):
        p = run_local(["--model-name", llama_2l, *args, *fast, "--overwrite"], env=env)
        assert p.returncode == 0, p.stderr[-3000:]
        assert_identical_results(read_jsonl(tmp_path / "output_request_7.jsonl"), read_jsonl(ref))
