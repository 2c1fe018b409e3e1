"""The README, run command by command in order on a fresh copy of the repository, as a new user would.

Every indented code block of README.md that holds a shell command is preceded by a marker comment
(invisible when rendered):

    <!-- readme-test: run [line N] [expect "TEXT"]... (note) -->   run the block (or only its line N)
    <!-- readme-test: skip (why) -->                                 do not run it

A command block without a marker fails the test, so a new README command must be classified. The
runnable blocks run in README order, each in its own bash, in a copy of the repository's tracked
files; each must exit 0 and print every ``expect`` text. The only changes to the commands:
``/tmp/`` becomes a private folder and the fixed ports (29400, 29511; torchrun's default 29500
through ``PET_MASTER_PORT``) become free ones, so concurrent test runs do not collide. Scheduler
submissions are skipped (tests/test_launch.py runs the scripts with stub srun/blaunch).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.utils import REPO, free_port, read_jsonl

MARKER = re.compile(r"<!-- readme-test: (run|skip)\b(.*?)-->")
COMMAND = re.compile(r"^(python|torchrun|pip|bash|for |[A-Z_]+=\S* |sbatch|bsub|launch/)")


@dataclass
class Block:
    line: int  # 1-based line of the README where the block starts
    text: list[str]
    action: str | None = None  # run | skip | None (no marker)
    only_line: int | None = None
    expect: list[str] = field(default_factory=list)


def readme_blocks(text: str) -> list[Block]:
    """The indented code blocks, each with the marker comment just before it (if any)."""
    lines = text.splitlines()
    blocks, i = [], 0
    while i < len(lines):
        if lines[i].startswith("    ") and (i == 0 or not lines[i - 1].strip()):
            start = i
            while i < len(lines) and lines[i].startswith("    "):
                i += 1
            block = Block(start + 1, [x[4:] for x in lines[start:i]])
            j = start - 1
            while j >= 0 and not lines[j].strip():
                j -= 1
            m = MARKER.search(lines[j]) if j >= 0 else None
            if m:
                block.action = m.group(1)
                rest = m.group(2)
                n = re.search(r"\bline (\d+)", rest)
                block.only_line = int(n.group(1)) if n else None
                block.expect = re.findall(r'expect "([^"]*)"', rest)
            blocks.append(block)
        else:
            i += 1
    return blocks


def is_command(block: Block) -> bool:
    return bool(COMMAND.match(block.text[0]))


def test_every_readme_command_block_is_marked():
    blocks = [b for b in readme_blocks((REPO / "README.md").read_text()) if is_command(b)]
    unmarked = [f"README.md:{b.line}: {b.text[0]}" for b in blocks if b.action is None]
    assert unmarked == [], "mark these with <!-- readme-test: run --> or <!-- readme-test: skip (why) -->"
    assert sum(b.action == "run" for b in blocks) >= 10


def fresh_copy(dest: Path) -> Path:
    """The repository's tracked files (as they are in the work tree), nothing else: a fresh clone."""
    files = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    for name in filter(None, files.decode().split("\0")):
        src = REPO / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    return dest


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git to list the tracked files")
def test_readme_commands_run_in_order(tmp_path):
    repo = fresh_copy(tmp_path / "clone")
    private = tmp_path / "tmp"
    private.mkdir()
    bin_dir = Path(sys.executable).parent
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "PET_MASTER_PORT": str(free_port()),
           "DIST_INFER_PROGRESS_SECONDS": "600"}
    env.pop("DIST_INFER_FAULT", None)
    ran = []
    for block in readme_blocks((repo / "README.md").read_text()):
        if block.action != "run":
            continue
        lines = [block.text[block.only_line - 1]] if block.only_line else block.text
        script = "\n".join(lines).replace("/tmp/", f"{private}/")
        script = script.replace("127.0.0.1:29400", f"127.0.0.1:{free_port()}").replace("PORT=29511", f"PORT={free_port()}")
        p = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=repo, env=env, capture_output=True,
                           text=True, timeout=300)
        shown = f"README.md:{block.line}:\n{script}\n--- exit {p.returncode}\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}"
        assert p.returncode == 0, shown
        for text in block.expect:
            assert text in p.stdout + p.stderr, f"expected {text!r}\n{shown}"
        ran.append(block.line)
    assert len(ran) >= 10
    # what the README says the commands leave behind
    quick = read_jsonl(repo / "examples" / "output_requests.jsonl")
    opt = read_jsonl(repo / "examples" / "output_requests_opt.jsonl")
    assert len(quick) == len(opt) == 6 and quick[0]["result"]["model"] != opt[0]["result"]["model"]
    merged = read_jsonl(repo / "merged_output.jsonl")
    requests = read_jsonl(repo / "examples" / "requests.jsonl")
    assert [x["request"] for x in merged] == requests
    for name in ("local_output.jsonl", "legacy_output.jsonl", "dp_output.jsonl", "two_node_output.jsonl"):
        assert len(read_jsonl(repo / name)) == 6, name
    assert (repo / "dp_output.jsonl.summary.json").exists()
    assert sorted(p.name for p in (repo / "queries" / "jobs" / "default").glob("request_*.jsonl")) == \
        [f"request_{k}.jsonl" for k in range(6)]
