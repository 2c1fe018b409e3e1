"""docs/testing.md's figures come from the suite itself (tests/suite_figures.py): the counts per tier it
states are the collection's, checked whenever the whole suite runs."""

import pytest

from tests import suite_figures


def test_the_docs_state_this_suite_s_counts(request):
    counted = getattr(request.config, "suite_counts", None)
    if counted is None:
        pytest.skip("the counts are checked when the whole suite runs")
    assert suite_figures.read() == counted, "run the whole suite once (it rewrites docs/testing.md's figures)"


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
