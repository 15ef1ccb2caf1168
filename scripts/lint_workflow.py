"""`snakemake --lint` for CI: fails on every lint except those answered below, with the reason.

Snakemake 9.27 prints text whatever `--lint` format is asked for, so the report is read as text:
a lint is a line `    * <title>:` below `Lints for <rule or snakefile>:`.
Usage: .venv/bin/python scripts/lint_workflow.py [more snakemake arguments]
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

# Lints that stay, each with the reason.
ANSWERED = {
    # The project is one pip-installed environment (scripts/setup.sh), used by every rule and
    # recorded by every rule (its packages' hash is the `env` param: an upgrade reruns). A conda
    # file or container per rule would be a second description of it, untested and drifting.
    "Specify a conda environment or container for each rule.",
}


def lints(report: str) -> list[tuple[str, str]]:
    """(where, title) of every lint in a `snakemake --lint` text report."""
    found, where = [], None
    for line in report.splitlines():
        if line.startswith("Lints for "):
            where = line.removeprefix("Lints for ").rstrip(":")
        elif title := re.fullmatch(r"    \* (.+):", line):
            found.append((where, title.group(1)))
    return found


def main(args: list[str]) -> int:
    cmd = [sys.executable, "-m", "snakemake", "--lint", *args]
    done = subprocess.run(cmd, capture_output=True, text=True)
    report = done.stdout + done.stderr
    found = lints(report)
    if done.returncode != 0 and not found:  # failed before linting (a Snakefile error)
        print(report, file=sys.stderr)
        return done.returncode
    left = [(where, title) for where, title in found if title not in ANSWERED]
    for where, title in left:
        print(f"{where}: {title}")
    answered = len(found) - len(left)
    print(f"snakemake --lint: {len(left)} lints, {answered} answered ({Path(__file__).name})")
    return 1 if left else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
