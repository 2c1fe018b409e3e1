"""The scheduler's sizes resolved once from the options (pipeline/config/pass_sizes.py)."""

from __future__ import annotations

from types import SimpleNamespace

from pipeline.config.components import PREFILL_TOKENS
from pipeline.config.options import AUTO_PREFILL_CHUNK, parse_options
from pipeline.config.pass_sizes import pass_prefill_tokens, pass_scoring_tokens, prefill_chunk, prefix_block, \
    scheduler_config
from pipeline.models.families import DecoderSpec


def decoder_plan(slots: int = 3):
    """A plan whose model is a native decoder (no longrope): what the sizes read of it."""
    spec = object.__new__(DecoderSpec)  # only its type and rope are read
    object.__setattr__(spec, "rope", None)
    return SimpleNamespace(spec=spec, slots=slots, turns=False)


def test_pass_sizes_by_pipeline_and_device():
    assert pass_prefill_tokens(1) == PREFILL_TOKENS and pass_prefill_tokens(2) == 2048
    assert pass_prefill_tokens(2, gpu=True) == PREFILL_TOKENS
    assert pass_scoring_tokens(2) == 256 and pass_scoring_tokens(1) == PREFILL_TOKENS
    assert pass_scoring_tokens(3, gpu=True) == PREFILL_TOKENS


def test_chunk_and_block_follow_the_options():
    p = decoder_plan()
    opts = parse_options([])
    assert prefill_chunk(p, opts, 1) == 0 and prefill_chunk(p, opts, 2) == AUTO_PREFILL_CHUNK["cpu"]
    assert prefill_chunk(p, opts, 2, gpu=True) == AUTO_PREFILL_CHUNK["cuda"]
    assert prefill_chunk(p, parse_options(["--prefill-chunk", "40"]), 1) == 40
    assert prefill_chunk(SimpleNamespace(spec=object()), parse_options(["--prefill-chunk", "40"]), 1) == 0
    assert prefix_block(p, opts) == opts.prefix_block_size
    assert prefix_block(p, parse_options(["--prefix-cache", "off"])) == 0


def test_scheduler_config_from_options():
    p = decoder_plan()
    c = scheduler_config(p, parse_options(["--max-micro-batch-size", "16"]), 2, False, 5000)
    assert (c.budget, c.num_slots, c.max_rows, c.prefill_tokens, c.scoring_tokens, c.chunk, c.stages, c.serve) == (
        5000, 3, 16, 2048, 256, AUTO_PREFILL_CHUNK["cpu"], 2, False)
    assert scheduler_config(p, parse_options(["--serve", "8000"]), 1, False, 5000).serve
    assert not c.turns and scheduler_config(SimpleNamespace(**{**vars(p), "turns": True}), parse_options([]), 2, False,
                                            5000).turns
