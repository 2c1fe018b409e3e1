"""Recorded outputs of the shared request files, to catch an unintended change of results.

``tests/data/golden/`` holds a tiny Llama (weights and tokenizer committed, so every machine loads
the same numbers) and what the runner answered on ``tests/data/*.jsonl`` at P = 1, 2 and 3 when
they were recorded. tests/runs/test_golden_runs.py reruns the files in one process at each P
(``--in-process``), tests/integration/test_launch.py once through torchrun at P = 2
(launch/local_torchrun.sh), and both compare with
``assert_consistent_results``: tokens and texts equal, logprobs within 1e-4, except where float
rounding decides a near-tie (the rules of tests.utils). Record again only when a change of results
is intended, and say why in the commit:

    python -m tests.golden --record

``--new-weights`` draws the model's weights again first (its config in :func:`build_model`), keeping
the committed tokenizer (a vocabulary of 4096).
"""

from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path

from tests.utils import DATA, local_tokenizer, read_jsonl, run_local

GOLDEN = DATA / "golden"
MODEL = GOLDEN / "model"
FILES = sorted(p.name for p in DATA.glob("*.jsonl"))
STAGES = (1, 2, 3)


def build_model(out: Path = MODEL) -> Path:
    """The committed model: 3 layers (one per stage at P = 3), GQA, hidden 32; the tokenizer already in
    ``out`` (else the local one, saved beside the weights)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    kept = (out / "tokenizer.json").exists()
    tok = AutoTokenizer.from_pretrained(out) if kept else local_tokenizer()
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(7)
    model = LlamaForCausalLM(cfg).eval()
    model.save_pretrained(out)
    if not kept:
        tok.save_pretrained(out)
    return out


def run_files(out_dir: Path, stages: int) -> dict[str, list[dict]]:
    """The runner on every shared file at P = ``stages``, in this process: {file name: output lines}."""
    args = ["--model-name", str(MODEL), "--infer-data", *[str(DATA / f) for f in FILES], "--output-path",
            str(out_dir), "--no-progress", "--num-threads", "1"]
    p = run_local(args, stages)
    assert p.returncode == 0, p.stderr[-3000:]
    return {f: read_jsonl(out_dir / f"output_{f}") for f in FILES}


def recorded(stages: int) -> dict[str, list[dict]]:
    with gzip.open(GOLDEN / f"outputs-p{stages}.json.gz", "rt") as f:
        return json.load(f)


def record(new_weights: bool = False) -> None:
    import tempfile

    if new_weights or not MODEL.exists():
        build_model()
    for stages in STAGES:
        outs = run_files(Path(tempfile.mkdtemp()), stages)
        with gzip.open(GOLDEN / f"outputs-p{stages}.json.gz", "wt") as f:
            json.dump(_rounded(outs), f, separators=(",", ":"))


def _rounded(x):
    """Floats to 6 decimals (5e-7 is far inside the 1e-4 the comparison allows): a smaller file."""
    if isinstance(x, float):
        return round(x, 6)
    if isinstance(x, dict):
        return {k: _rounded(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_rounded(v) for v in x]
    return x


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--record", action="store_true", required=True)
    parser.add_argument("--new-weights", action="store_true", help="draw the model's weights again first")
    record(parser.parse_args().new_weights)
