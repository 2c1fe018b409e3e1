"""The cores a process may use: its affinity mask and its cgroup's CPU quota (v1 and v2, at its own cgroup
and at the root a container sees), never more than the mask, at least one."""

from __future__ import annotations

import os

import pytest

from pipeline.config import cores
from pipeline.config.cores import cgroup_cpu_quota, usable_cores


def tree(tmp_path, files: dict[str, str], proc: str):
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    (tmp_path / "proc_cgroup").write_text(proc)
    return tmp_path / "fs", tmp_path / "proc_cgroup"


@pytest.mark.parametrize("files, proc, quota", [
    ({}, "0::/\n", None),  # nothing to read: no quota
    ({"fs/cpu.max": "max 100000\n"}, "0::/\n", None),
    ({"fs/cpu.max": "200000 100000\n"}, "0::/\n", 2.0),  # docker --cpus 2 (v2, the container's root)
    ({"fs/cpu.max": "max 100000\n", "fs/job/step/cpu.max": "150000 100000\n"}, "0::/job/step\n", 1.5),
    ({"fs/cpu.max": "400000 100000\n", "fs/job/cpu.max": "max 100000\n"}, "0::/job\n", 4.0),  # the smallest
    ({"fs/cpu/cpu.cfs_quota_us": "-1\n", "fs/cpu/cpu.cfs_period_us": "100000\n"}, "1:cpu:/\n0::/\n", None),
    ({"fs/cpu,cpuacct/k8s/pod/cpu.cfs_quota_us": "50000\n", "fs/cpu,cpuacct/k8s/pod/cpu.cfs_period_us": "100000\n"},
     "4:cpu,cpuacct:/k8s/pod\n0::/\n", 0.5),  # v1 with joined controllers, a Kubernetes limit of 500m
    ({"fs/cpu.max": "garbage\n"}, "0::/\n", None),  # unreadable: as if none
    ({"fs/cpu.max": "100000 0\n"}, "0::/\n", None),
])
def test_cgroup_quota(tmp_path, files, proc, quota):
    assert cgroup_cpu_quota(*tree(tmp_path, files, proc)) == quota


@pytest.mark.parametrize("mask, files, want", [
    (8, {}, 8),  # no quota: the affinity mask (taskset, a Slurm step's cpuset)
    (8, {"fs/cpu.max": "200000 100000\n"}, 2),  # the quota caps it
    (8, {"fs/cpu.max": "250000 100000\n"}, 3),  # 2.5 CPUs of time: 3 threads keep them busy
    (8, {"fs/cpu.max": "50000 100000\n"}, 1),  # half a CPU: still one
    (2, {"fs/cpu.max": "1600000 100000\n"}, 2),  # a quota above the mask does not add cores
])
def test_usable_cores(tmp_path, monkeypatch, mask, files, want):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(mask)), raising=False)
    assert usable_cores(*tree(tmp_path, files, "0::/\n")) == want


def test_without_an_affinity_mask_the_cpu_count(tmp_path, monkeypatch):
    def missing(pid):
        raise OSError("not here")

    monkeypatch.setattr(os, "sched_getaffinity", missing, raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 6)
    assert usable_cores(*tree(tmp_path, {}, "0::/\n")) == 6


def test_the_default_thread_count_divides_the_usable_cores(monkeypatch, llama_2l):
    """--num-threads' default: usable cores / local ranks (a pinned job of 4 cores on a big node: 2 each
    at P = 2, not the node's count / 2)."""
    from pipeline.config.options import parse_options
    from pipeline.config.plan import make_plan

    monkeypatch.setattr(cores.os, "sched_getaffinity", lambda pid: set(range(4)), raising=False)
    monkeypatch.setattr(cores.os, "cpu_count", lambda: 128)
    monkeypatch.setattr(cores, "cgroup_cpu_quota", lambda *a: None)
    monkeypatch.setattr(cores, "SMALL_LAYER_WEIGHTS", 0)  # llama_2l is tiny: see the next test
    env = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}
    assert make_plan(parse_options(["--model-name", llama_2l]), env=env).threads == 2


def test_a_tiny_model_runs_on_one_thread_by_default(monkeypatch, llama_2l):
    """Layers of a few hundred thousand weights take microseconds a product: one thread by default, the
    share of the cores otherwise; --num-threads always wins."""
    from pipeline.config.options import parse_options
    from pipeline.config.plan import make_plan

    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"}
    assert make_plan(parse_options(["--model-name", llama_2l]), env=env, cpu_count=8).threads == 1
    assert make_plan(parse_options(["--model-name", llama_2l, "--num-threads", "3"]), env=env, cpu_count=8).threads == 3
    assert cores.layer_weights({"hidden_size": 64, "intermediate_size": 128}) == 4 * 64 * 64 + 3 * 64 * 128
    assert cores.layer_weights({"n_embd": 768}) == 4 * 768 * 768 + 3 * 768 * 3072 and cores.layer_weights({}) is None
    assert cores.default_threads(8, 2, cores.layer_weights({"hidden_size": 2048, "intermediate_size": 5632})) == 4
    assert cores.default_threads(8, 2, cores.SMALL_LAYER_WEIGHTS - 1) == 1
    assert cores.default_threads(8, 2, None) == 4 and cores.default_threads(1, 4, None) == 1


def test_openmp_threads_wait_passively_unless_the_user_says_otherwise():
    """The runner sets OMP_WAIT_POLICY=PASSIVE before torch loads libgomp (which reads it once), unless
    any wait variable of an OpenMP runtime is set already."""
    import ast
    from pathlib import Path

    from pipeline.config.openmp import passive_waits

    env = {}
    assert passive_waits(env) == "OMP_WAIT_POLICY=PASSIVE" and env == {"OMP_WAIT_POLICY": "PASSIVE"}
    for own in ({"OMP_WAIT_POLICY": "ACTIVE"}, {"GOMP_SPINCOUNT": "10000"}, {"KMP_BLOCKTIME": "0"}):
        env = dict(own)
        assert passive_waits(env) == " ".join(f"{k}={v}" for k, v in own.items()) and env == own
    # in the entry script, the call comes before the first import that can load torch (only os, logging,
    # sys, time, pathlib, typing and the openmp module itself before it)
    tree = ast.parse((Path(__file__).resolve().parents[4] / "dist_inference_runner.py").read_text())
    before = []
    for node in tree.body:
        if isinstance(node, ast.Assign) and "passive_waits" in ast.unparse(node.value):
            break
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            before += [node.module] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
    else:
        raise AssertionError("dist_inference_runner.py does not call passive_waits()")
    assert set(before) <= {"__future__", "os", "signal", "functools", "logging", "sys", "threading", "time", "pathlib",
                           "typing", "pipeline.config.openmp"}  # the standard library only
