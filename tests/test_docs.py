"""experiments/docs.py: figure blocks are rewritten from their renderer, a stale one fails the check,
an unknown one is an error naming it."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))
import docs  # noqa: E402


@pytest.fixture
def page(tmp_path, monkeypatch):
    p = tmp_path / "page.md"
    monkeypatch.setattr(docs, "PAGES", [p])
    monkeypatch.setattr(docs, "ROOT", tmp_path)
    monkeypatch.setattr(docs, "FIGURES", {"answer": lambda: "| x |\n|---:|\n| 42 |\n"})
    return p


def run(*args):
    old = sys.argv
    sys.argv = ["docs.py", *args]
    try:
        return docs.main()
    finally:
        sys.argv = old


def test_stale_figure_fails_the_check_and_is_rewritten(page, capsys):
    page.write_text("intro\n<!-- figure answer -->\n| x |\n|---:|\n| 41 |\n<!-- /figure -->\nafter\n")
    assert run("--check") == 1 and "-| 41 |" in capsys.readouterr().out
    assert run() == 0
    assert page.read_text() == "intro\n<!-- figure answer -->\n| x |\n|---:|\n| 42 |\n<!-- /figure -->\nafter\n"
    assert run("--check") == 0


def test_unknown_figure_is_named(page):
    page.write_text("<!-- figure nope -->\n<!-- /figure -->\n")
    with pytest.raises(SystemExit, match="unknown figure 'nope'"):
        run("--check")


def test_md_table_and_ms():
    assert docs.md_table(["a", "b"], [["x", 1]]) == "| a | b |\n|---|---:|\n| x | 1 |\n"
    assert docs.ms(-1e-7) == "0.00" and docs.ms(0.00123) == "1.23"
