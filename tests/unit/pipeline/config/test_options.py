"""--config run.yaml: keys are the long flag names, the command line overrides the file, unknown keys
and broken files fail with exit code 2 and a message. parse_options is called directly (no processes),
plus one end-to-end run configured by YAML alone."""

from __future__ import annotations

import dataclasses

import pytest

from pipeline.config.options import parse_options


def config(tmp_path, text: str) -> str:
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return str(path)


def parse_error(capsys, argv) -> str:
    with pytest.raises(SystemExit) as e:
        parse_options(argv)
    assert e.value.code == 2
    return capsys.readouterr().err


def test_command_line_overrides_the_file(tmp_path):
    cfg = config(tmp_path, "budget: 123\nseed: 7\n")
    assert parse_options(["--config", cfg, "--budget", "456"]).budget == 456
    assert parse_options(["--budget", "456", "--config", cfg]).budget == 456  # order does not matter
    opts = parse_options(["--config", cfg])
    assert (opts.budget, opts.seed) == (123, 7)


def test_keys_only_in_the_file_apply_and_the_rest_keep_defaults(tmp_path):
    cfg = config(tmp_path, "max-micro-batch-size: 4\nnum_micro_batches: 3\nno-progress: true\n"
                           "dtype: bfloat16\noutput-path: out.jsonl\n")
    opts = parse_options(["--config", cfg, "--seed", "9"])
    assert (opts.max_micro_batch_size, opts.num_micro_batches, opts.no_progress) == (4, 3, True)
    assert (opts.dtype, opts.output_path, opts.seed) == ("bfloat16", "out.jsonl", 9)
    assert (opts.budget, opts.strict, opts.infer_data) == ("auto", False, None)


def test_infer_data_as_list_or_string(tmp_path):
    assert parse_options(["--config", config(tmp_path, "infer-data: [a.jsonl, 'q/*.jsonl']\n")]).infer_data == \
        ["a.jsonl", "q/*.jsonl"]
    assert parse_options(["--config", config(tmp_path, "infer-data:\n  - a.jsonl\n  - b.jsonl\n")]).infer_data == \
        ["a.jsonl", "b.jsonl"]
    cfg = config(tmp_path, "infer-data: queries/default\n")
    assert parse_options(["--config", cfg]).infer_data == ["queries/default"]
    assert parse_options(["--config", cfg, "--infer-data", "x.jsonl", "y.jsonl"]).infer_data == ["x.jsonl", "y.jsonl"]


def test_unknown_key_is_named(tmp_path, capsys):
    err = parse_error(capsys, ["--config", config(tmp_path, "budget: 5\nbugdet: 6\n")])
    assert "unknown option" in err and "bugdet" in err and "budget, infer-data" in err
    err = parse_error(capsys, ["--config", config(tmp_path, "config: other.yaml\n")])
    assert "unknown option" in err and "config" in err


@pytest.mark.parametrize("text, message", [
    ("budget: [1\n", "not valid YAML"),
    ("- budget\n- 5\n", "expected a mapping"),
    ("budget: lots\n", "'budget' must be an integer or auto, got 'lots'"),
    ("budget: auto\n", None),
    ("budget: 0\n", "--budget must be a positive number"),
])
def test_broken_file_exits_2_with_message(tmp_path, capsys, text, message):
    if message is None:  # not broken
        assert parse_options(["--config", config(tmp_path, text)]).budget == "auto"
        return
    err = parse_error(capsys, ["--config", config(tmp_path, text)])
    assert message in err and "Traceback" not in err


def test_missing_file_exits_2(tmp_path, capsys):
    err = parse_error(capsys, ["--config", str(tmp_path / "nope.yaml")])
    assert f"--config {tmp_path / 'nope.yaml'}: " in err and "Traceback" not in err  # then the OS's reason


def test_empty_file_changes_nothing(tmp_path):
    cfg = config(tmp_path, "")
    assert parse_options(["--config", cfg]) == dataclasses.replace(parse_options([]), config=cfg)
    # null is the default (seed: null reached the sampler as None: a traceback at the first token)
    cfg = config(tmp_path, "seed: null\nbudget: null\nmodel-name: null\nlora:\n")
    assert parse_options(["--config", cfg]) == dataclasses.replace(parse_options([]), config=cfg)


def test_prefix_cache_on_off_unquoted(tmp_path):  # YAML 1.1 reads on / off as booleans
    assert parse_options(["--config", config(tmp_path, "prefix-cache: off\n")]).prefix_cache == "off"
    assert parse_options(["--config", config(tmp_path, "prefix-cache: on\n")]).prefix_cache == "on"


@pytest.mark.parametrize("text, message", [
    ("budget: 12.5\n", "'budget' must be an integer"),
    ("infer-data: 5\n", "'infer-data' must be a list of paths"),
    ('fp16: "no"\n', "'fp16' must be true or false"),
    ("pp-mode: other\n", "'pp-mode' must be one of"),
])
def test_wrongly_typed_yaml_values_are_rejected(tmp_path, capsys, text, message):
    assert message in parse_error(capsys, ["--config", config(tmp_path, text)])


def test_budget_auto_from_gpu_memory():
    """--budget auto: free memory less max(1 GiB, 10%) over the KV bytes of one token; on the CPU the
    available RAM shared among the node's processes, within [8192, 65536]."""
    import torch

    from pipeline.config.budget import CPU_BUDGET, CPU_MAX_BUDGET, GiB, budget_from_memory, cpu_budget, resolve_budget

    assert budget_from_memory(free=30 * GiB, total=40 * GiB, cell_bytes=1 << 20) == 26 * 1024
    assert budget_from_memory(free=5 * GiB, total=8 * GiB, cell_bytes=1 << 20) == 4 * 1024
    assert budget_from_memory(free=GiB // 2, total=8 * GiB, cell_bytes=1 << 20) == 0
    assert budget_from_memory(free=GiB // 2, total=8 * GiB, cell_bytes=0) > 1 << 40  # no layers: no limit
    assert cpu_budget(available=16 * GiB, local_world=4, cell_bytes=1 << 17) == 24 * 1024  # 4 GiB each, 1 GiB kept
    assert cpu_budget(available=2 * GiB, local_world=4, cell_bytes=1 << 20) == CPU_BUDGET  # tight: the floor
    assert cpu_budget(available=64 * GiB, local_world=1, cell_bytes=1024) == CPU_MAX_BUDGET  # small cells: the cap
    assert resolve_budget(300, None, torch.device("cpu")) == 300
    assert parse_options(["--budget", "300"]).budget == 300


@pytest.mark.parametrize("argv, message", [
    (["--budgett", "5"], "unrecognized arguments: --budgett 5 (did you mean --budget?)"),
    (["--budget", "0"], "--budget must be a positive number of KV-cache tokens or auto, got 0"),
    (["--pp-mode", "bogus"], "argument --pp-mode: invalid choice: 'bogus'"),
    (["--max-tokens"], "argument --max-tokens: expected one argument"),
    (["--metrics-port", "9100", "--status-file", "none"], "drop --status-file none"),  # was no metrics, no word
])
def test_a_usage_error_is_its_line_and_a_pointer_to_help(argv, message, capsys):
    """Not argparse's 70 lines of usage before the one that says what is wrong (issue 58)."""
    with pytest.raises(SystemExit) as e:
        parse_options(argv)
    assert e.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2 and lines[0].startswith("dist_inference_runner.py: error: ") and message in lines[0]
    assert "--help" in lines[1]
