"""BENCHMARKS.md holds the figures that stand today on one screen, each row complete and its
`since` mark what `git log` says (scripts/benchmarks.py); the history is one page an entry under
docs/benchmarks/, each listed in its README."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

import benchmarks  # noqa: E402


def rows():
    return benchmarks.table_rows(benchmarks.FILE.read_text())


def test_the_current_figures_fit_one_screen_and_every_row_is_complete():
    text = benchmarks.FILE.read_text()
    assert len(text.splitlines()) <= 80
    assert len(rows()) >= 20
    for _, row in rows():
        cell = dict(zip(benchmarks.COLUMNS, row, strict=True))
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", cell["date"]), row
        assert re.fullmatch(r"[0-9a-f]{7,40}", cell["commit"]), row
        assert all(len(c) <= 160 for c in row), row
        for path in benchmarks.paths(cell["depends on"]):
            assert (REPO / path).exists(), f"{row[0]}: {path} does not exist"
        (entry,) = re.findall(r"\]\((docs/benchmarks/[^)]+)\)", cell["entry"])
        assert (REPO / entry).is_file(), entry
        assert cell["since"] == "current" or cell["since"].startswith("changed: "), row


def test_every_mark_is_what_git_says():
    shallow = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--is-shallow-repository"],
        capture_output=True,
        text=True,
    )
    if shallow.returncode != 0 or shallow.stdout.strip() == "true":
        pytest.skip("not a full git checkout: the marks need the history")
    _, stale = benchmarks.marked(benchmarks.FILE.read_text())
    assert not stale, "run `python scripts/benchmarks.py --write`:\n" + "\n".join(stale)


def test_a_change_to_what_a_row_depends_on_is_marked(tmp_path):
    """On a throwaway repository: a row is current until a commit touches what it names; a
    move alone is no change."""

    def git(*args):
        return subprocess.run(
            ["git", "-C", str(tmp_path), *args], capture_output=True, text=True, check=True
        ).stdout.strip()

    git("init", "-q")
    git("config", "user.email", "t@t")
    git("config", "user.name", "t")
    (tmp_path / "a.yaml").write_text("x: 1\n")
    git("add", "-A")
    git("commit", "-qm", "measured")
    measured = git("rev-parse", "--short", "HEAD")
    (tmp_path / "conf").mkdir()
    git("mv", "a.yaml", "conf/a.yaml")
    git("commit", "-qm", "moved")
    old = benchmarks.REPO
    try:
        benchmarks.REPO = tmp_path
        assert benchmarks.mark(measured, ["conf/a.yaml"]) == "current"
        (tmp_path / "conf" / "a.yaml").write_text("x: 2\n")
        git("commit", "-qam", "edited")
        edited = git("rev-parse", "--short", "HEAD")
        assert benchmarks.mark(measured, ["conf/a.yaml"]) == f"changed: conf/a.yaml ({edited})"
    finally:
        benchmarks.REPO = old


def test_the_history_is_one_page_an_entry_all_listed():
    folder = REPO / "docs" / "benchmarks"
    pages = sorted(p.name for p in folder.glob("*.md") if p.name != "README.md")
    assert len(pages) >= 48
    index = (folder / "README.md").read_text()
    assert sorted(re.findall(r"\]\((20[^)]+\.md)\)", index)) == pages
    for page in pages:
        first = (folder / page).read_text().splitlines()[0]
        assert first.startswith(f"# {page[:10]}"), page
