"""Recorded outputs of the shared request files, to catch an unintended change of results.

``tests/data/golden/`` holds a tiny Llama (weights and tokenizer committed, so every machine loads
the same numbers) and what the runner answered on ``tests/data/*.jsonl`` at P = 1 and P = 2 when
they were recorded. tests/integration/test_golden.py reruns the files and compares with
``assert_consistent_results``: tokens and texts equal, logprobs within 1e-4, except where float
rounding decides a near-tie (the rules of tests.utils). Record again only when a change of results
is intended, and say why in the commit:

    python -m tests.golden --record
"""

from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path

from tests.utils import DATA, local_tokenizer, read_jsonl, run_single, run_torchrun

GOLDEN = DATA / "golden"
MODEL = GOLDEN / "model"
FILES = sorted(p.name for p in DATA.glob("*.jsonl"))
STAGES = (1, 2)


def build_model(out: Path = MODEL) -> Path:
    """The committed model: 2 layers (one per stage at P = 2), GQA, hidden 32."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = local_tokenizer()
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(7)
    model = LlamaForCausalLM(cfg).eval()
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def run_files(out_dir: Path, stages: int) -> dict[str, list[dict]]:
    """The runner on every shared file at P = ``stages``: {file name: output lines}."""
    args = ["--model-name", str(MODEL), "--infer-data", *[str(DATA / f) for f in FILES], "--output-path",
            str(out_dir), "--no-progress", "--num-threads", "1"]
    p = run_single(args) if stages == 1 else run_torchrun(args, stages)
    assert p.returncode == 0, p.stderr[-3000:]
    return {f: read_jsonl(out_dir / f"output_{f}") for f in FILES}


def recorded(stages: int) -> dict[str, list[dict]]:
    with gzip.open(GOLDEN / f"outputs-p{stages}.json.gz", "rt") as f:
        return json.load(f)


def record() -> None:
    import tempfile

    if not MODEL.exists():
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
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).add_argument("--record", action="store_true")
    record()
