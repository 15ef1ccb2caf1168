"""The stage registry: every `dflash-train` command, in the order a run uses them (see
dflash/stages/spec.py for what an entry declares). The CLI builds its parser, its input checks
and the stage manifests from it; the workflow's rules take their rerun triggers and the config
they pass from it. Importing it imports neither torch nor any stage.
"""

from __future__ import annotations

from pathlib import Path

from dflash.stages.spec import ELSEWHERE, IN, INERT, OUT, PARAM, PATH, REF, Arg, Stage

__all__ = ["ELSEWHERE", "INERT", "STAGES", "TRAINING_CODE", "TRAINING_CONFIG", "Arg", "Stage"]

# Training: the code it runs (the loop module and all it imports; also part of the resume
# contract) and the config keys it reads.
TRAINING_CODE = ("dflash.train.loop",)
BATCHING = ("data.buckets", "data.max_length", "data.token_budget", "data.max_batch_size")
# The mode the training answers were made in (recorded in the drafter's config.json) and the
# evaluation's top-p and top-k (tau_sim at train.tau_sim.temperatures) are read too.
ANSWER_MODE = (
    *(f"data.regenerate.{k}" for k in ("temperature", "top_p", "top_k", "min_cap")),
    "data.regenerate.max_new_tokens",  # the top of min_cap's drawn range
    "data.chat_template_kwargs",
)
TRAINING_CONFIG = (
    "seed",
    "target.mask_token_id",
    "drafter",
    "compile",
    "train",
    *BATCHING,
    *ANSWER_MODE,
    *("eval.sampling.top_p", "eval.sampling.top_k"),
)
# What the decoding stages read: the eval section, the drafter's loss settings (teacher-forced τ)
# and the seed (the untrained baseline; the streams at temperature); cache_dir is where eval sets
# given as wheels go; the chat template's arguments render the prompts.
EVAL_CONFIG = ("seed", "drafter", "eval", "cache_dir", "data.chat_template_kwargs")


def decoding(*args: Arg) -> tuple[Arg, ...]:
    """The arguments of a stage that decodes the eval prompts (dflash.eval.setup.Setup)."""
    return (
        Arg("--target", "target HF directory", REF),
        Arg("--drafter", "exported drafter HF directory", IN),
        Arg("--held-out", "expand's eval split (parquet)", IN),
        *args,
    )


SERVING = ("eval.vllm", "eval.sglang")  # the engines' sections: inert for every other stage


def serving(engine: str, what: str) -> Stage:
    """A serving engine's stage (`dflash.eval.ENGINE_stage`, rule eval_ENGINE), beside eval."""
    others = tuple(k for k in SERVING if k != f"eval.{engine}")
    return Stage(
        f"eval-{engine}",
        f"dflash.eval.{engine}_stage:run",
        f"the drafter served by {what}, beside eval",
        decoding(
            Arg("--acceptance", "eval's acceptance.json", IN),
            Arg("--sampling", "sample-eval's sampling.json (at temperature)", IN, False),
            Arg("--output", f"{engine}.json to write", OUT),
        ),
        rules=(f"eval_{engine}",),
        config=EVAL_CONFIG,
        inert=(*others, "eval.ddtree", "eval.baselines", "eval.with_lookup"),
        code=(f"dflash.eval.{engine}_stage", f"dflash.eval.{engine}_serve"),
    )


TABLE = (
    Stage(
        "target",
        "dflash.model.convert:run",
        "resolve the target LLM into a plain HF directory",
        (
            Arg("--out", "HF model directory to create", OUT),
            Arg("--info", "target facts JSON (mask token, ...)", OUT),
        ),
        rules=("target",),
        config=("target", "cache_dir"),
        code=("dflash.model.convert", "dflash.model.random_target"),
    ),
    Stage(
        "expand",
        "dflash.data.expand:run",
        "merge, normalise, dedupe, shuffle and split the chat sources",
        (
            Arg("--train", "training split parquet to write", OUT),
            Arg("--eval", "held-out split parquet to write (the eval split)", OUT),
            Arg(
                "--report",
                "report JSON to write: rows read, repaired and dropped per source, by reason",
                OUT,
            ),
        ),
        rules=("expand_dataset",),
        config=(
            "seed",
            "cache_dir",
            *(f"data.{k}" for k in ("sources", "on_bad_row", "max_turns", "max_chars")),
            *(f"data.{k}" for k in ("domain_rows", "train_rows", "train_fraction", "eval_rows")),
            "data.regenerate.samples",  # each training row written this many times
        ),
    ),
    Stage(
        "regenerate",
        "dflash.data.regenerate:run",
        "rewrite assistant turns with the target (greedy or sampled), resumably",
        (
            Arg("--target", "target HF directory", REF),
            Arg("--input", "an expanded split parquet", IN),
            Arg("--output", "regenerated parquet (this shard's rows) to write", OUT),
            Arg("--workdir", "resume state (finished batches); not a declared output", PATH),
            Arg(
                "--shard",
                "which shard to run, 0 to shards-1 (default: 0)",
                PARAM,
                False,
                {"type": int, "default": 0},
            ),  # fmt: skip
            Arg(
                "--shards",
                "how many shards split the rows, by a hash of each row's id (default: 1)",
                PARAM,
                False,
                {"type": int, "default": 1},
            ),  # fmt: skip
        ),
        rules=("regenerate_shard",),
        # cache_dir: the file hashes of the target (dflash/filehash.py) that resuming checks;
        # seed: the streams of sampled answers (data.regenerate.temperature > 0)
        config=(
            "data.regenerate",
            "data.max_length",
            "data.chat_template_kwargs",
            "cache_dir",
            "seed",
        ),
    ),
    Stage(
        "merge-shards",
        "dflash.data.merge_shards:run",
        "merge regenerated shards back into input order",
        (
            Arg("--input", "the expanded split they came from", IN),
            Arg("--shard-files", "every shard's regenerated parquet", REF, True, {"nargs": "+"}),
            Arg("--output", "merged parquet to write", OUT),
        ),
        rules=("regenerate",),
    ),
    Stage(
        "tokenize",
        "dflash.data.tokenization:run",
        "render with the chat template and build loss masks",
        (
            Arg("--target", "target HF directory (tokenizer)", IN),
            Arg(
                "--input",
                "a regenerated split parquet (or an expanded one when regeneration is off)",
                IN,
            ),
            Arg("--output", "tokenized parquet to write (its report JSON goes beside it)", OUT),
        ),
        rules=("tokenize",),
        config=("data.max_length", "data.num_proc", "data.chat_template_kwargs"),
    ),
    Stage(
        "stats",
        "dflash.data.stats:run",
        "length statistics, bucket table and drift",
        (
            Arg("--input", "tokenized parquet", IN),
            Arg("--json", "stats.json to write", OUT),
            Arg("--plot", "length histogram PNG to write", OUT),
            Arg("--previous", "earlier stats.json to compare against", PATH, False),
            Arg(
                "--domains", "expanded train.parquet: statistics per domain of its rows", IN, False
            ),  # fmt: skip
        ),
        rules=("length_stats",),
        config=(*BATCHING, "data.previous_stats"),
    ),
    Stage(
        "warmup",
        "dflash.train.warmup:run",
        "compile the drafter step for every bucket shape on one thread",
        (
            Arg("--target", "target HF directory (config only)", REF),
            Arg("--record", "warmup record JSON to write", OUT),
            Arg("--cache-dir", "compile cache (default: compile.cache_dir)", None, False),
        ),
        rules=("warmup_compile",),
        # the drafter's shapes, not where its weights start (drafter.init is inert)
        config=(
            "results",
            "drafter",
            "compile",
            "target.mask_token_id",
            *BATCHING,
            "train.distill",
        ),  # fmt: skip
    ),
    Stage(
        "train",
        "dflash.train.loop:run",
        "train the drafter; run it under torchrun with targets + drafters processes "
        "(a colocated single drafter also runs alone)",
        (
            Arg("--target", "target HF directory", REF),
            Arg("--data", "tokenized training parquet", IN),
            Arg("--out", "drafter HF directory to write", OUT),
            Arg("--metrics", "metrics.jsonl to write", OUT),
            Arg("--summary", "throughput summary JSON to write", OUT),
            Arg("--checkpoints", "resumable checkpoints (not a declared output)", PATH),
            Arg(
                "--held-out",
                "tokenized eval split: tau_sim is logged on its first train.tau_sim.rows rows",
                REF,
                False,
            ),
        ),
        rules=("train",),
        config=TRAINING_CONFIG,
        code=TRAINING_CODE,
    ),
    Stage(
        "eval",
        "dflash.eval.run:run",
        "speculative decoding of the drafter and baselines",
        decoding(
            Arg("--tokenized", "tokenized eval split", IN),
            Arg("--output", "acceptance.json to write", OUT),
            Arg(
                "--train", "expand's train split: eval prompts found in it are reported", IN, False
            ),  # fmt: skip
        ),
        rules=("eval_acceptance",),
        config=EVAL_CONFIG,
        inert=(*SERVING, "eval.ddtree", "eval.sampling"),
    ),
    Stage(
        "ddtree",
        "dflash.eval.run:run_ddtree",
        "tree drafting (DDTree) from the same drafter, by budget",
        decoding(Arg("--output", "ddtree.json to write", OUT)),
        rules=("eval_ddtree",),
        config=EVAL_CONFIG,
        # the tree decodes with the trained drafter alone: no baselines, no teacher forcing
        inert=(*SERVING, "eval.baselines", "eval.with_lookup", "drafter", "eval.sampling"),
    ),
    Stage(
        "sample-eval",
        "dflash.eval.temperature:run",
        "the evaluation's methods again at each temperature of eval.sampling",
        decoding(
            Arg("--tokenized", "tokenized eval split (tau_sim at temperature)", IN),
            Arg("--acceptance", "eval's acceptance.json (greedy τ of the same prompts)", IN),
            Arg("--ddtree", "ddtree's ddtree.json (with eval.sampling.ddtree)", IN, False),
            Arg("--output", "sampling.json to write", OUT),
        ),
        rules=("eval_sampling",),
        config=EVAL_CONFIG,
        inert=(*SERVING, "eval.tie_margin"),
    ),
    serving("vllm", "vLLM's DFlash method"),
    serving("sglang", "SGLang's DFLASH worker"),
    Stage(
        "report",
        "dflash.eval.report:run",
        "results/summary.md and the report's plots, from the other outputs",
        (
            Arg("--stats", "stats.json of the length statistics", IN),
            Arg("--metrics", "training's metrics.jsonl", IN),
            Arg("--train-summary", "training's throughput summary JSON", IN),
            Arg("--acceptance", "the evaluation's acceptance.json", IN),
            Arg("--ddtree", "the DDTree evaluation's ddtree.json", IN),
            Arg("--vllm", "eval_vllm's vllm.json, where that stage ran", IN, False),
            Arg("--sglang", "eval_sglang's sglang.json, where that stage ran", IN, False),
            Arg("--sampling", "eval_sampling's sampling.json, where it ran", IN, False),
            Arg("--tokenized", "tokenize's report of the training split", IN, False),
            Arg("--drafter", "the trained drafter's folder, named in the summary", PARAM, False),
            Arg("--serve-target", "the target as a serving engine is given it", PARAM, False),
            Arg("--summary", "summary.md to write", OUT),
            Arg("--plots", "folder for the PNG plots", OUT),
        ),
        rules=("report",),
    ),
    Stage(
        "record",
        "dflash.record:run",
        "results/MANIFEST.json: every artefact's sha256 and the run record",
        (
            Arg("--results", "the results folder", PATH),
            Arg("--workflow-dir", "workflow folder whose files to hash", PATH, False),
            Arg("--output", "MANIFEST.json to write", PATH),
            Arg(
                "--input",
                "a folder the run read, made by a rule of its own under resources/ (the"
                " converted target): its files' sha256 are recorded as the input NAME; repeatable",
                None,
                False,
                {"dest": "inputs", "action": "append", "default": [], "metavar": "NAME=DIR"},
            ),
            Arg("outputs", "every declared output of the run", PATH, True, {"nargs": "+"}),
        ),
        rules=("record",),
        config=("",),
        manifest=False,
    ),
    Stage(
        "verify",
        "dflash.verify:run",
        "re-hash every artefact against the run record",
        (
            Arg(
                "run",
                "MANIFEST.json or results folder",
                None,
                options={"nargs": "?", "default": "results"},
            ),
        ),  # fmt: skip
        rules=("verify",),
        manifest=False,
        description="Re-hash every artefact against results/MANIFEST.json; report missing, "
        "changed and unrecorded files; exit 1 on any.",
    ),
    Stage(
        "compare",
        "dflash.compare:run",
        "why is run B different from run A? (ranked causes)",
        (
            Arg("run_a", "MANIFEST.json or results folder"),
            Arg("run_b", "MANIFEST.json or results folder"),
            Arg("--json", "machine-readable output", None, False, {"action": "store_true"}),
        ),
        manifest=False,
        description="Rank the recorded causes (topology, environment, code, config, data) of "
        "the throughput and τ differences between two runs.",
    ),
    Stage(
        "compute-curve",
        "dflash.eval.compute_curve:run",
        "τ against training tokens over several runs: a table and a plot",
        (
            Arg("runs", "results folders, e.g. one per data size", PATH, True, {"nargs": "+"}),
            Arg(
                "--name",
                "a label per run, in order (default: folder)",
                None,
                False,
                {"action": "append"},
            ),
            Arg("--out", "output folder", PATH, False, {"default": Path("compute-curve")}),
        ),  # fmt: skip
        manifest=False,
        description="Read each results folder's metrics (tau_sim against training tokens), "
        "evaluation (real τ) and data report; write compute_curve.md, .png and .json.",
    ),
    Stage(
        "random-target",
        "dflash.model.random_target:run",
        "write a rehearsal target: random seeded weights of a public config, a real tokenizer",
        (
            Arg(
                "--model-config",
                "transformers config.json (or a folder holding one), e.g. config/models/qwen3-8b",
                PATH,
            ),  # fmt: skip
            Arg("--tokenizer", "folder with the tokenizer's files", PATH),
            Arg("--out", "HF model directory to create", PATH),
            Arg("--seed", "torch seed of the weights", None, False, {"type": int, "default": 0}),
            Arg(
                "--device",
                "where to draw them (auto: cuda if present)",
                None,
                False,
                {"default": "auto"},
            ),  # fmt: skip
        ),
        manifest=False,
    ),
)

STAGES: dict[str, Stage] = {s.command: s for s in TABLE}


def by_rule(rule: str) -> Stage:
    """The stage a workflow rule runs."""
    for stage in TABLE:
        if rule in stage.rules:
            return stage
    raise KeyError(f"no stage of dflash.stages runs the rule {rule!r}")
