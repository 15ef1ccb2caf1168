"""BENCHMARKS.md's current table: whether each figure still stands, computed from git.

Each row names the commit it was measured at and the files its figure depends on (a config, the
code paths it exercises); its last column says `current` when no commit since that one touched
them, or which of them changed, each with the first commit that changed it. `--write` puts those marks into the
file; without it, the script prints the rows whose mark differs and exits 1 (tests call it so).

    python scripts/benchmarks.py           # check the marks
    python scripts/benchmarks.py --write   # recompute them
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FILE = REPO / "BENCHMARKS.md"
COLUMNS = ("what", "figure", "date", "commit", "depends on", "command", "machine", "entry", "since")


def cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def table_rows(text: str) -> list[tuple[int, list[str]]]:
    """(line index, cells) of every row of the current table (the one headed by COLUMNS)."""
    lines = text.splitlines()
    rows, inside = [], False
    for i, line in enumerate(lines):
        if line.startswith("|") and tuple(cells(line)) == COLUMNS:
            inside = True
        elif inside and line.startswith("|") and not line.startswith("|---"):
            rows.append((i, cells(line)))
        elif inside and not line.startswith("|"):
            inside = False
    return rows


def paths(cell: str) -> list[str]:
    """The paths a `depends on` cell names, each in backquotes."""
    return [p for p in cell.split("`")[1::2] if p.strip()]


def git(*args: str) -> str:
    done = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"git {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout


def blob(commit: str, path: str) -> str | None:
    done = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "-q", "--verify", f"{commit}:{path}"],
        capture_output=True,
        text=True,
    )
    return done.stdout.strip() or None


def first_change(commit: str, path: str) -> str | None:
    """The first commit after `commit` that changed `path` (a file followed through renames,
    a move alone is no change; or a folder), None if none did."""
    if not (REPO / path).is_file():
        first = git("log", "--reverse", "--format=%h", f"{commit}..HEAD", "--", path).split()
        return first[0] if first else None
    log = git("log", "--follow", "--format=@%h", "--name-status", f"{commit}..HEAD", "--", path)
    steps = []  # (commit, its name after that commit, its name before), newest first
    for part in log.split("@")[1:]:
        lines = [x for x in part.splitlines() if x.strip()]
        status = lines[1].split("\t")
        steps.append((lines[0], status[-1], status[1] if status[0].startswith("R") else status[-1]))
    if not steps:
        return None
    before = blob(commit, steps[-1][2])
    for h, name, _ in reversed(steps):
        if blob(h, name) != before:
            return h
    return None


def mark(commit: str, depends: list[str]) -> str:
    """`current`, or each path changed since `commit` with the first commit that changed it
    (a mark that stays put while later commits touch the same path)."""
    git("cat-file", "-e", f"{commit}^{{commit}}")
    changed = [f"{p} ({h})" for p in depends if (h := first_change(commit, p))]
    return "changed: " + ", ".join(changed) if changed else "current"


def marked(text: str) -> tuple[str, list[str]]:
    """The text with every row's mark computed, and the rows whose mark was different."""
    lines, stale = text.splitlines(), []
    for i, row in table_rows(text):
        if len(row) != len(COLUMNS):
            raise SystemExit(f"BENCHMARKS.md line {i + 1}: {len(row)} cells, not {len(COLUMNS)}")
        depends = paths(row[COLUMNS.index("depends on")])
        if not depends:
            raise SystemExit(f"BENCHMARKS.md line {i + 1}: `depends on` names no path")
        now = mark(row[COLUMNS.index("commit")], depends)
        if row[-1] != now:
            stale.append(f"line {i + 1} ({row[0]}): {row[-1]!r} -> {now!r}")
            row[-1] = now
            lines[i] = "| " + " | ".join(row) + " |"
    return "\n".join(lines) + "\n", stale


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--write", action="store_true", help="recompute the marks in the file")
    args = p.parse_args(argv)
    text, stale = marked(FILE.read_text())
    if args.write:
        FILE.write_text(text)
        print(f"{FILE.name}: {len(table_rows(text))} rows, {len(stale)} marks updated")
        return 0
    for line in stale:
        print(line)
    if stale:
        print("run `python scripts/benchmarks.py --write`", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
