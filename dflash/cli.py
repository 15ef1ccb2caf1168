"""`dflash-train <stage>` (or `python -m dflash <stage>`): every workflow rule calls one of these,
so each stage runs without Snakemake.

`--config` takes a YAML file or an inline JSON object (the rules pass the exact subset of the
config a stage depends on, which is also what makes Snakemake rerun it when that subset changes).
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

log = logging.getLogger("dflash")

EPILOG = """\
A run goes: target and expand (side by side), regenerate (one job per shard, then merge-shards),
tokenize, stats, warmup (beside regeneration: it needs only the target's config), train, eval and
ddtree (and eval-vllm where vLLM is installed), report, record. verify and compare read finished runs. `dflash-train STAGE --help` lists a
stage's arguments; docs/workflow.md has the rule behind each."""


def load(value: str) -> dict:
    if value.lstrip().startswith("{"):
        try:
            config = json.loads(value)
            return check_paths(validate(config, cli=config), "--config JSON")
        except json.JSONDecodeError as e:
            raise ConfigError(f"--config is not valid JSON: {e}") from e
    return check_paths(load_config(value), value)


def _add(sub, name: str, help: str, config: bool = True):
    parser = sub.add_parser(name, help=help, description=help)
    if config:
        parser.add_argument(
            "--config",
            default="config/config.yaml",
            help="config YAML file or inline JSON (default: config/config.yaml)",
        )
    parser.add_argument("--manifest", type=Path, help="write the stage's sha256 manifest here")
    return parser


def _add_decoding(sub, name: str, help: str):
    """A stage that decodes the eval prompts (dflash.eval.setup.Setup reads these arguments)."""
    p = _add(sub, name, help)
    p.add_argument("--target", type=Path, required=True, help="target HF directory")
    p.add_argument("--drafter", type=Path, required=True, help="exported drafter HF directory")
    p.add_argument("--held-out", type=Path, required=True, help="expand's eval split (parquet)")
    return p


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

    p = _add(sub, "target", "resolve the target LLM into a plain HF directory")
    p.add_argument("--out", type=Path, required=True, help="HF model directory to create")
    p.add_argument("--info", type=Path, required=True, help="target facts JSON (mask token, ...)")
    p.set_defaults(stage="dflash.model.convert:run")

    p = _add(sub, "expand", "merge, normalise, dedupe, shuffle and split the chat sources")
    p.add_argument("--train", type=Path, required=True, help="training split parquet to write")
    p.add_argument(
        "--eval", type=Path, required=True, help="held-out split parquet to write (the eval split)"
    )
    p.add_argument(
        "--report",
        type=Path,
        required=True,
        help="report JSON to write: rows read, repaired and dropped per source, by reason",
    )
    p.set_defaults(stage="dflash.data.expand:run")

    p = _add(sub, "regenerate", "rewrite assistant turns with the target (greedy), resumably")
    p.add_argument("--target", type=Path, required=True, help="target HF directory")
    p.add_argument("--input", type=Path, required=True, help="an expanded split parquet")
    p.add_argument(
        "--output",
        type=Path,
        required=True,
        help="regenerated parquet (this shard's rows) to write",
    )
    p.add_argument(
        "--workdir",
        type=Path,
        required=True,
        help="resume state (finished batches); not a declared output",
    )
    p.add_argument(
        "--shard", type=int, default=0, help="which shard to run, 0 to shards-1 (default: 0)"
    )
    p.add_argument(
        "--shards",
        type=int,
        default=1,
        help="how many shards split the rows, by a hash of each row's id (default: 1)",
    )
    p.set_defaults(stage="dflash.data.regenerate:run", reads=("target", "input"))

    p = _add(sub, "merge-shards", "merge regenerated shards back into input order")
    p.add_argument("--input", type=Path, required=True, help="the expanded split they came from")
    p.add_argument(
        "--shard-files",
        type=Path,
        nargs="+",
        required=True,
        help="every shard's regenerated parquet",
    )
    p.add_argument("--output", type=Path, required=True, help="merged parquet to write")
    p.set_defaults(stage="dflash.data.regenerate:run_merge", reads=("input", "shard_files"))

    p = _add(sub, "tokenize", "render with the chat template and build loss masks")
    p.add_argument("--target", type=Path, required=True, help="target HF directory (tokenizer)")
    p.add_argument(
        "--input",
        type=Path,
        required=True,
        help="a regenerated split parquet (or an expanded one when regeneration is off)",
    )
    p.add_argument(
        "--output",
        type=Path,
        required=True,
        help="tokenized parquet to write (its report JSON goes beside it)",
    )
    p.set_defaults(stage="dflash.data.tokenization:run", reads=("target", "input"))

    p = _add(sub, "stats", "length statistics, bucket table and drift")
    p.add_argument("--input", type=Path, required=True, help="tokenized parquet")
    p.add_argument("--json", type=Path, required=True, help="stats.json to write")
    p.add_argument("--plot", type=Path, required=True, help="length histogram PNG to write")
    p.add_argument("--previous", type=Path, help="earlier stats.json to compare against")
    p.add_argument(
        "--domains", type=Path, help="expanded train.parquet: statistics per domain of its rows"
    )
    p.set_defaults(stage="dflash.data.stats:run", reads=("input", "domains"))

    p = _add(sub, "warmup", "compile the drafter step for every bucket shape on one thread")
    p.add_argument("--target", type=Path, required=True, help="target HF directory (config only)")
    p.add_argument("--record", type=Path, required=True, help="warmup record JSON to write")
    p.add_argument("--cache-dir", help="compile cache (default: compile.cache_dir)")
    p.set_defaults(stage="dflash.train.warmup:run", reads=("target",))

    p = _add(
        sub,
        "train",
        "train the drafter; run it under torchrun with targets + drafters processes "
        "(a colocated single drafter also runs alone)",
    )
    p.add_argument("--target", type=Path, required=True, help="target HF directory")
    p.add_argument("--data", type=Path, required=True, help="tokenized training parquet")
    p.add_argument("--out", type=Path, required=True, help="drafter HF directory to write")
    p.add_argument("--metrics", type=Path, required=True, help="metrics.jsonl to write")
    p.add_argument("--summary", type=Path, required=True, help="throughput summary JSON to write")
    p.add_argument(
        "--checkpoints",
        type=Path,
        required=True,
        help="resumable checkpoints (not a declared output)",
    )
    p.add_argument(
        "--held-out",
        type=Path,
        help="tokenized eval split: tau_sim is logged on its first train.tau_sim.rows rows",
    )
    p.set_defaults(stage="dflash.train.loop:run", reads=("target", "data", "held_out"))

    p = _add_decoding(sub, "eval", "speculative decoding of the drafter and baselines")
    p.add_argument("--tokenized", type=Path, required=True, help="tokenized eval split")
    p.add_argument("--output", type=Path, required=True, help="acceptance.json to write")
    p.add_argument(
        "--train", type=Path, help="expand's train split: eval prompts found in it are reported"
    )
    p.set_defaults(
        stage="dflash.eval.run:run",
        reads=("target", "drafter", "held_out", "tokenized", "train"),
    )

    p = _add_decoding(sub, "ddtree", "tree drafting (DDTree) from the same drafter, by budget")
    p.add_argument("--output", type=Path, required=True, help="ddtree.json to write")
    p.set_defaults(stage="dflash.eval.run:run_ddtree", reads=("target", "drafter", "held_out"))

    p = _add_decoding(sub, "eval-vllm", "the drafter served by vLLM's DFlash method, beside eval")
    p.add_argument("--acceptance", type=Path, required=True, help="eval's acceptance.json")
    p.add_argument("--output", type=Path, required=True, help="vllm.json to write")
    p.set_defaults(
        stage="dflash.eval.vllm_stage:run", reads=("target", "drafter", "held_out", "acceptance")
    )

    p = _add(
        sub,
        "report",
        "results/summary.md and the report's plots, from the other outputs",
        config=False,
    )
    for name, what in (
        ("stats", "stats.json of the length statistics"),
        ("metrics", "training's metrics.jsonl"),
        ("train-summary", "training's throughput summary JSON"),
        ("acceptance", "the evaluation's acceptance.json"),
        ("ddtree", "the DDTree evaluation's ddtree.json"),
    ):
        p.add_argument(f"--{name}", type=Path, required=True, help=what)
    p.add_argument("--vllm", type=Path, help="eval_vllm's vllm.json, where that stage ran")
    p.add_argument("--drafter", help="the trained drafter's folder, named in the summary")
    p.add_argument("--serve-target", help="the target as a serving engine is given it")
    p.add_argument("--tokenized", type=Path, help="tokenize's report of the training split")
    p.add_argument("--summary", type=Path, required=True, help="summary.md to write")
    p.add_argument("--plots", type=Path, required=True, help="folder for the PNG plots")
    p.set_defaults(
        stage="dflash.eval.report:run",
        reads=("stats", "metrics", "train_summary", "acceptance", "ddtree"),
    )

    p = _add(sub, "record", "results/MANIFEST.json: every artefact's sha256 and the run record")
    p.add_argument("--results", type=Path, required=True, help="the results folder")
    p.add_argument("--workflow-dir", type=Path, help="workflow folder whose files to hash")
    p.add_argument("--output", type=Path, required=True, help="MANIFEST.json to write")
    p.add_argument(
        "--input",
        dest="inputs",
        action="append",
        default=[],
        metavar="NAME=DIR",
        help="a folder the run read, made by a rule of its own under resources/ (the converted"
        " target): its files' sha256 are recorded as the input NAME; repeatable",
    )
    p.add_argument("outputs", type=Path, nargs="+", help="every declared output of the run")
    p.set_defaults(stage="dflash.record:run")

    p = sub.add_parser(
        "verify",
        help="re-hash every artefact against the run record",
        description="Re-hash every artefact against results/MANIFEST.json; report missing, "
        "changed and unrecorded files; exit 1 on any.",
    )
    p.add_argument("run", nargs="?", default="results", help="MANIFEST.json or results folder")
    p.set_defaults(stage="dflash.verify:run")

    p = sub.add_parser(
        "compare",
        help="why is run B different from run A? (ranked causes)",
        description="Rank the recorded causes (topology, environment, code, config, data) of "
        "the throughput and τ differences between two runs.",
    )
    p.add_argument("run_a", help="MANIFEST.json or results folder")
    p.add_argument("run_b", help="MANIFEST.json or results folder")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(stage="dflash.compare:run")
    p = _add(
        sub,
        "random-target",
        "write a rehearsal target: random seeded weights of a public config, a real tokenizer",
        config=False,
    )
    p.add_argument(
        "--model-config",
        type=Path,
        required=True,
        help="transformers config.json (or a folder holding one), e.g. bench/qwen3-8b-config",
    )
    p.add_argument(
        "--tokenizer", type=Path, required=True, help="folder with the tokenizer's files"
    )
    p.add_argument("--out", type=Path, required=True, help="HF model directory to create")
    p.add_argument("--seed", type=int, default=0, help="torch seed of the weights (default 0)")
    p.add_argument(
        "--device", default="auto", help="where to draw the weights (auto: cuda if present)"
    )
    p.set_defaults(stage="dflash.model.random_target:run")

    _add_plan(sub)
    return parser


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
    p.set_defaults(stage="dflash.plan:run")


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(name)s %(message)s", stream=sys.stderr
    )
    args = build_parser().parse_args(argv)
    module_name, func_name = args.stage.split(":")
    try:
        if hasattr(args, "config"):
            args.config = load(args.config)
            if args.command in ("stats", "warmup", "train", "eval", "ddtree"):
                _auto_sizes(args)  # the stages that read the batch sizes
        # before any work: what the stage reads is still what its producer wrote
        reads = {name: getattr(args, name) for name in getattr(args, "reads", ())}
        config = getattr(args, "config", None) or {}
        check_inputs(reads, getattr(args, "manifest", None), config.get("cache_dir"))
        getattr(importlib.import_module(module_name), func_name)(args)
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
