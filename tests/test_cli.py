"""Every flag of every `dflash` stage says what it is, and `dflash --help` lists the stages in the
order a run uses them."""

import argparse

from dflash.cli import build_parser

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
    "report",
    "record",
    "verify",
    "compare",
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
