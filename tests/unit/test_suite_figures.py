"""docs/testing.md's figures come from the suite itself (tests/suite_figures.py): a full run rewrites
the counts per tier from its collection, and the time when it passed."""

from tests import suite_figures


def test_the_docs_hold_the_block():
    assert suite_figures.read() is not None, f"docs/testing.md lost its {suite_figures.BEGIN} block"


def test_the_block_is_written_between_its_markers(tmp_path, monkeypatch):
    doc = tmp_path / "testing.md"
    doc.write_text(f"# Tests\n\nbefore\n{suite_figures.BEGIN}\nold\n{suite_figures.END}\nafter\n")
    monkeypatch.setattr(suite_figures, "DOC", doc)

    class Config:
        suite_counts = {"tests": 10, "fast": 7, "processes": 3}

    class Session:
        config, testsfailed = Config(), 0

    suite_figures.pytest_sessionfinish(Session(), 0)
    text = doc.read_text()
    assert text.startswith("# Tests\n\nbefore\n") and text.endswith("after\n") and "old" not in text
    assert suite_figures.read() == {"tests": 10, "fast": 7, "processes": 3}
    passed = text[text.index("The last full run"):text.index(suite_figures.END)]
    Config.suite_counts = {"tests": 11, "fast": 8, "processes": 3}
    Session.testsfailed = 1  # a failed run: the counts change, the last passing run's time stays
    suite_figures.pytest_sessionfinish(Session(), 1)
    assert suite_figures.read() == {"tests": 11, "fast": 8, "processes": 3} and passed in doc.read_text()
