"""The kernel table (--kernel-table): a choice measured once per kind of machine and read by every later
run, whatever a later timing says; ranks loading at once measure a shape once; a stale entry is measured
again; a bad file is refused before loading. And two identical --quantize int8 runs on a machine whose
timings are noise give identical outputs."""

from __future__ import annotations

import itertools
import json
import random
import threading
from pathlib import Path

import pytest
import torch

from pipeline.config.options import check_options, RunOptions
from pipeline.models.kernels import int8
from pipeline.models.kernels.int8 import Int8Linear, choose_kernels
from pipeline.models.kernels.kernel_table import KernelTable, default_path, machine
from tests.unit.pipeline.models.kernels.test_int8 import peaked  # noqa: F401 (fixture)
from tests.utils import read_jsonl, run_inprocess, write_jsonl


def _layers() -> torch.nn.Sequential:
    model = torch.nn.Sequential(Int8Linear(32, 64, False), Int8Linear(64, 32, True))
    for m in model:
        m.load_float(torch.randn(m.out_features, m.in_features))
        if m.bias is not None:
            m.bias.data.zero_()
    return model


def _timings(monkeypatch, fastest: str) -> None:
    """A timer that says ``fastest`` wins by far."""
    monkeypatch.setattr(int8, "median_times", lambda fns, **_: {k: (0.1 if k == fastest else 1.0) for k in fns})


def test_a_choice_is_measured_once_then_read(tmp_path, monkeypatch):
    path = tmp_path / "table.json"
    _timings(monkeypatch, "dequantize")
    first = KernelTable(path)
    chosen = choose_kernels(_layers(), torch.float32, (4, 16), first)
    assert {c["kernel"] for c in chosen.values()} == {"dequantize"}
    assert first.summary() == {"path": str(path), "kept": 0, "measured": 2}
    stored = json.loads(path.read_text())
    assert stored["machine"] == machine()
    assert set(stored["entries"]) == {"int8/cpu/float32/32x64", "int8/cpu/float32/64x32"}
    _timings(monkeypatch, "int8")  # a later run's timings disagree: the table's choice stands
    again, model = KernelTable(path), _layers()
    assert {c["kernel"] for c in choose_kernels(model, torch.float32, (4, 16), again).values()} == {"dequantize"}
    assert again.summary()["kept"] == 2 and again.summary()["measured"] == 0
    assert all(m.kernel == "dequantize" for m in model)
    assert json.loads(path.read_text()) == stored  # nothing written when nothing changed


def test_an_entry_whose_kernel_does_not_run_here_is_measured_again(tmp_path, monkeypatch):
    path = tmp_path / "table.json"
    path.write_text(json.dumps({"entries": {"int8/cpu/float32/32x64": {"kernel": "no-such-kernel"},
                                            "int8/cpu/float32/64x32": {"kernel": "dequantize", "rows": [1]}}}))
    _timings(monkeypatch, "int8")
    table = KernelTable(path)
    chosen = choose_kernels(_layers(), torch.float32, (4,), table)
    assert chosen["32x64"]["kernel"] == "int8" and chosen["64x32"] == {"kernel": "dequantize", "rows": [1]}
    assert (table.kept, table.measured) == (1, 1)
    assert json.loads(path.read_text())["entries"]["int8/cpu/float32/32x64"]["kernel"] == "int8"


def test_ranks_loading_at_once_measure_a_shape_once(tmp_path):
    """Two loaders (threads here; ranks of one node in a run) reach the same missing entry together: the
    lock lets one measure, the other reads its entry."""
    path, measured, start = tmp_path / "table.json", [], threading.Barrier(2)

    def measure():
        measured.append(threading.current_thread().name)
        return {"kernel": random.choice(["a", "b", "c", "d"]), "ms": {}}

    got = {}

    def load(name):
        start.wait()
        got[name] = KernelTable(path).choose("k", lambda kernel: True, measure)["kernel"]

    threads = [threading.Thread(target=load, args=(n,), name=n) for n in ("r0", "r1")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(measured) == 1 and got["r0"] == got["r1"]


def test_the_default_table_is_per_machine_in_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DIST_INFER_CACHE", str(tmp_path))
    p = default_path()
    assert p.parent == tmp_path / "kernels" and p.name.startswith("kernel-table-") and p == KernelTable().path
    monkeypatch.setattr("pipeline.models.kernels.kernel_table.machine", lambda: {"cpu": "another"})
    assert default_path() != p


def test_a_file_that_is_not_a_table_is_refused_before_loading(tmp_path):
    bad = tmp_path / "notes.json"
    bad.write_text("[1, 2]")
    assert any("--kernel-table" in p and "not a kernel table" in p for p in check_options(RunOptions(kernel_table=str(bad))))
    assert not any("--kernel-table" in p for p in check_options(RunOptions(kernel_table=str(tmp_path / "new.json"))))


def test_identical_int8_runs_give_identical_outputs_whatever_the_timings(peaked, tmp_path, monkeypatch):  # noqa: F811
    """Two identical --quantize int8 runs, each timing its kernels afresh (a new table each) on a timer
    that returns noise, as on a busy machine: the kernels picked differ between the runs, the outputs
    are byte for byte the same; the summary names the table and its kernels."""
    rng = random.Random(0)
    monkeypatch.setattr(int8, "median_times", lambda fns, **_: {k: rng.random() for k in fns})
    reqs = [{"prompt": p, "max_tokens": 12, "temperature": t, "seed": i, "logprobs": 2}
            for i, (p, t) in enumerate(itertools.product(["once upon a time", "the quick brown fox", "hello"],
                                                         [0, 0.8]))]
    data = write_jsonl(tmp_path / "req.jsonl", reqs)
    outs, kernels = [], []
    for run in range(4):
        out = tmp_path / f"out{run}.jsonl"
        assert run_inprocess(["--model-name", peaked, "--infer-data", data, "--output-path", str(out), "--no-progress",
                              "--quantize", "int8", "--kernel-table", str(tmp_path / f"table{run}.json")]) == 0
        summary = json.loads(Path(f"{out}.summary.json").read_text())
        (precision,) = summary["stage_precision"]
        assert precision["kernel_table"] == {"path": str(tmp_path / f"table{run}.json"), "kept": 0,
                                             "measured": len(precision["kernels"])}
        kernels.append(precision["kernels"])
        outs.append([{k: v for k, v in line["result"].items() if k not in ("id", "created", "request_time")}
                     for line in read_jsonl(out)])
    assert len({json.dumps(k, sort_keys=True) for k in kernels}) > 1  # the noise really picked other kernels
    assert all(o == outs[0] for o in outs)


def test_weight_only_kernels_keep_the_table_choice(tmp_path, monkeypatch):
    """A pre-quantized checkpoint's kernels round differently, so the table's choice is what every run
    uses: measured once (here int4pack where it runs), then kept against later timings."""
    from pipeline.models.kernels import weight_only
    from pipeline.models.kernels.weight_only import IntWeight, QuantLinear

    gen = torch.Generator().manual_seed(0)

    def layer():
        m = QuantLinear(128, 64, False, 4, 32)
        m.load(IntWeight(torch.randint(0, 16, (64, 128), generator=gen, dtype=torch.uint8),
                         torch.rand(64, 4, generator=gen) / 50, torch.full((64, 4), 8.0), 4, 32))
        return torch.nn.Sequential(m)

    path = tmp_path / "table.json"
    monkeypatch.setattr(weight_only, "median_times", lambda fns, **_: {k: (0.1 if k != "dequantize" else 1.0) for k in fns})
    first = weight_only.choose_kernels(layer(), torch.float32, (4,), KernelTable(path))["128x64"]["kernel"]
    entries = json.loads(path.read_text())["entries"]
    assert list(entries) == ["weight-only/cpu/float32/128x64/int4/g32"] and entries[list(entries)[0]]["kernel"] == first
    monkeypatch.setattr(weight_only, "median_times", lambda fns, **_: {k: (0.1 if k == "dequantize" else 1.0) for k in fns})
    model = layer()
    assert weight_only.choose_kernels(model, torch.float32, (4,), KernelTable(path))["128x64"]["kernel"] == first
    assert model[0].kernel == first
    assert weight_only.choose_kernels(layer(), torch.float32, (4,))["128x64"]["kernel"] == "dequantize"  # no table
