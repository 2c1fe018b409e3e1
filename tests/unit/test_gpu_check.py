"""bench/gpu_check.py's own logic, without models: the agreement rule, each part's isolation and time
limit, the wheels line and its 8-minute estimate (tests/integration/test_gpu_check.py runs it whole)."""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

import pytest

from bench import gpu_check, gpu_check_parts
from bench.gpu_check_models import MAX_FLOOR, Sample, verdict


def sample(errors, reference, diverged_at=None, gap=None) -> Sample:
    return Sample(list(errors), list(reference), diverged_at, gap)


def test_verdict_accepts_what_transformers_itself_shows_and_near_ties():
    same = [sample([0.01, 0.02], [0.012, 0.02]), sample([0.015], [0.01])]
    v = verdict(same)
    assert v["ok"] and v["equal_prompts"] == 2 and v["tokens"] == 3
    assert v["max_tolerance"] == pytest.approx(3 * 0.02 + MAX_FLOOR)
    tie = [*same, sample([0.01], [0.01], diverged_at=4, gap=0.005)]  # a swap between two choices 0.005 apart
    assert verdict(tie)["ok"] and verdict(tie)["divergences"] == [{"prompt": 2, "step": 4, "tie_gap": 0.005}]


@pytest.mark.parametrize("bad", [
    [sample([0.2], [0.01])],  # far above transformers' error
    [sample([0.01] * 9 + [0.03], [0.002] * 10)],  # the mean error 5x transformers'
    [sample([0.01], [0.01], diverged_at=3, gap=0.5)],  # different tokens where the model was decisive
    [sample([0.01], [0.01], diverged_at=3, gap=None)],  # one ended where the other went on
    [sample([float("nan")], [0.01])],
])
def test_verdict_rejects(bad):
    assert not verdict(bad)["ok"]


def test_a_wider_factor_for_kernels_that_round_activations():
    s = [sample([0.02], [0.01])]
    assert not verdict(s)["ok"] and verdict(s, factor=2.0)["ok"]


@pytest.fixture
def only_parts(monkeypatch, tmp_path):
    """main() over fake parts (the environment part runs for real: no install without --wheels). The memory
    given back after each part is left alone: a full collection in this test process takes ~0.6 s."""
    def run(parts: dict, limit: float = 300) -> tuple[int, dict]:
        monkeypatch.setattr(gpu_check_parts, "PARTS", parts)
        monkeypatch.setattr(gpu_check_parts, "free_memory", lambda: None)
        monkeypatch.setattr(gpu_check, "CPU_SECONDS", {**gpu_check.CPU_SECONDS, **{n: (1, limit) for n in parts}})
        code = gpu_check.main(["--device", "cpu", "--out", str(tmp_path), "--parts", ",".join(parts)])
        return code, json.loads((tmp_path / "gpu_check.json").read_text())
    return run


def test_a_failing_part_is_recorded_and_the_next_runs(only_parts, capsys):
    def broken(ck):
        raise RuntimeError("no kernel image is available for execution on the device")

    code, report = only_parts({"a": broken, "b": lambda ck: {"ok": True, "headline": "fine", "x": 1},
                               "c": lambda ck: {"ok": False, "failures": ["c: 2 tokens differ"]}})
    parts = report["parts"]
    assert code == 1 and list(parts) == ["environment", "a", "b", "c"]
    assert parts["a"]["status"] == "error" and "no kernel image" in parts["a"]["error"]
    assert any("broken" in line for line in parts["a"]["traceback"])
    assert parts["b"]["status"] == "passed" and parts["b"]["x"] == 1
    assert parts["c"]["status"] == "failed" and parts["c"]["failures"] == ["c: 2 tokens differ"]
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("gpu_check: FAIL 2/4 parts") and "b fine" in last and "a error" in last


def test_a_part_over_its_limit_is_stopped(only_parts):
    def slow(ck):
        time.sleep(30)
        return {"ok": True}

    t0 = time.monotonic()
    code, report = only_parts({"slow": slow, "next": lambda ck: {"ok": True}}, limit=1)
    assert time.monotonic() - t0 < 20
    assert report["parts"]["slow"]["status"] == "timed out" and report["parts"]["next"]["status"] == "passed"


def test_the_gpu_run_fits_eight_minutes_by_its_own_estimate():
    expected, most = gpu_check.estimate(["environment", *gpu_check_parts.PARTS], gpu=True)
    assert expected < most <= 8 * 60


def test_the_wheels_line_names_what_a_gpu_machine_lacks():
    line = gpu_check.pip_download_command("wheels")
    assert line.startswith("python -m pip download --dest wheels --only-binary=:all: --python-version 3.12")
    for name in gpu_check.GPU_MISSING:
        assert f'"{name}>=' in line  # with requirements.txt's specifier
    assert "--platform manylinux_2_31_x86_64" in line  # llguidance's wheels


def test_missing_requirements_are_reported(monkeypatch):
    real = gpu_check.metadata.version
    monkeypatch.setattr(gpu_check.metadata, "version", lambda name: (_ for _ in ()).throw(
        gpu_check.metadata.PackageNotFoundError(name)) if name == "orjson" else real(name))
    status = gpu_check.requirement_status()
    assert status["orjson"] == {"required": ">=3.8", "installed": None, "ok": False}
    assert status["torch"]["ok"]


def test_the_docs_show_the_wheels_line_the_script_prints():
    page = (gpu_check.REPO / "docs" / "usage" / "gpus.md").read_text()
    assert gpu_check.pip_download_command("wheels") in page
    assert 'python3 bench/gpu_check.py --wheels wheels --out "$OUT"' in page


def test_wheels_install_without_network_and_into_a_folder_where_the_environment_is_read_only(monkeypatch, tmp_path):
    calls = []

    def pip(cmd, **kw):  # the environment's site-packages refuses; --target works (no process is started)
        calls.append(cmd)
        return SimpleNamespace(returncode=1 if len(calls) == 1 else 0, stdout="", stderr="Permission denied")

    monkeypatch.setattr("bench.gpu_check.subprocess.run", pip)
    monkeypatch.setattr(gpu_check.sys, "path", list(gpu_check.sys.path))
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    done = gpu_check.install_wheels(tmp_path / "wheels", ["orjson", "fastapi"], tmp_path)
    assert all({"--no-index", "--find-links", str(tmp_path / "wheels"), "orjson>=3.8", "fastapi>=0.110"} <= set(c)
               for c in calls)
    assert "--target" not in calls[0] and calls[1][calls[1].index("--target") + 1] == str(tmp_path / "site")
    assert done["exit_code"] == 0 and done["into"] == str(tmp_path / "site")
    assert gpu_check.sys.path[0] == str(tmp_path / "site")
    assert gpu_check.os.environ["PYTHONPATH"] == f"{tmp_path / 'site'}:/elsewhere"  # the P = 2 worker finds them too
