"""The run summary's per-stage memory breakdown (``stage_memory_mb``, pipeline/runtime/memory.py) on
the default model at P = 1 (float32: the layers' weights prepacked for oneDNN) and P = 2 (bfloat16:
cast while loading, the head's float32 block buffer): each stage's weights equal its checkpoint
tensors' bytes in the run's dtype, computed here from the safetensors header, and the named parts add
up to the measured peak RSS within a tolerance."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from pipeline.models.kernels import native
from tests.utils import REPO, RUNNER, _env, _kill_group, free_port, llama_stage_tensors, write_jsonl

pytestmark = pytest.mark.multiprocess

MODEL = REPO / "examples" / "tiny-llama-default"
MIB = 2**20
PARTS = ("process", "weights", "packed", "adapters", "kv_cache", "prefix_pool", "buffers", "other")


def checkpoint_bytes(layers: range, has_embed: bool, has_head: bool, itemsize: int) -> int:
    """Bytes a stage holding ``layers`` keeps in a dtype of ``itemsize`` bytes, from the checkpoint's own
    tensor shapes; a tied head (no lm_head.weight stored) is the embedding table: once if the stage
    also embeds, else its own copy."""
    with safe_open(str(MODEL / "model.safetensors"), "pt") as f:
        shapes = {name: f.get_slice(name).get_shape() for name in f.keys()}
    names = set().union(*(llama_stage_tensors(i, has_embed, has_head) for i in layers))
    if has_head and "lm_head.weight" not in shapes:
        names = (names - {"lm_head.weight"}) | {"model.embed_tokens.weight"}
    total = 0
    for name in names:
        n = 1
        for d in shapes[name]:
            n *= d
        total += n * itemsize
    return total


def launch(tmp: Path, stages: int, extra: list[str]) -> tuple[subprocess.Popen, Path]:
    """Start a file-mode run of ``stages`` ranks (torchrun for P > 1, gloo on loopback)."""
    data = write_jsonl(tmp / f"req-{stages}.jsonl", [
        {"prompt": f"Request {i}: the stages hold their weights and", "max_tokens": 8, "temperature": 0.0}
        for i in range(4)])
    out = tmp / f"out-{stages}.jsonl"
    args = ["--model-name", str(MODEL), "--infer-data", data, "--output-path", str(out), "--no-progress",
            "--max-micro-batch-size", "2", "--timeout", "120", *extra]
    start = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(stages), "--master-addr",
             "127.0.0.1", "--master-port", str(free_port())] if stages > 1 else [sys.executable]
    proc = subprocess.Popen([*start, str(RUNNER), *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, env=_env(None), start_new_session=True)
    return proc, out


def summaries(runs: list[tuple[subprocess.Popen, Path]]) -> list[dict]:
    """Wait for the runs (side by side: the test lasts as long as the longer one) and read their summaries."""
    try:
        for proc, _ in runs:
            _, err = proc.communicate(timeout=240)
            assert proc.returncode == 0, err[-3000:]
    finally:
        for proc, _ in runs:
            _kill_group(proc)
    return [json.loads(Path(str(out) + ".summary.json").read_text()) for _, out in runs]


def check_stage(m: dict, expected_weights: int) -> None:
    print(m)
    assert m["device"] == "cpu"
    assert all(m[k] >= 0 for k in PARTS), m
    assert abs(m["weights"] - expected_weights / MIB) <= 0.051, (m["weights"], expected_weights / MIB)
    assert m["rss_peak"] >= m["rss_ready"] >= m["process"]
    named = sum(m[k] for k in PARTS if k != "other")
    # What no tensor account sees lands in ``other``: gloo's buffers, the activations of the largest
    # pass and the heap glibc keeps after it, the loader's temporaries (the tokenizer is loaded before
    # the account starts). On this tiny model that is tens of MiB (10-30 measured on a 2-core x86 VM)
    # beside a process of ~310 MiB, so
    # a bound of max(15% of the peak, 100 MiB) holds on any machine while a part counted twice or
    # missed by the size of the process or the weights would not.
    assert abs(m["rss_peak"] - named) <= max(0.15 * m["rss_peak"], 100), m


def test_the_breakdown_of_each_stage_adds_up_to_its_peak_rss(tmp_path):
    one, two = summaries([launch(tmp_path, 1, ["--budget", "2048"]),
                          launch(tmp_path, 2, ["--dtype", "bfloat16", "--layers-per-stage", "2,4", "--budget", "2048"])])
    [m] = one["stage_memory_mb"]
    check_stage(m, checkpoint_bytes(range(6), True, True, 4))  # float32, the tied table once
    # the same measure, read a moment apart (the writer's close between them)
    assert abs(one["last_rank_peak_rss_mb"] - m["rss_peak"]) <= 5  # read a moment apart, each by its own rule
    assert m["kv_cache"] > 0

    first, last = two["stage_memory_mb"]
    check_stage(first, checkpoint_bytes(range(0, 2), True, False, 2))
    check_stage(last, checkpoint_bytes(range(2, 6), False, True, 2))  # the head's own copy of the table
    assert first["kv_cache"] > 0 and last["kv_cache"] > 0
    # the head's float32 block buffer (8192 vocabulary rows x 128 x 4 bytes) where the head casts its bf16 table a
    # block at a time; none where the native bf16 loop reads the table as it is stored (AVX512-BF16)
    bf16 = torch.empty(1, 128, dtype=torch.bfloat16)
    assert last["buffers"] == 0 if native.bf16_usable(bf16, bf16) else last["buffers"] >= 4.0
