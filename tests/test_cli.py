"""Every flag of every stage says what it is, `dflash-train --help` lists the stages in the order
a run uses them, and the package is installed under names that do not shadow the DFlash authors'
reference package (`dflash` on PyPI)."""

import argparse
import subprocess
import sys
import tomllib
from pathlib import Path

from dflash.cli import build_parser

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"

RUN_ORDER = [
    "target",
    "expand",
    "regenerate",
    "merge-shards",
    "tokenize",
    "stats",
    "warmup",
    "train",
    "eval",
    "ddtree",
    "sample-eval",
    "eval-vllm",
    "eval-sglang",
    "report",
    "record",
    "verify",
    "compare",
    "compute-curve",
    # tools beside the run
    "random-target",
    "plan",
]


def stages(parser: argparse.ArgumentParser) -> argparse._SubParsersAction:
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))


def test_every_argument_of_every_stage_has_help():
    sub = stages(build_parser())
    missing = [
        f"dflash {name} {'/'.join(action.option_strings) or action.dest}"
        for name, parser in sub.choices.items()
        for action in parser._actions
        if not action.help or action.help == argparse.SUPPRESS
    ]
    assert not missing, missing
    assert all(choice.help for choice in sub._choices_actions)


def test_the_help_lists_the_stages_in_the_order_a_run_uses_them():
    parser = build_parser()
    assert list(stages(parser).choices) == RUN_ORDER
    text = parser.format_help()
    positions = [text.index(f"    {name}") for name in RUN_ORDER]
    assert positions == sorted(positions)


def test_the_distribution_and_its_command_do_not_take_the_reference_packages_name():
    """pip and the console script say `dflash-train`; the import folder stays `dflash`, and
    `python -m dflash` (what every rule runs) is the same command."""
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    assert project["name"] == "dflash-train"
    assert project["scripts"] == {"dflash-train": "dflash.cli:main"}
    assert build_parser().prog == "dflash-train"
    done = subprocess.run(
        [sys.executable, "-m", "dflash", "--help"], capture_output=True, text=True, check=True
    )
    assert done.stdout.startswith("usage: dflash-train ")
