"""Tests for split_queries.py: round trip, caps, bucketing, naming, bad lines, flags, overwrite."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

import split_queries as sq

DATA = Path(__file__).resolve().parents[1] / "data"  # copies of ../shared/data
DATA_FILES = sorted(DATA.glob("*.jsonl"))
assert DATA_FILES, f"no request files in {DATA}"  # committed: none means a broken checkout


def write_jsonl(path: Path, lines: list[object | str]) -> Path:
    """Objects are dumped with orjson; strings are written verbatim (bad lines, blanks)."""
    text = [x if isinstance(x, str) else orjson.dumps(x).decode() for x in lines]
    path.write_text("\n".join(text) + "\n", encoding="utf-8")
    return path


def run(tmp_path: Path, inp: Path, *flags: str, out: str = "out") -> tuple[int, Path]:
    out_dir = tmp_path / out
    code = sq.main(["--input-file", str(inp), "--output-dir", str(out_dir), *flags])
    return code, out_dir


def load_manifest(out_dir: Path) -> dict:
    return orjson.loads((out_dir / "manifest.json").read_bytes())


def assert_round_trip(inp: Path, out_dir: Path) -> dict:
    """Every non-blank input line is in exactly one shard, byte-identical, where the manifest says."""
    lines = inp.read_bytes().split(b"\n")
    expected = {i: ln.removesuffix(b"\r") for i, ln in enumerate(lines, 1) if ln.strip()}
    manifest = load_manifest(out_dir)
    seen: dict[int, bytes] = {}
    for shard in manifest["shards"]:
        shard_lines = (out_dir / shard["path"]).read_bytes().split(b"\n")
        assert shard_lines.pop() == b""  # newline-terminated
        assert len(shard_lines) == shard["lines"] == len(shard["line_numbers"])
        for line_no, content in zip(shard["line_numbers"], shard_lines, strict=True):
            assert line_no not in seen
            seen[line_no] = content
    assert seen == expected
    assert manifest["input_lines"] == len(expected)
    return manifest


def shard_objects(out_dir: Path) -> dict[str, list[dict]]:
    return {
        s["path"]: [orjson.loads(x) for x in (out_dir / s["path"]).read_bytes().splitlines()]
        for s in load_manifest(out_dir)["shards"]
    }


@pytest.mark.parametrize("data_file", DATA_FILES, ids=lambda p: p.name)
@pytest.mark.parametrize("flags", [
    [],
    ["--requests-per-shard", "7", "--sort-by-length"],
    ["--tokens-per-shard", "2000", "--generate-token-chunk-size", "8", "--group-by-params"],
])
def test_round_trip_shared_data(tmp_path, data_file, flags):
    code, out_dir = run(tmp_path, data_file, *flags)
    assert code == 0
    assert_round_trip(data_file, out_dir)


def test_bad_lines_file(tmp_path):
    inp = DATA / "bad_lines.jsonl"
    code, out_dir = run(tmp_path, inp, "--requests-per-shard", "3")
    assert code == 0
    manifest = assert_round_trip(inp, out_dir)
    assert manifest["blank_lines_skipped"] >= 1
    assert manifest["invalid_lines"] >= 3  # not JSON, unterminated, array, no prompt
    assert {s["engine"] for s in manifest["shards"]} == {"default"}


def test_deterministic(tmp_path):
    inp = write_jsonl(tmp_path / "in.jsonl", [
        {"prompt": "x" * (i * 13 % 50), "max_tokens": i % 9, "temperature": i % 3 / 2,
         "engine": ["a", "b/c"][i % 2]} for i in range(40)
    ] + ["garbage"])
    flags = ["--tokens-per-shard", "60", "--generate-token-chunk-size", "4", "--group-by-params",
             "--sort-by-length"]
    _, out1 = run(tmp_path, inp, *flags, out="o1")
    _, out2 = run(tmp_path, inp, *flags, out="o2")
    files1 = sorted(p.relative_to(out1) for p in out1.rglob("*") if p.is_file())
    assert files1 == sorted(p.relative_to(out2) for p in out2.rglob("*") if p.is_file())
    for rel in files1:  # shards and manifest alike (the manifest does not name the output dir)
        assert (out1 / rel).read_bytes() == (out2 / rel).read_bytes()


def test_prompt_estimates():
    assert sq.prompt_token_estimate("abcde") == (2, 1)  # ceil(5 / 4)
    assert sq.prompt_token_estimate("") == (0, 1)
    assert sq.prompt_token_estimate([5, 6, 7]) == (3, 1)
    assert sq.prompt_token_estimate(["abcd", "abcdefgh"]) == (3, 2)
    assert sq.prompt_token_estimate([[1, 2], [3]]) == (3, 2)
    assert sq.prompt_token_estimate(None) is None
    assert sq.prompt_token_estimate([{"a": 1}]) is None


def test_cost_formula(tmp_path):
    args = sq.build_parser().parse_args(["--input-file", "x", "--output-dir", "y"])
    rec = sq.parse_line(1, orjson.dumps({"prompt": "a" * 40, "max_tokens": 5, "n": 2,
                                         "best_of": 3}), args)
    assert rec.cost == (10 + 5) * 3
    rec = sq.parse_line(2, b'{"prompt": [1, 2, 3, 4]}', args)  # max_tokens defaults to 16
    assert rec.cost == 4 + 16
    rec = sq.parse_line(3, b'{"prompt": "p", "max_tokens": "ten", "n": 0}', args)
    assert rec.group[0] != sq.INVALID and rec.cost == 1 + 16  # the runner reports these


def test_token_cap_respected(tmp_path):
    reqs = [{"prompt": "x" * (4 * (i % 7 + 1)), "max_tokens": 10} for i in range(30)]
    reqs.insert(12, {"prompt": "y" * 4000, "max_tokens": 10})  # 1010 tokens, above the cap
    inp = write_jsonl(tmp_path / "in.jsonl", reqs)
    code, out_dir = run(tmp_path, inp, "--tokens-per-shard", "60")
    assert code == 0
    manifest = assert_round_trip(inp, out_dir)
    for shard in manifest["shards"]:
        assert shard["estimated_tokens"] <= 60 or shard["lines"] == 1
    big = [s for s in manifest["shards"] if s["estimated_tokens"] > 60]
    assert [s["line_numbers"] for s in big] == [[13]] and big[0]["estimated_tokens"] == 1010
    assert sum(s["estimated_tokens"] for s in manifest["shards"]) == sum(
        (len(r["prompt"]) // 4 + 10) for r in reqs)


def test_requests_per_shard(tmp_path):
    inp = write_jsonl(tmp_path / "in.jsonl", [{"prompt": str(i)} for i in range(10)])
    code, out_dir = run(tmp_path, inp, "--requests-per-shard", "4")
    assert code == 0
    manifest = assert_round_trip(inp, out_dir)
    assert [s["lines"] for s in manifest["shards"]] == [4, 4, 2]
    assert [s["path"] for s in manifest["shards"]] == [
        f"default/request_{k}.jsonl" for k in range(3)]


def test_bucketing_by_max_tokens(tmp_path):
    max_tokens = [1, 100, 8, 9, 16, 17, 40, 0, 24]
    inp = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "p", "max_tokens": m} for m in max_tokens])
    code, out_dir = run(tmp_path, inp, "--min-generate-token", "8",
                        "--generate-token-chunk-size", "8")
    assert code == 0
    assert_round_trip(inp, out_dir)
    groups = [sorted(r["max_tokens"] for r in objs) for objs in shard_objects(out_dir).values()]
    # bucket = max(0, ceil((m - 8) / 8)): {0,1,8} {9,16} {17,24} {40} {100}, in bucket order
    assert groups == [[0, 1, 8], [9, 16], [17, 24], [40], [100]]
    assert sq.max_tokens_bucket(100, 8, 0) == 0


def test_chunk_size_zero_means_no_bucketing(tmp_path):
    inp = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "p", "max_tokens": m} for m in (1, 500)])
    code, out_dir = run(tmp_path, inp, "--generate-token-chunk-size", "0",
                        "--min-generate-token", "3")
    assert code == 0
    assert [s["lines"] for s in load_manifest(out_dir)["shards"]] == [2]


def test_group_by_params(tmp_path):
    reqs = [{"prompt": str(i), "temperature": [0, 0.7][i % 2], "stop": ["\n"] if i < 4 else None}
            for i in range(8)]
    inp = write_jsonl(tmp_path / "in.jsonl", reqs)
    _, plain = run(tmp_path, inp, out="plain")
    assert len(load_manifest(plain)["shards"]) == 1  # off by default
    code, out_dir = run(tmp_path, inp, "--group-by-params", out="grouped")
    assert code == 0
    assert_round_trip(inp, out_dir)
    for objs in shard_objects(out_dir).values():
        assert len({(r["temperature"], str(r.get("stop"))) for r in objs}) == 1
    assert len(load_manifest(out_dir)["shards"]) == 4


def test_sort_by_length(tmp_path):
    inp = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "x" * n} for n in (40, 4, 400, 4, 12)])
    code, out_dir = run(tmp_path, inp, "--sort-by-length")
    assert code == 0
    (shard,) = load_manifest(out_dir)["shards"]
    assert shard["line_numbers"] == [2, 4, 5, 1, 3]
    assert_round_trip(inp, out_dir)


def test_engine_naming_and_sanitizing(tmp_path):
    reqs = [
        {"prompt": "a", "engine": "opt-66b", "model": "ignored"},
        {"prompt": "b", "model": "together/tiny-llama"},
        {"prompt": "c"},
        {"custom_id": "r1", "method": "POST", "url": "/v1/completions",
         "body": {"model": "org/model", "prompt": "d"}},
        {"custom_id": "r2", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": "org/model", "messages": [{"role": "user", "content": "hi"}]}},
    ]
    inp = write_jsonl(tmp_path / "in.jsonl", reqs)
    code, out_dir = run(tmp_path, inp)
    assert code == 0
    manifest = assert_round_trip(inp, out_dir)
    assert {s["path"]: s["line_numbers"] for s in manifest["shards"]} == {
        "default/request_0.jsonl": [3],
        "opt-66b/request_0.jsonl": [1],
        "org_model/request_0.jsonl": [4, 5],
        "together_tiny-llama/request_0.jsonl": [2],
    }
    assert sq.sanitize_engine("../etc") == "_._etc"
    assert sq.sanitize_engine("a\\b c") == "a_b_c"
    assert sq.sanitize_engine(None) == sq.sanitize_engine(7) == sq.sanitize_engine("") == "default"
    assert sq.sanitize_engine("manifest.json") != "manifest.json"
    # a folder name is at most 255 bytes (a longer "model" stopped the split with a traceback), and distinct
    long = ["x" * 300, "x" * 299, "модель" * 50]
    assert all(len(sq.sanitize_engine(n).encode()) <= 255 for n in long) and len(set(map(sq.sanitize_engine, long))) == 3
    inp = write_jsonl(tmp_path / "long.jsonl", [{"prompt": "a", "model": n} for n in long])
    assert run(tmp_path, inp, out="long")[0] == 0


def test_invalid_and_blank_lines(tmp_path):
    lines = ["", '{"prompt": "ok", "max_tokens": 2, "engine": "e"}', "not json", "   ",
             "[1, 2]", '{"max_tokens": 3}', '{"prompt": null}', '{"prompt": "x", ',
             '{"custom_id": "c", "url": "/v1/completions", "body": "nope"}', "\t"]
    inp = write_jsonl(tmp_path / "in.jsonl", lines)
    code, out_dir = run(tmp_path, inp, "--tokens-per-shard", "100")
    assert code == 0
    manifest = assert_round_trip(inp, out_dir)
    assert manifest["blank_lines_skipped"] == 3 and manifest["invalid_lines"] == 6
    by_path = {s["path"]: s["line_numbers"] for s in manifest["shards"]}
    assert by_path == {"default/request_0.jsonl": [3, 5, 6, 7, 8, 9], "e/request_0.jsonl": [2]}


def test_crlf_and_bom(tmp_path):
    inp = tmp_path / "in.jsonl"
    inp.write_bytes(b'\xef\xbb\xbf{"prompt": "a"}\r\n\r\n{"prompt": "b"}')  # no final newline
    code, out_dir = run(tmp_path, inp)
    assert code == 0
    (shard,) = load_manifest(out_dir)["shards"]
    assert shard["line_numbers"] == [1, 3]
    assert (out_dir / shard["path"]).read_bytes() == b'{"prompt": "a"}\n{"prompt": "b"}\n'


def test_empty_input(tmp_path):
    inp = write_jsonl(tmp_path / "in.jsonl", ["", ""])
    code, out_dir = run(tmp_path, inp)
    assert code == 0
    assert load_manifest(out_dir)["shards"] == []


@pytest.mark.parametrize("flags", [
    ["--requests-per-shard", "0"],
    ["--requests-per-shard", "abc"],
    ["--tokens-per-shard", "-5"],
    ["--tokens-per-shard", "1.5"],
    ["--generate-token-chunk-size", "-1"],
    ["--min-generate-token", "-3"],
    ["--min-generate-token", ""],
])
def test_bad_flag_values(tmp_path, capsys, flags):
    inp = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "p"}])
    with pytest.raises(SystemExit) as exc:
        run(tmp_path, inp, *flags)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "error: argument " + flags[0] in err and "Traceback" not in err


def test_missing_input_file(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        run(tmp_path, tmp_path / "nope.jsonl")
    assert exc.value.code == 2
    assert "does not exist" in capsys.readouterr().err


def test_overwrite(tmp_path, capsys):
    inp = write_jsonl(tmp_path / "in.jsonl", [{"prompt": str(i)} for i in range(6)])
    assert run(tmp_path, inp, "--requests-per-shard", "1")[0] == 0
    out_dir = tmp_path / "out"
    (out_dir / "notes.txt").write_text("user file")
    before = (out_dir / "default" / "request_5.jsonl").read_bytes()

    code, _ = run(tmp_path, inp, "--requests-per-shard", "3")
    assert code == 1 and "--overwrite" in capsys.readouterr().err
    assert (out_dir / "default" / "request_5.jsonl").read_bytes() == before  # untouched

    code, _ = run(tmp_path, inp, "--requests-per-shard", "3", "--overwrite")
    assert code == 0
    assert sorted(p.name for p in (out_dir / "default").iterdir()) == [
        "request_0.jsonl", "request_1.jsonl"]  # stale shards 2..5 removed
    assert (out_dir / "notes.txt").read_text() == "user file"
    assert_round_trip(inp, out_dir)


def test_existing_dir_without_shards_is_fine(tmp_path):
    inp = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "p"}])
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "README").write_text("hi")
    assert run(tmp_path, inp)[0] == 0


def test_invariant_check(tmp_path, monkeypatch, capsys):
    inp = write_jsonl(tmp_path / "in.jsonl", [{"prompt": str(i)} for i in range(5)])

    def lossy_write(out_dir: Path, shards: list[sq.Shard]) -> None:
        shards[0].records.pop()  # simulate a bug that drops a line
        real_write(out_dir, shards)

    real_write = sq.write_shards
    monkeypatch.setattr(sq, "write_shards", lossy_write)
    code, out_dir = run(tmp_path, inp)
    assert code == 1
    assert "invariant" in capsys.readouterr().err
    assert not (out_dir / "manifest.json").exists()

    records = [sq.Record(line_no=i, raw=b"{}") for i in (1, 2)]
    shard = sq.Shard(engine="default", path="default/request_0.jsonl", records=records)
    (tmp_path / "o2" / "default").mkdir(parents=True)
    (tmp_path / "o2" / "default" / "request_0.jsonl").write_bytes(b"{}\n")  # one line short
    assert sq.check_invariant(tmp_path / "o2", records, [shard])
    (tmp_path / "o2" / "default" / "request_0.jsonl").write_bytes(b"{}\n{}\n")
    assert sq.check_invariant(tmp_path / "o2", records, [shard]) == []
