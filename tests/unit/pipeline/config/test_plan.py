"""The run's plan, computed without processes or weights: layout, stage ranges, inputs, threads, warnings."""

import json
from pathlib import Path

import pytest

from pipeline.config.options import UsageError, parse_options
from pipeline.config.plan import make_plan, output_for
from tests.utils import DATA


def plan(model, *flags, world=1, rank=0, local_world=None, cpus=8):
    env = {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(local_world or world)}
    return make_plan(parse_options(["--model-name", model, *flags]), env=env, cpu_count=cpus)


@pytest.mark.parametrize("world, rank, flags, stage, layers, threads, has_inputs", [
    (1, 0, [], 0, (0, 2), 8, True),
    (2, 0, [], 0, (0, 1), 4, True),
    (2, 1, [], 1, (1, 2), 4, False),
    (4, 2, ["--data-group-size", "2"], 0, (0, 1), 2, True),  # rank 2 leads the second pipeline
    (4, 3, ["--data-group-size", "2", "--num-threads", "3"], 1, (1, 2), 3, False),
    (2, 1, ["--max-layers", "1", "--pipeline-group-size", "1", "--data-group-size", "2"], 0, (0, 1), 4, True),
])
def test_layout(llama_2l, world, rank, flags, stage, layers, threads, has_inputs, monkeypatch):
    monkeypatch.setattr("pipeline.config.cores.SMALL_LAYER_WEIGHTS", 0)  # the share of the cores, tiny as it is
    p = plan(llama_2l, "--infer-data", str(DATA / "mixed_params.jsonl"), *flags, world=world, rank=rank)
    assert (p.stage, p.layers, p.threads, bool(p.inputs)) == (stage, layers, threads, has_inputs)
    assert p.slots == (p.pipeline + 1 if p.pipeline > 1 else 1) and p.model_name == Path(llama_2l).name  # CPU: P + 1


def test_inputs_from_a_folder_and_the_job_name(llama_2l, tmp_path):
    for name in ("b.jsonl", "a.jsonl", "output_c.jsonl", "notes.txt"):
        (tmp_path / name).write_text("{}\n")
    assert plan(llama_2l, "--infer-data", str(tmp_path)).inputs == [str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")]
    assert plan(llama_2l, "--job-name", f"x#{tmp_path / 'b.jsonl'}").inputs == [str(tmp_path / "b.jsonl")]
    assert output_for("/q/a.jsonl", None, False) == "/q/output_a.jsonl"
    assert output_for("/q/a.jsonl", "/o", True) == "/o/output_a.jsonl"


def test_output_path_of_the_other_kind(llama_2l, tmp_path):
    """One input and an existing folder: the output goes in it (a traceback renaming the journal onto the
    folder once every line was done); several inputs and an existing file: refused before loading."""
    inputs = [str(tmp_path / n) for n in ("a.jsonl", "b.jsonl")]
    for path in inputs:
        Path(path).write_text("{}\n")
    (tmp_path / "out").mkdir()
    assert output_for(inputs[0], str(tmp_path / "out"), False) == str(tmp_path / "out" / "output_a.jsonl")
    (tmp_path / "taken.jsonl").write_text("{}\n")
    with pytest.raises(UsageError, match="taken.jsonl is a file, but the 2 inputs need a folder"):
        plan(llama_2l, "--infer-data", *inputs, "--output-path", str(tmp_path / "taken.jsonl"))


def test_micro_batches_follow_what_bounds_a_pass(llama_2l, monkeypatch):
    """CPU pipelines keep P + 1 micro-batches in flight (host work covered) unless a stage's weights are
    big enough that reading them bounds its decode passes: then P (fewer re-reads per token); one stage,
    and GPUs, P. --num-micro-batches wins."""
    import torch
    from pipeline.config import plan as plan_mod

    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    big = plan_mod.BIG_STAGE_BYTES
    assert [plan_mod.default_micro_batches(p, cpu, big - 1) for p in (1, 2, 3)] == [1, 3, 4]
    assert [plan_mod.default_micro_batches(p, cpu, big) for p in (1, 2, 3)] == [1, 2, 3]
    assert [plan_mod.default_micro_batches(p, gpu, 0) for p in (1, 2, 3)] == [1, 2, 3]
    assert plan(llama_2l, world=2).slots == 3
    monkeypatch.setattr(plan_mod, "BIG_STAGE_BYTES", 1)
    assert plan(llama_2l, world=2, local_world=1).slots == 2  # big stages on two nodes: P
    assert plan(llama_2l, "--num-threads", "1", world=2).slots == 2  # one-thread stages on one node: P
    assert plan(llama_2l, "--num-micro-batches", "5", world=2).slots == 5


def test_a_pipeline_on_one_node_hears_when_one_process_would_do(llama_2l, monkeypatch):
    """Big stages of a CPU pipeline sharing one node's cores, where one process would fit: a warning that
    says how to run P = 1 (not with stages on several nodes, small stages, or when P = 1 cannot fit)."""
    from pipeline.config import plan as plan_mod

    assert not any("--nproc-per-node 1" in w for w in plan(llama_2l, world=2).warnings)  # small stages
    monkeypatch.setattr(plan_mod, "BIG_STAGE_BYTES", 1)
    for flags in ([], ["--num-threads", "1"]):  # stages taking turns (the default), one-thread stages
        (note,) = [w for w in plan(llama_2l, *flags, world=2).warnings if "--nproc-per-node 1" in w]
        assert "one process fits this node's memory" in note and "2 stages" in note
    assert not any("--nproc-per-node" in w for w in plan(llama_2l, world=2, local_world=1).warnings)  # two nodes
    assert not any("--nproc-per-node" in w for w in plan(llama_2l).warnings)  # P = 1 already
    monkeypatch.setattr(plan_mod, "available_ram", lambda: 10 << 20)  # one process would not fit 10 MiB
    assert not any("--nproc-per-node" in w for w in plan(llama_2l, "--no-memory-check", world=2).warnings)


def test_too_few_micro_batches_is_a_warning(llama_2l):
    p = plan(llama_2l, "--num-micro-batches", "1", world=2)
    assert p.slots == 1 and "fewer than the 2 stages" in p.warnings[0] and not p.turns
    assert plan(llama_2l, world=2).warnings == []


def test_stages_with_more_threads_than_their_share_take_turns(llama_2l, monkeypatch):
    """Two stages of 2 threads on a 2-core node take turns with the cores (RunPlan.turns: no tail split,
    no warning about their one micro-batch); stages of one thread, or several threads within their
    share, or on a GPU-less pipeline of one stage, do not. The note before loading (big stages one
    process could hold) names the flags that make big one-thread stages take turns, and for stages that
    take turns the layout that holds up on a busy node."""
    from pipeline.config import plan as plan_mod

    p = plan(llama_2l, "--num-micro-batches", "1", "--num-threads", "2", world=2, cpus=2)
    assert p.turns and p.warnings == []
    assert not plan(llama_2l, "--num-threads", "1", world=2, cpus=2).turns
    assert not plan(llama_2l, "--num-threads", "2", world=2, cpus=4).turns
    assert not plan(llama_2l, "--num-threads", "2", cpus=1).turns  # P = 1
    monkeypatch.setattr(plan_mod, "BIG_STAGE_BYTES", 1)
    (note,) = [w for w in plan(llama_2l, "--num-threads", "1", world=2, cpus=2).warnings if "--nproc-per-node 1" in w]
    assert "--num-micro-batches 1 --num-threads 2" in note  # the flags that make them take turns
    (note,) = [w for w in plan(llama_2l, "--num-micro-batches", "1", "--num-threads", "2", world=2, cpus=2).warnings]
    assert "take turns" in note and "--num-threads 1 --num-micro-batches 2" in note  # and the busy node's layout


def test_big_stages_on_one_node_take_turns_by_default(llama_2l, monkeypatch):
    """Stages whose decode passes are bound by reading their weights, all on one CPU node: by default each
    takes its pipeline's share of the cores as threads and the pipeline keeps one micro-batch (turns), as
    --num-micro-batches 1 --num-threads <cores> would; small stages, stages on several nodes, one-core
    shares and flags that choose threads or several micro-batches keep the side-by-side layout."""
    import torch
    from pipeline.config import plan as plan_mod

    layout = lambda *flags, **kw: (lambda p: (p.threads, p.slots, p.turns))(plan(llama_2l, *flags, **kw))  # noqa: E731
    assert layout(world=2, cpus=2) == (1, 3, False)  # small stages: one thread each, P + 1
    monkeypatch.setattr(plan_mod, "BIG_STAGE_BYTES", 1)
    assert layout(world=2, cpus=2) == (2, 1, True)
    assert layout(world=2, cpus=8) == (8, 1, True)
    assert layout("--num-micro-batches", "1", world=2, cpus=4) == (4, 1, True)
    assert layout("--data-group-size", "2", world=4, cpus=8) == (4, 1, True)  # each pipeline its half
    assert layout("--data-group-size", "2", world=4, cpus=2) == (1, 2, False)  # one core a pipeline
    assert layout(world=2, local_world=1, cpus=2) == (1, 2, False)  # two nodes: side by side
    assert layout("--num-threads", "1", world=2, cpus=2) == (1, 2, False)
    assert layout("--num-micro-batches", "2", world=2, cpus=2) == (1, 2, False)
    assert layout(cpus=2) == (1, 1, False)  # P = 1 (a model this small: one thread)
    assert plan_mod.take_turns(2, 1, 2, 2, torch.device("cuda"), 1 << 40, 8) == 0  # GPUs: never


@pytest.mark.parametrize("flags, world, message", [
    (["--data-group-size", "3"], 2, "not a multiple of --data-group-size 3"),
    (["--num-layers", "1"], 1, "--num-layers 1 x 1 stages"),
    (["--infer-data", "/nonexistent.jsonl"], 1, "no such file"),
])
def test_mistakes_fail_before_anything_loads(llama_2l, flags, world, message):
    with pytest.raises(UsageError, match=message.replace("-", "\\-")):
        plan(llama_2l, *flags, world=world)


def test_num_layers_that_clip_the_last_stage_warn_with_the_layout(make_llama):
    model = make_llama(num_hidden_layers=4)
    p = plan(model, "--num-layers", "3", world=2)
    assert p.ranges == [(0, 3), (3, 4)]
    assert p.warnings == ["--num-layers 3 x 2 stages is more than the 4 layers: the last stage holds only 1 "
                          "(stage 0: layers 0-2, stage 1: layer 3); omit --num-layers for an even split (2, 2 layers)"]
    assert plan(model, "--num-layers", "2", world=2).warnings == []
    with pytest.raises(UsageError, match="leaves the last of 2 stages without layers"):
        plan(model, "--num-layers", "4", world=2)


def test_a_finished_output_of_another_run_is_refused_in_the_plan(llama_2l, make_llama, tmp_path):
    """What produced a complete output is in its summary's "run"; only a match is skipped (tested with
    real runs in test_reliability.py)."""
    src = tmp_path / "a.jsonl"
    src.write_text("{}\n")
    first = plan(llama_2l, "--infer-data", str(src))
    assert first.complete == [] and not first.nothing_to_do
    from tasks.files import input_fingerprint

    (tmp_path / "output_a.jsonl").write_text("{}\n")
    record = {"run": dict(first.fingerprint, input=input_fingerprint(src))}
    (tmp_path / "output_a.jsonl.summary.json").write_text(json.dumps(record))
    assert plan(llama_2l, "--infer-data", str(src)).nothing_to_do
    assert plan(llama_2l, "--infer-data", str(src), world=2, rank=1).nothing_to_do  # every rank knows
    assert not plan(llama_2l, "--infer-data", str(src), "--overwrite").nothing_to_do
    with pytest.raises(UsageError, match="batch_invariant: False there, True now"):
        plan(llama_2l, "--infer-data", str(src), "--batch-invariant")
    # flags that turn a request's error into an answer, or change a constrained answer, are other settings too
    for flags, changed in ((["--lenient-fields"], "lenient_fields: None there, True now"),
                           (["--json-string-max-length", "16"], "json_string_max_length: None there, 16 now")):
        with pytest.raises(UsageError, match=changed):
            plan(llama_2l, "--infer-data", str(src), *flags)


def test_an_output_that_cannot_be_written_fails_before_anything_loads(llama_2l, tmp_path, monkeypatch):
    """It failed after loading, with exit 1 and 'rerun the same command to resume'. (Root writes any
    folder: a read-only one is mimicked with os.access.)"""
    src = tmp_path / "a.jsonl"
    src.write_text('{"prompt": "x"}\n')
    with pytest.raises(UsageError, match=f"{src} is not a folder this user can write"):
        plan(llama_2l, "--infer-data", str(src), "--output-path", str(src / "out" / "o.jsonl"))
    monkeypatch.setattr("pipeline.config.plan.os.access", lambda path, mode: Path(path) != tmp_path)
    with pytest.raises(UsageError, match=f"{tmp_path} is not a folder this user can write"):
        plan(llama_2l, "--infer-data", str(src))  # beside the input, in a read-only folder
    monkeypatch.undo()
    assert plan(llama_2l, "--infer-data", str(src), "--output-path", str(tmp_path / "new" / "o.jsonl")).inputs


def test_two_inputs_of_one_name_under_one_output_folder_are_refused(llama_2l, tmp_path):
    """`--output-path DIR` names each output after its input's file name: two inputs of one name would
    overwrite (or resume) one another, so the plan refuses before anything loads."""
    for sub in ("a", "b"):
        (tmp_path / sub).mkdir()
        (tmp_path / sub / "q.jsonl").write_text('{"prompt": "x"}\n')
    env = {"RANK": "0", "WORLD_SIZE": "1"}
    with pytest.raises(UsageError, match=r"a/q.jsonl and .*b/q.jsonl would both write"):
        make_plan(parse_options(["--model-name", llama_2l, "--infer-data", str(tmp_path / "a" / "q.jsonl"),
                                 str(tmp_path / "b" / "q.jsonl"), "--output-path", str(tmp_path / "out")]), env=env)
    with pytest.raises(UsageError, match="would both write"):  # one file given twice
        make_plan(parse_options(["--model-name", llama_2l, "--infer-data", str(tmp_path / "a" / "q.jsonl"),
                                 str(tmp_path / "a" / "q.jsonl")]), env=env)
    # beside each input (no --output-path) they do not collide
    make_plan(parse_options(["--model-name", llama_2l, "--infer-data", str(tmp_path / "a" / "q.jsonl"),
                             str(tmp_path / "b" / "q.jsonl")]), env=env)
