"""The flags reference (docs/usage/flags.md) and the README's table of the most used flags say what
``--help`` says: the same flags both ways, the same choices and the same defaults.

Fast: the argparse parser is built in-process (``pipeline.config.options.build_parser``, which the entry
script uses); tests/runs/test_cli_runs.py checks that the entry's ``--help`` lists exactly those flags. The
runner commands written in the README and the docs pages use only flags that exist.
"""

from __future__ import annotations

import argparse
import re

import pytest

from pipeline.config.options import build_parser
from tests.integration.test_readme import PAGES, readme_blocks
from tests.utils import REPO

FLAGS_PAGE = REPO / "docs" / "usage" / "flags.md"
FLAG = re.compile(r"--[a-z][a-z0-9-]*")


def split_row(line: str) -> list[str]:
    """A markdown table row's cells (``\\|`` inside a cell is a literal bar)."""
    cells = re.split(r"(?<!\\)\|", line.strip().strip("|"))
    return [c.strip().replace("\\|", "|") for c in cells]


def flag_rows(path) -> list[tuple[list[str], str, str]]:
    """(flags, metavar text of the first flag, default cell) of each row of the page's flag tables."""
    rows = []
    for line in path.read_text().splitlines():
        if not line.startswith("| `--"):
            continue
        first, default = split_row(line)[:2]
        spans = re.findall(r"`([^`]*)`", first)
        flags = [FLAG.match(s).group() for s in spans if FLAG.match(s)]
        metavar = spans[0][len(flags[0]):].strip()
        rows.append((flags, metavar, default.strip("`").strip()))
    return rows


def parser_actions() -> dict[str, argparse.Action]:
    return {o: a for a in build_parser()._actions for o in a.option_strings if o.startswith("--") and o != "--help"}


def test_flags_page_and_help_list_the_same_flags():
    documented = [f for flags, _, _ in flag_rows(FLAGS_PAGE) for f in flags]
    assert len(documented) == len(set(documented)), "a flag with two rows"
    actions = parser_actions()
    assert sorted(set(actions) - set(documented)) == [], f"flags in --help without a row in {FLAGS_PAGE.name}"
    assert sorted(set(documented) - set(actions)) == [], f"rows of {FLAGS_PAGE.name} for flags --help does not have"


def literal(cell: str):
    """The value a default cell states, or None when it describes one computed at run time."""
    if cell in ("off", "none"):
        return False
    if m := re.fullmatch(r"(\d+)(?: (MiB|GiB|MB))?(?: = .*| \(.*\))?", cell):
        return int(m.group(1)) * {"MiB": 2**20, "GiB": 2**30, "MB": 10**6, None: 1}[m.group(2)]
    if re.fullmatch(r"[a-z0-9_]+", cell) and cell not in ("all",):
        return cell
    return None


def same_default(cell: str, action: argparse.Action) -> bool:
    value = literal(cell)
    if value is None:  # computed at run time ("from config.json", "even split", ...): no fixed default
        return action.default in (None, 0)
    if value is False:
        return action.default in (False, None, "off", "none")
    return action.default == value


@pytest.mark.parametrize("page", [FLAGS_PAGE, REPO / "README.md"], ids=["flags.md", "README.md"])
def test_defaults_and_choices_match_help(page):
    actions = parser_actions()
    wrong = []
    rows = flag_rows(page)
    assert rows, f"no flag table in {page.name}"
    for flags, metavar, default in rows:
        assert all(f in actions for f in flags), f"{page.name}: {flags} not in --help"
        cells = [c.strip() for c in default.split(",")]
        if len(cells) == len(flags):
            pairs = list(zip(flags, cells))
        else:  # one value for the row: the first flag's, or for every flag one computed at run time
            pairs = [(f, default) for f in (flags if literal(default) is None else flags[:1])]
        wrong += [f"{f}: {c!r} against {actions[f].default!r}" for f, c in pairs if not same_default(c, actions[f])]
        choices = actions[flags[0]].choices
        if "|" in metavar and choices is not None:
            if set(metavar.split("|")) != set(choices):
                wrong.append(f"{flags[0]}: {metavar} against choices {sorted(choices)}")
    assert wrong == [], f"{page.name} says other defaults or choices than --help"


def test_readme_flags_agree_with_the_flags_page():
    full = {flags[0]: default for flags, _, default in flag_rows(FLAGS_PAGE)}
    for flags, _, default in flag_rows(REPO / "README.md"):
        assert flags[0] in full, f"README.md's {flags[0]} has no row in {FLAGS_PAGE.name}"
        assert full[flags[0]] == default, f"{flags[0]}: README.md says {default!r}, {FLAGS_PAGE.name} {full[flags[0]]!r}"


def runner_commands() -> list[tuple[str, str]]:
    """(page, command) for every written command that runs the runner, directly or through launch/."""
    found = []
    for page in PAGES:
        for block in readme_blocks((REPO / page).read_text()):
            text = "\n".join(block.text).replace("\\\n", " ")
            for line in text.splitlines():
                m = re.search(r"dist_inference_runner\.py|launch/\S+\.(?:sh|sbatch)", line)
                if m and not line.lstrip().startswith("#"):
                    found.append((page, line[m.end():]))
    return found


def test_written_runner_commands_use_existing_flags():
    commands = runner_commands()
    assert len(commands) >= 10
    actions = parser_actions()
    unknown = [f"{page}: {flag} in {cmd.strip()!r}" for page, cmd in commands
               for flag in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", cmd) if flag not in actions]
    assert unknown == []
