"""The README and the docs pages as a manual, without running anything: every page is listed in the
order its commands run (tests/integration/test_readme.py runs them), every command block is marked run
or skip, the README links every docs page, every page says in one line what it is for and links back,
and every relative link and anchor resolves."""

from __future__ import annotations

import re
from pathlib import Path

from tests.integration.test_readme import PAGES, is_command, page_blocks
from tests.utils import REPO


def test_every_page_is_listed():
    pages = {"README.md"} | {p.relative_to(REPO).as_posix() for p in (REPO / "docs").rglob("*.md")}
    assert len(set(PAGES)) == len(PAGES)
    assert pages == set(PAGES), "add new docs pages to PAGES (in an order that keeps their commands' dependencies)"


def test_every_command_block_is_marked():
    blocks = [(page, b) for page, b in page_blocks() if is_command(b)]
    unmarked = [f"{page}:{b.line}: {b.text[0]}" for page, b in blocks if b.action is None]
    assert unmarked == [], "mark these with <!-- readme-test: run --> or <!-- readme-test: skip (why) -->"
    assert sum(b.action == "run" for _, b in blocks) >= 10
    assert any(b.action == "run" for page, b in blocks if page == "README.md")  # the quick start


LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def anchor(heading: str) -> str:
    """GitHub's id for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    return {anchor(x.lstrip("#")) for x in path.read_text().splitlines() if re.match(r"#{1,6} ", x)}


def test_pages_link_each_other():
    readme_links = {(REPO / m).resolve() for m in
                    (x.split("#")[0] for x in LINK.findall((REPO / "README.md").read_text())) if m}
    broken = []
    for page in PAGES:
        path = REPO / page
        lines = path.read_text().splitlines()
        for target in LINK.findall(path.read_text()):
            if re.match(r"[a-z]+:", target):
                continue  # an external address
            file, _, frag = target.partition("#")
            dest = (path.parent / file).resolve() if file else path
            if not dest.is_file() or (frag and dest.suffix == ".md" and frag not in anchors(dest)):
                broken.append(f"{page}: {target}")
        if page == "README.md":
            continue
        assert path.resolve() in readme_links, f"README.md does not link {page}"
        assert lines[0].startswith("# ") and not lines[1].strip(), f"{page}: a title, then a blank line"
        purpose = lines[2]
        assert purpose.strip() and not lines[3].strip(), f"{page}: line 3 says in one line what the page is for"
        back = [(path.parent / x.split("#")[0]).resolve() for x in LINK.findall(purpose)]
        assert (REPO / "README.md").resolve() in back, f"{page}: its purpose line links back to the README"
    assert broken == [], "links that do not resolve"
