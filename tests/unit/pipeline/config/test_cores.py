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
    env = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}
    assert make_plan(parse_options(["--model-name", llama_2l]), env=env).threads == 2
