"""The README and the docs pages, run command by command in order on a fresh copy of the repository,
as a new user would.

Every indented code block of README.md and of every docs/**/*.md page that holds a shell command is
preceded by a marker comment (invisible when rendered):

    <!-- readme-test: run [line N] [expect "TEXT"]... (note) -->   run the block (or only its line N)
    <!-- readme-test: skip (why) -->                                 do not run it

A command block without a marker fails the test, so a new command in the manual must be classified. The
runnable blocks run in the order of ``PAGES`` (the README first, then the docs pages; within a page
top to bottom), in one copy of the repository's tracked files, so a block may use what an earlier
block of its page or of an earlier page wrote; each must exit 0 and print every ``expect`` text.
A block runs in its own bash, except that a block of simple command lines (no shell syntax) runs line
by line, and its lines ``python dist_inference_runner.py ARGS`` run in this process: the runner's main
with those arguments, in the copy's folder, with the copy's default model (tests.utils.run_local, its
stdout, stderr and exit code as a process's), which saves a process start for each. The only changes
to the commands: ``/tmp/`` becomes a private folder and the fixed ports (29400, 29511; torchrun's
default 29500 through ``PET_MASTER_PORT``) become free ones, so concurrent test runs do not collide.
Scheduler submissions are skipped (tests/integration/test_launch.py runs the scripts with stub
srun/blaunch).

The pages' links and markers, without running anything: tests/unit/test_docs_pages.py.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.utils import REPO, free_port, read_jsonl, run_local

# Every page whose commands run, in the order they run. A new docs page must be added here (the test
# below fails otherwise). Dependencies: docs/usage/scale.md's blocks build on one another (split ->
# drain -> rerun over the folder -> merge) and are all on that page; the final assertions of
# test_commands_run_in_order name the files the pages leave behind.
PAGES = (
    "README.md",
    "docs/usage/default-model.md",
    "docs/usage/models.md",  # examples/output_requests_opt.jsonl
    "docs/usage/flags.md",
    "docs/usage/formats.md",
    "docs/usage/serve.md",
    "docs/usage/python-api.md",
    "docs/usage/from-vllm.md",
    "docs/usage/chat.md",
    "docs/usage/stage-sizes.md",
    "docs/usage/scale.md",  # local/legacy/dp/two-node outputs, queries/, merged_output.jsonl
    "docs/usage/lora.md",
    "docs/usage/quantization.md",
    "docs/usage/recovery.md",
    "docs/usage/monitoring.md",
    "docs/usage/gpus.md",
    "docs/usage/structured-outputs.md",
    "docs/usage/reasoning.md",  # examples/output_reasoning.jsonl
    "docs/design/architecture.md",
    "docs/design/scheduler.md",
    "docs/design/prefix-cache.md",
    "docs/design/chunked-prefill.md",
    "docs/design/attention-and-cpu-kernels.md",
    "docs/design/host-memory.md",
    "docs/design/gpu-notes.md",
    "docs/design/determinism.md",
    "docs/benchmarks.md",
    "docs/performance-log.md",
    "docs/testing.md",
)

MARKER = re.compile(r"<!-- readme-test: (run|skip)\b(.*?)-->")
COMMAND = re.compile(r"^(python|torchrun|pip|bash|for |[A-Z_]+=\S* |sbatch|bsub|launch/)")


@dataclass
class Block:
    line: int  # 1-based line of the page where the block starts
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


def page_blocks(root: Path = REPO) -> list[tuple[str, Block]]:
    """Every page's indented code blocks, pages in ``PAGES`` order, as (page, block)."""
    return [(page, b) for page in PAGES for b in readme_blocks((root / page).read_text())]


def fresh_copy(dest: Path) -> Path:
    """The repository's tracked files (as they are in the work tree), nothing else: a fresh clone."""
    files = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    for name in filter(None, files.decode().split("\0")):
        src = REPO / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    return dest


RUNNER_LINE = "python dist_inference_runner.py"


def steps(script: str) -> list[tuple[str, str]]:
    """How a block runs: ``[("bash", script)]``, or, when every line is a simple command (no shell syntax:
    pipes, redirections, variables, heredocs, loops, continuations), one step per line, ``("runner", line)``
    for the runner's own command lines and ``("bash", line)`` for the others."""
    lines = [x for x in script.splitlines() if x.strip()]

    def simple(line: str) -> bool:
        if "$" in line or "`" in line or line.rstrip().endswith("\\") or re.match(r"\s*(for|while|if)\b", line):
            return False
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        try:
            return not any(tok and set(tok) <= set("();<>|&") for tok in lexer)
        except ValueError:  # a quote that closes on a later line (python -c '...' over several lines)
            return False

    if not all(simple(x) for x in lines):
        return [("bash", script)]
    return [("runner" if x.startswith(RUNNER_LINE + " ") else "bash", x) for x in lines]


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git to list the tracked files")
def test_commands_run_in_order(tmp_path, monkeypatch):
    import pipeline.loading.default_model
    import tasks.progress

    repo = fresh_copy(tmp_path / "clone")
    private = tmp_path / "tmp"
    private.mkdir()
    bin_dir = Path(sys.executable).parent
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "PET_MASTER_PORT": str(free_port()),
           "DIST_INFER_PROGRESS_SECONDS": "600"}
    env.pop("DIST_INFER_FAULT", None)
    # the runner in this process as in the copy: its folder, its default model, the same progress interval
    monkeypatch.chdir(repo)
    monkeypatch.setattr(pipeline.loading.default_model, "SHIPPED_DIR", repo / "examples" / "tiny-llama-default")
    monkeypatch.setattr(tasks.progress, "LOG_EVERY", 600.0)
    ran = []
    for page, block in page_blocks(repo):
        if block.action != "run":
            continue
        lines = [block.text[block.only_line - 1]] if block.only_line else block.text
        script = "\n".join(lines).replace("/tmp/", f"{private}/")
        script = script.replace("127.0.0.1:29400", f"127.0.0.1:{free_port()}").replace("PORT=29511", f"PORT={free_port()}")
        said = ""
        for how, command in steps(script):
            if how == "runner":
                p = run_local(shlex.split(command)[2:])
            else:
                p = subprocess.run(["bash", "-euo", "pipefail", "-c", command], cwd=repo, env=env, capture_output=True,
                                   text=True, timeout=300)
            said += p.stdout + p.stderr
            shown = (f"{page}:{block.line} ({how}):\n{command}\n--- exit {p.returncode}\n{p.stdout[-2000:]}\n"
                     f"{p.stderr[-4000:]}")
            assert p.returncode == 0, shown
        for text in block.expect:
            assert text in said, f"expected {text!r}\n{page}:{block.line}:\n{script}\n{said[-4000:]}"
        ran.append((page, block.line))
    assert len(ran) >= 10
    # what the README and the docs pages say the commands leave behind
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
