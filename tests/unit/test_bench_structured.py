"""bench/structured.py's files (no processes): the free twin of each constrained row, free rows left
alone, and the interleaved order of the measured copies."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("bench_structured", REPO / "bench" / "structured.py")
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)


def lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_mixed_file_constrains_every_other_row(tmp_path):
    rows = lines(bench.mixed_file(tmp_path, 9, 12))
    assert len(rows) == 9
    for i, row in enumerate(rows):
        constrained = "response_format" in row or "structured_outputs" in row
        assert constrained == (i % 2 == 1)
        assert row["max_tokens"] == 12 and row["temperature"] == 0


def test_free_twins_end_where_the_constrained_rows_did(tmp_path):
    mixed = bench.mixed_file(tmp_path, 6, 16)
    source = lines(mixed)
    lengths = [3, 5, 2, 7, 4, 1]
    by_length = lines(bench.free_file(tmp_path, mixed, lengths))
    texts = ["a b", "x" * 300, "", ' {"k": 1}', "q", ""]
    by_text = lines(bench.free_file(tmp_path, mixed, lengths, texts))
    for i, (src, first, final) in enumerate(zip(source, by_length, by_text)):
        if i % 2 == 0:  # a free row: the same request in every file
            assert first == src and final == src
            continue
        assert "response_format" not in final and "structured_outputs" not in final
        assert first["max_tokens"] == lengths[i] and "stop" not in first
        if texts[i].strip() and len(texts[i]) <= 256:  # its own text ends it; the scheduler sees max_tokens
            assert final["stop"] == [texts[i]] and final["max_tokens"] == 16
        else:  # no usable text: its exact length
            assert final["max_tokens"] == lengths[i] and "stop" not in final


def test_copies_interleave_abba_after_a_warm_up_pair(tmp_path):
    mixed, free = tmp_path / "m.jsonl", tmp_path / "f.jsonl"
    mixed.write_text("M\n")
    free.write_text("F\n")
    files = bench.interleaved(tmp_path, mixed, free, 3)
    assert [k for k, _ in files] == ["mixed", "free", "free", "mixed", "mixed", "free", "free", "mixed"]
    assert len({p for _, p in files}) == 8  # each copy its own output
    assert all(p.read_text() == ("M\n" if k == "mixed" else "F\n") for k, p in files)
