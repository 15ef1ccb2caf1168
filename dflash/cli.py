"""`dflash-train <stage>` (or `python -m dflash <stage>`): every workflow rule calls one of these,
so each stage runs without Snakemake.

Every stage is declared once, in dflash/stages: its arguments, the config keys it reads, what its
manifest records. `--config` takes a YAML file or an inline JSON object (the rules pass the keys
a stage reads; those its outputs depend on are the rules' rerun triggers).
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import sys
from pathlib import Path

from dflash.config import ConfigError, check_paths, load_config, validate
from dflash.custody import check_inputs
from dflash.errors import UserError, disk_full
from dflash.manifest import write_manifest
from dflash.stages import ELSEWHERE, STAGES, Stage

log = logging.getLogger("dflash")

EPILOG = """\
A run goes: target and expand (side by side), regenerate (one job per shard, then merge-shards),
tokenize, stats, warmup (beside regeneration: it needs only the target's config), train, eval and
ddtree (sample-eval with eval.sampling's temperatures; eval-vllm and eval-sglang where vLLM and
SGLang are installed), report, record. verify and compare read finished runs.
`dflash-train STAGE --help` lists a stage's arguments; docs/workflow.md has the rule behind each."""


def load(value: str) -> dict:
    if value.lstrip().startswith("{"):
        try:
            config = json.loads(value)
            return check_paths(validate(config, cli=config), "--config JSON")
        except json.JSONDecodeError as e:
            raise ConfigError(f"--config is not valid JSON: {e}") from e
    return check_paths(load_config(value), value)


def _add_stage(sub, stage: Stage) -> None:
    parser = sub.add_parser(
        stage.command, help=stage.help, description=stage.description or stage.help
    )
    if stage.config:
        parser.add_argument(
            "--config",
            default="config/config.yaml",
            help="config YAML file or inline JSON (default: config/config.yaml)",
        )
    if stage.manifest:
        parser.add_argument("--manifest", type=Path, help="write the stage's sha256 manifest here")
    for arg in stage.args:
        arg.add_to(parser)
    parser.set_defaults(stage=stage)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dflash-train",
        description=__doc__,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(
        dest="command", required=True, title="stages, in the order a run uses them", metavar="STAGE"
    )
    for stage in STAGES.values():
        _add_stage(sub, stage)
    _add_plan(sub)
    return parser


PLAN = Stage(
    "plan",
    "dflash.plan:run",
    "the time of each stage to a drafter, measured or projected (docs/plan.md)",
    manifest=False,
)


def _add_plan(sub) -> None:
    p = sub.add_parser(
        "plan",
        help="the time of each stage to a drafter, measured or projected (docs/plan.md)",
        description="Print the time of regeneration, tokenization, compile warmup, training "
        "and evaluation for a target, a data size and GPUs, from the measured rates shipped in "
        "dflash/plan/rates.py (or a finished run's own); each figure says whether it was "
        "measured at these shapes on this GPU kind or projected, and from what.",
    )
    what = p.add_mutually_exclusive_group()
    what.add_argument("--target", help="preset (qwen3-8b, smollm2-135m), HF dir or config.json")
    what.add_argument("--params", type=float, help="parameter count, e.g. 70e9 (assumed shape)")
    p.add_argument("--samples", type=int, help="training samples (default 800,000)")
    p.add_argument("--prompt-tokens", type=float, help="mean prompt tokens a sample (default 256)")
    p.add_argument("--new-tokens", type=float, help="mean new tokens a sample (default 1,024)")
    p.add_argument("--stats", help="a run's results/data/stats/stats.json for the data")
    p.add_argument(
        "--from-run",
        help="a results folder: its measured rates come first, its settings are the defaults",
    )
    p.add_argument("--epochs", type=int, help="default 1 (--from-run: the run's)")
    p.add_argument("--gpus", type=int, default=1, help="GPU count (default 1)")
    p.add_argument(
        "--gpu",
        default="h200",
        choices=["h200", "h100", "a100", "b200"],
        help="GPU kind (measured rates are H200's; others scaled by datasheet, labelled)",
    )
    p.add_argument("--topology", help="TARGETS+DRAFTERS (default 0+GPUS: colocated)")
    p.add_argument("--anchors", type=int, help="drafter.max_anchors (default 512)")
    p.add_argument("--drafter-layers", type=int, help="drafter.num_layers (default 5)")
    p.add_argument("--block-size", type=int, help="drafter.block_size (default 16)")
    p.add_argument("--max-length", type=int, help="data.max_length (default 2048)")
    p.add_argument("--buckets", type=int, help="bucket shapes to compile (default 3)")
    p.add_argument("--regen-batch", type=int, default=1024, help="data.regenerate.batch_size")
    p.add_argument("--max-new-tokens", type=int, help="regeneration cap (default 2x the mean)")
    p.add_argument(
        "--eval-prompts", type=int, default=104, help="prompts the evaluation decodes (104)"
    )
    p.add_argument(
        "--eval-new-tokens", type=int, default=256, help="eval.max_new_tokens (default 256)"
    )
    p.add_argument(
        "--checkpoints", type=int,
        help="checkpoints training writes (default one at each epoch's end; "
        "train.checkpoint_every adds one every so many steps)",
    )  # fmt: skip
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(stage=PLAN)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(name)s %(message)s", stream=sys.stderr
    )
    args = build_parser().parse_args(argv)
    stage: Stage = args.stage
    module_name, func_name = stage.run.split(":")
    try:
        if hasattr(args, "config"):
            args.config = load(args.config)
            if args.command in ("stats", "warmup", "train", "eval", "ddtree"):
                _auto_sizes(args)  # the stages that read the batch sizes
        # before any work: what the stage reads is still what its producer wrote
        manifest = getattr(args, "manifest", None)
        config = getattr(args, "config", None) or {}
        check_inputs(stage.reads(args), manifest, config.get("cache_dir"))
        made = getattr(importlib.import_module(module_name), func_name)(args)
        if manifest is not None and made is not ELSEWHERE:
            inputs, outputs, params = stage.recorded(args, made)
            write_manifest(manifest, stage.command, inputs, outputs, params, stage.modules)
    except Exception as e:
        error = e if isinstance(e, UserError) else disk_full(e, _paths(args))
        if error is None:
            raise
        _say(f"dflash {args.command}: error: {error}")
        return 1
    return 0


def _auto_sizes(args) -> None:
    """`auto` batch sizes in a config given by hand (the workflow passes numbers), resolved as
    the workflow would: from this host's GPUs and the stage's --target."""
    from shutil import which

    from dflash import auto_memory

    on_gpu = which("nvidia-smi") is not None
    chosen = auto_memory.resolve(args.config, on_gpu, getattr(args, "target", None), None)
    if chosen.note:
        log.info("%s", chosen.note)


def _paths(args) -> list[Path]:
    """The files and folders a stage was given (its outputs among them)."""
    paths = []
    for value in vars(args).values():
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, Path):
                paths.append(item)
    return paths


def _say(text: str) -> None:
    try:
        print(text, file=sys.stderr, flush=True)
    except OSError:
        # stderr is the rule's log, on the disk that is full: the terminal, if there is one
        try:
            with open("/dev/tty", "w") as tty:
                tty.write(text + "\n")
        except OSError:
            pass
