"""Split a JSONL file of OpenAI-style completion requests into shards for the runner.

Each non-blank line (a request object, or an OpenAI Batch API line) is copied byte for byte (CRLF -> LF)
to ``<output-dir>/<engine>/request_<k>.jsonl``, engine being the request's ``engine``, else ``model``,
else ``default``, made safe as a folder name. Lines that are not usable requests go to shards of their own
under ``default``, where the runner answers them with an error result. ``manifest.json`` lists each
shard's line count, estimated tokens ((prompt + prompts * max_tokens) * max(n, best_of), a string
prompt counting len / 4) and input line numbers. docs/usage/scale.md shows it with launch/drain.sh.
"""

from __future__ import annotations

import argparse
import hashlib
import math
import re
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import orjson

from tasks.files import write_atomic

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
DEFAULT_ENGINE = "default"
INVALID = "invalid"  # group tag for lines passed through verbatim
MANIFEST = "manifest.json"
PARAM_KEYS = ("temperature", "top_p", "top_k", "n", "best_of", "logprobs", "echo", "stop")


@dataclass
class Record:
    """One non-blank input line: its raw bytes and what the splitter derived from it."""

    line_no: int  # 1-based line number in the input file
    raw: bytes  # line content without the line terminator
    engine: str = DEFAULT_ENGINE  # sanitized directory name
    group: tuple = (INVALID,)  # records with equal groups (and engine) may share a shard
    prompt_tokens: int = 0
    cost: int = 0  # estimated KV tokens: (prompt + max_tokens) * max(n, best_of)


@dataclass
class Shard:
    """One output file: relative path plus the records it holds, in output order."""

    engine: str
    path: str  # relative to the output dir, e.g. "opt-66b/request_0.jsonl"
    records: list[Record] = field(default_factory=list)


def sanitize_engine(name: object) -> str:
    """Turn an engine/model value into a safe directory name ("a/b" -> "a_b")."""
    if not isinstance(name, str) or not name.strip():
        return DEFAULT_ENGINE
    safe = re.sub(r"[^\w.\-]", "_", name.strip())
    if safe.startswith("."):  # no hidden dirs, no "." or ".."
        safe = "_" + safe[1:]
    if len(safe.encode()) > 200:  # a folder name is at most 255 bytes: a prefix, and a hash that keeps names apart
        safe = safe[:48] + "_" + hashlib.blake2b(name.encode(), digest_size=8).hexdigest()
    return safe + "_" if safe == MANIFEST else safe


def _int_or(value: object, default: int, minimum: int) -> int:
    """An integer field for estimates only; bad values (the runner reports them) use the default."""
    if isinstance(value, bool) or not isinstance(value, int):
        return default
    return max(value, minimum)


def _text_tokens(text: str) -> int:
    return math.ceil(len(text) / 4)


def prompt_token_estimate(prompt: object) -> tuple[int, int] | None:
    """(approx prompt tokens, number of prompts) for a completion prompt, None if unusable."""
    if isinstance(prompt, str):
        return _text_tokens(prompt), 1
    if not isinstance(prompt, list):
        return None
    if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return len(prompt), 1  # one prompt of token ids (or an empty list)
    if not all(isinstance(item, (str, list)) for item in prompt):  # a batch of prompts: strings or token-id lists
        return None
    return sum(_text_tokens(x) if isinstance(x, str) else len(x) for x in prompt), len(prompt)


def chat_token_estimate(messages: object) -> tuple[int, int] | None:
    """(approx tokens, 1) for a chat "messages" list, None if it is not a list of objects."""
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        return None
    total = 0
    for message in messages:
        content = message.get("content")
        for part in content if isinstance(content, list) else [content]:
            text = part.get("text") if isinstance(part, dict) else part
            total += _text_tokens(text) if isinstance(text, str) else 0
    return total, 1


def max_tokens_bucket(max_tokens: int, min_generate: int, chunk_size: int) -> int:
    """Bucket of similar generation length; chunk_size 0 disables bucketing."""
    return 0 if chunk_size <= 0 else max(0, math.ceil((max_tokens - min_generate) / chunk_size))


def parse_line(line_no: int, raw: bytes, args: argparse.Namespace) -> Record:
    """Classify one non-blank line; anything unusable becomes an INVALID record of "default"."""
    record = Record(line_no=line_no, raw=raw)
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return record
    batch_line = isinstance(obj, dict) and "body" in obj and ("url" in obj or "custom_id" in obj)
    request = obj["body"] if batch_line else obj
    if not isinstance(request, dict):
        return record
    if "prompt" in request:
        estimate = prompt_token_estimate(request["prompt"])
    else:
        estimate = chat_token_estimate(request.get("messages"))
    if estimate is None:
        return record
    prompt_tokens, num_prompts = estimate
    max_tokens = _int_or(request.get("max_tokens", request.get("max_completion_tokens")), DEFAULT_MAX_TOKENS, 0)
    samples = max(_int_or(request.get("n"), 1, 1), _int_or(request.get("best_of"), 1, 1))
    bucket = max_tokens_bucket(max_tokens, args.min_generate_token, args.generate_token_chunk_size)
    params = orjson.dumps([request.get(k) for k in PARAM_KEYS], option=orjson.OPT_SORT_KEYS) \
        if args.group_by_params else b""
    return Record(line_no, raw, sanitize_engine(request.get("engine") or request.get("model")), ("ok", bucket, params),
                  prompt_tokens, (prompt_tokens + num_prompts * max_tokens) * samples)


def read_records(path: Path, args: argparse.Namespace) -> tuple[list[Record], int]:
    """All non-blank lines of the input as records, plus the number of blank lines skipped."""
    data = path.read_bytes()
    if data.startswith(b"\xef\xbb\xbf"):  # UTF-8 BOM would make line 1 invalid JSON
        data = data[3:]
    lines = data.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()  # the final newline does not start another line
    lines = [raw.removesuffix(b"\r") for raw in lines]
    records = [parse_line(line_no, raw, args) for line_no, raw in enumerate(lines, start=1) if raw.strip()]
    return records, len(lines) - len(records)


def plan_shards(records: list[Record], requests_per_shard: int | None,
                tokens_per_shard: int | None, sort_by_length: bool = False) -> list[Shard]:
    """Group records by (engine, group) and cut each group into shards under both caps (a request above
    the token cap alone). Groups go per engine by bucket, then first appearance; invalid lines last."""
    groups: dict[tuple[str, tuple], list[Record]] = {}
    for record in records:
        groups.setdefault((record.engine, record.group), []).append(record)
    order = sorted(groups, key=lambda k: (k[0], k[1][0] == INVALID, k[1][1:2]))  # stable sort
    shards: list[Shard] = []
    made: Counter = Counter()  # shards per engine so far
    for engine, group in order:
        shard, tokens = None, 0
        for record in groups[(engine, group)]:
            if shard is None or (requests_per_shard is not None and len(shard.records) >= requests_per_shard) \
                    or (tokens_per_shard is not None and tokens + record.cost > tokens_per_shard):
                shard, tokens = Shard(engine, f"{engine}/request_{made[engine]}.jsonl"), 0
                made[engine] += 1
                shards.append(shard)
            shard.records.append(record)
            tokens += record.cost
    if sort_by_length:
        for shard in shards:
            shard.records.sort(key=lambda r: (r.prompt_tokens, r.line_no))
    return shards


def write_shards(out_dir: Path, shards: list[Shard]) -> None:
    """Write every shard file, one raw line each, newline-terminated."""
    for shard in shards:
        path = out_dir / shard.path
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"".join(r.raw + b"\n" for r in shard.records))


def check_invariant(out_dir: Path, records: list[Record], shards: list[Shard]) -> list[str]:
    """Every non-blank input line is in exactly one shard, and the files on disk agree."""
    problems = []
    planned = sorted(r.line_no for s in shards for r in s.records)
    if planned != [r.line_no for r in records]:
        problems.append(f"shards hold {len(planned)} lines, input has {len(records)} non-blank")
    written = 0
    for shard in shards:
        path = out_dir / shard.path
        count = path.read_bytes().count(b"\n") if path.exists() else 0
        if count != len(shard.records):
            problems.append(f"{shard.path}: {count} lines on disk, expected {len(shard.records)}")
        written += count
    if written != len(records):
        problems.append(f"wrote {written} lines for {len(records)} non-blank input lines")
    return problems


def write_manifest(out_dir: Path, args: argparse.Namespace, records, blank, shards) -> None:
    """manifest.json: totals, options, then one line per shard (path, lines, tokens, line numbers)."""
    skip = ("input_file", "output_dir", "overwrite")
    head = {
        "input_file": str(args.input_file),
        "input_lines": len(records),
        "blank_lines_skipped": blank,
        "invalid_lines": sum(r.group[0] == INVALID for r in records),
        "options": {k: v for k, v in vars(args).items() if k not in skip},
    }
    rows = [orjson.dumps({"path": s.path, "engine": s.engine, "lines": len(s.records),
                          "estimated_tokens": sum(r.cost for r in s.records),
                          "line_numbers": [r.line_no for r in s.records]}) for s in shards]
    text = orjson.dumps(head)[:-1] + b',"shards":[\n' + b",\n".join(rows) + b"\n]}\n"
    write_atomic(out_dir / MANIFEST, text)


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _positive_int(text: str) -> int:
    if (value := _non_negative_int(text)) == 0:
        raise argparse.ArgumentTypeError("must be >= 1, got 0")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--input-file", type=Path, required=True, help="JSONL request file")
    parser.add_argument("--output-dir", type=Path, required=True,
                        help="shards go to <output-dir>/<engine>/request_<k>.jsonl")
    parser.add_argument("--requests-per-shard", type=_positive_int, metavar="N",
                        help="at most N requests per shard")
    parser.add_argument("--tokens-per-shard", type=_positive_int, metavar="N",
                        help="at most N estimated tokens per shard (a bigger request goes alone)")
    parser.add_argument("--min-generate-token", type=_non_negative_int, default=0, metavar="N",
                        help="max_tokens <= N form bucket 0 (default 0)")
    parser.add_argument("--generate-token-chunk-size", type=_non_negative_int, default=0,
                        metavar="N", help="bucket width in max_tokens above the minimum; "
                        "shards never mix buckets (default 0: no bucketing)")
    parser.add_argument("--group-by-params", action="store_true",
                        help="only requests with identical " + ", ".join(PARAM_KEYS)
                        + " share a shard")
    parser.add_argument("--sort-by-length", action="store_true",
                        help="order each shard by estimated prompt length (runner output follows)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace shards and manifest left in --output-dir by an earlier run")
    return parser


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; returns the process exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.input_file.is_file():
        parser.error(f"--input-file {args.input_file} does not exist or is not a file")
    out_dir: Path = args.output_dir
    if out_dir.exists() and not out_dir.is_dir():
        parser.error(f"--output-dir {out_dir} exists and is not a directory")

    records, blank = read_records(args.input_file, args)  # read fully before deleting anything
    # files an earlier run may have left: <engine>/request_<k>.jsonl and the manifest
    old = sorted(out_dir.glob("*/request_*.jsonl")) + sorted(out_dir.glob(MANIFEST))
    if args.input_file.resolve() in {p.resolve() for p in old}:
        parser.error(f"--input-file {args.input_file} is one of the shards in --output-dir")
    if old and not args.overwrite:
        print(f"split_queries: {out_dir} already holds {len(old)} shard/manifest files "
              f"(e.g. {old[0]}); pass --overwrite to replace them", file=sys.stderr)
        return 1
    for path in old:  # stale shards would otherwise be drained by a shard loop
        path.unlink()
    out_dir.mkdir(parents=True, exist_ok=True)

    shards = plan_shards(records, args.requests_per_shard, args.tokens_per_shard,
                         args.sort_by_length)
    write_shards(out_dir, shards)
    if problems := check_invariant(out_dir, records, shards):
        print("split_queries: ERROR, line count invariant failed:\n  " + "\n  ".join(problems),
              file=sys.stderr)
        return 1
    write_manifest(out_dir, args, records, blank, shards)

    per_engine = ", ".join(f"{e}={n}" for e, n in Counter(s.engine for s in shards).items())
    invalid = sum(r.group[0] == INVALID for r in records)
    print(f"split_queries: {len(records)} lines ({blank} blank skipped, {invalid} invalid passed "
          f"through) -> {len(shards)} shards in {out_dir}: {per_engine}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
