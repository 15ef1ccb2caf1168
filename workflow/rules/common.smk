# Shared helpers: result paths, the exact config subset each rule depends on, and hashes of the
# code and environment (Snakemake cannot see imported modules or pip upgrades by itself); the
# rule files' input and param functions live here too, so that those files hold rules only.
import importlib.util
import json
import re
import shlex
import shutil
import sys
from pathlib import Path

from snakemake.io import is_flagged
from snakemake.logging import logger

from dflash.config import expand_user
from dflash.custody import damaged, pending, quarantine
from dflash.errors import UserError
from dflash.record import read_record
from dflash.custody import rel as custody_rel
from dflash.filehash import HashCache
from dflash.eval.report import PLOTS
from dflash.eval.sglang_stage import sglang_installed
from dflash.io import sha256_json
from dflash import auto_memory, locks, run_owner
from dflash import stages
from dflash.errors import UserError
from dflash.manifest import code_files, environment_hash
from dflash.model.start import init_identity, init_path


onstart:
    locks.record_run()
    # what this run is of (dflash/run_owner.py) and the batch sizes `auto` chose, for its next
    # starts: a real run only, never a dry run
    run_owner.record(config, CONFIGFILES, Path(R))
    auto_memory.keep(AUTO_MEMORY, Path(R, "work", "auto-memory.json"))


onsuccess:
    locks.forget_run()


onerror:
    locks.forget_run()


R = config["results"]
# Reference inputs fetched or converted once (the target rule's conversion), outside the results
# of any one run, so that `rm -rf results` converts and downloads nothing again.
RES = config["resources"]
EVAL_ROWS = config["data"]["eval_rows"]  # a count, or a count per source
SPLITS = (
    ["train", "eval"]
    if (sum(EVAL_ROWS.values()) if isinstance(EVAL_ROWS, dict) else EVAL_ROWS) > 0
    else ["train"]
)
ENV_HASH = environment_hash()
# Whether GPU rules ask for GPUs: on a SLURM login node there may be no nvidia-smi, yet the jobs
# run on GPU nodes (the SLURM profile sets gpu_jobs: true).
HAS_GPU = (
    shutil.which("nvidia-smi") is not None
    if config["gpu_jobs"] == "auto"
    else config["gpu_jobs"] in (True, "true")
)
COMPILE_CACHE = config["compile"]["cache_dir"] or f"{R}/compile-cache"
# The user's input files enter the rule params by content (sha256), cached by path, size, times
# and inode (dflash/filehash.py): a multi-GB target directory is hashed on the first DAG build
# only, and then whenever a file in it changes; otherwise it costs a stat per file.
HASHES = HashCache(expand_user(config["cache_dir"]))


def content_hash(path):
    digest = HASHES.sha256(expand_user(path))
    HASHES.save()
    return digest


def passed(value):
    """A param the shell command reads that is no rerun trigger: Snakemake tracks every param
    but those derived from a job's input or output, so it is given as a function of the output.
    For the config a stage reads (keys that change no output among them) and for places (caches,
    resume state, the target's folder, which enters the triggers by its content)."""

    def param(wildcards, output):
        return value

    return param


def stage_config(rule):
    """The --config of a rule's stage: the keys it reads (dflash/stages), nested as in the
    config. Passed on, not a trigger: the keys its outputs depend on are (`triggers`).
    """
    return passed(json.dumps(stages.by_rule(rule).passed(config), sort_keys=True))


def triggers(rule, files=None):
    """A rule's rerun triggers, one param each, so that a dry run's reason names what changed:
    every config key its stage's outputs depend on ("train.lr=0.0006", dflash/stages), every
    source file of its code ("code dflash/train/loop.py <sha256>": Snakemake cannot see
    imported modules), the installed environment (nor pip upgrades), and the files in `files`
    (name -> sha256, or name -> {path: sha256}) by content."""
    stage = stages.by_rule(rule)
    found = {f"{k}={param_json(v)}" for k, v in stage.depends(config).items()}
    found |= {f"code {p} {d}" for p, d in code_files(*stage.modules).items()}
    found.add(f"environment {ENV_HASH}")
    for name, digest in (files or {}).items():
        if isinstance(digest, dict):
            found |= {f"{name} {p} {d}" for p, d in digest.items()}
        elif digest is not None:
            found.add(f"{name} {digest}")
    return {f"trigger{i}": t for i, t in enumerate(sorted(found))}


JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')


def param_json(value):
    """JSON for a param. Snakemake reads "{name}" in a param as a wildcard, so braces inside
    JSON strings (a source's template, "{question}") are written as \u007b / \u007d, which
    JSON reads back as braces."""
    return JSON_STRING.sub(
        lambda m: m.group(0).replace("{", "\\u007b").replace("}", "\\u007d"),
        json.dumps(value, sort_keys=True),
    )


def random_init_config_hash():
    """sha256 of a rehearsal target's model config, so editing it rebuilds the target."""
    spec = config["target"]["random_init"]
    if not spec:
        return None
    path = spec["config"]
    return content_hash(
        os.path.join(path, "config.json") if os.path.isdir(path) else path
    )


def target_key():
    """The target rule's folder name under resources/target: a readable name and a hash of
    everything that builds it (the target config, a rehearsal's model config). Configs naming
    the same target share one conversion; two different targets never overwrite each other.
    """
    cfg = config["target"]
    if cfg["random_init"]:
        model_config = os.path.normpath(cfg["random_init"]["config"])
        name = os.path.basename(model_config).removesuffix(".json") + "-random"
    elif cfg["gguf_wheel"]:
        name = os.path.splitext(os.path.basename(cfg["gguf_wheel"]["file"]))[0]
    else:
        name = cfg["hub_id"] or "target"
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", name)
    built = {"target": cfg, "model_config": random_init_config_hash()}
    return f"{name}-{sha256_json(built)[:12]}"


# The target rule's folder: the HF directory, its facts (target.json) and its stage manifest.
TARGET_KEY = target_key()
TARGET_DIR = f"{RES}/target/{TARGET_KEY}"
# The target as an HF directory: the user's local path, or the target rule's output.
TARGET = config["target"]["path"] or f"{TARGET_DIR}/hf"
# The target as a serving engine is given it (results/summary.md's command lines).
SERVE_TARGET = config["target"]["path"] or config["target"]["hub_id"] or TARGET
# `auto` batch sizes (data.token_budget, data.max_batch_size, drafter.max_anchors) resolved to
# numbers before any rule reads them, from the training GPU's free memory and the target's shapes
# (dflash/auto_memory.py); the dry run shows them, and training logs them (DFLASH_AUTO_MEMORY).
try:
    AUTO_MEMORY = auto_memory.resolve(
        config, HAS_GPU, f"{TARGET_DIR}/hf", Path(R, "work", "auto-memory.json")
    )
except UserError as e:
    raise WorkflowError(str(e)) from None
if AUTO_MEMORY.note and workflow.is_main_process:
    logger.info(f"dflash: {AUTO_MEMORY.note}")
# Jobs run `python -m dflash` of the environment running Snakemake, as if it were activated
# (`.venv/bin/snakemake` needs no `source .venv/bin/activate`): its bin folder comes first on the
# jobs' PATH, which srun passes on to every node (dflash.preflight checked that its `python` is
# this Python); and they are told what `auto` chose, for their logs. Not params: where the
# environment lives and why a size was chosen are no reason to rerun; what the environment holds
# (ENV_HASH) and the sizes themselves are.
shell.prefix(
    f'set -euo pipefail; export PATH={shlex.quote(os.path.dirname(sys.executable))}:"$PATH"; '
    + (
        f"export DFLASH_AUTO_MEMORY={shlex.quote(AUTO_MEMORY.note)}; "
        if AUTO_MEMORY.note
        else ""
    )
)
# The config files as given (the embedded default: none), recorded with the run.
CONFIGFILES = [os.path.relpath(f) for f in workflow.overwrite_configfiles or ()]
# The target rule's folder, for the aggregate rules only, so that a deleted one is rebuilt.
TARGET_FOLDER = [] if config["target"]["path"] else [TARGET]
# The trained drafter, declared as files: its config, weights and modeling file (auto_map).
DRAFTER = f"{R}/drafter"
DRAFTER_FILES = [
    f"{DRAFTER}/{f}" for f in ("config.json", "model.safetensors", "dflash.py")
]


def target_input():
    """What a job reading the target depends on. Never a folder's date: Snakemake dates a
    directory by a marker file it cannot checksum, so a `touch` reran every rule that reads the
    target. The target rule's folder is read through its stage manifest, which holds the sha256
    of every file in it; a user's folder is ancient() and identified by its files' sha256 in
    the params (target_fingerprint()).
    """
    path = config["target"]["path"]
    return ancient(path) if path else f"{TARGET_DIR}/manifest.json"


# An exported drafter to start from (drafter.init: <path>), checked by dflash.preflight.
INIT = init_path(config["drafter"]["init"])


def init_identity_param():
    """sha256 of the init drafter's files: replacing them reruns training, and only training.
    Hashed at every start (a second or two for an 8B target's drafter, 2 GB)."""
    return init_identity(config["drafter"]["init"]) if INIT else None


def user_target_hashes():
    """sha256 of every file of a user-supplied target directory (None for the target rule's,
    identified by its stage manifest): new weights of the same shape rerun what reads them.
    """
    path = config["target"]["path"]
    if not path:
        return None
    hashes = HASHES.tree(expand_user(path))
    HASHES.save()
    return hashes


TARGET_FILES = user_target_hashes()


def target_fingerprint():
    """The params entry of a user-supplied target: its files' sha256 (user_target_hashes)."""
    return TARGET_FILES


def regenerated(split):
    if config["data"]["regenerate"]["enabled"]:
        return f"{R}/data/regenerated/{split}.parquet"
    return f"{R}/data/expanded/{split}.parquet"


def local_source_hashes():
    """sha256 of local data files, so editing one reruns expand (mtimes are not a trigger)."""
    return {
        s["path"]: content_hash(s["path"])
        for s in config["data"]["sources"]
        if "path" in s
    }


def previous_stats_hash():
    """sha256 of the stats file to compare against, so replacing it reruns the comparison."""
    path = config["data"]["previous_stats"]
    return content_hash(path) if path else None


# train.smk


def held_out_rows(wildcards):
    """The tokenized eval split, read for tau_sim when there is one and it is on."""
    if "eval" in SPLITS and config["train"]["tau_sim"]["every"] > 0:
        return {"held_out": f"{R}/data/tokenized/eval.parquet"}
    return {}


# eval.smk


def eval_inputs():
    """What both decoding rules read."""
    return {
        "target": target_input(),
        "drafter": DRAFTER_FILES,
        "held_out": f"{R}/data/expanded/eval.parquet",
    }


def eval_files():
    """What the decoding rules read by content: local benchmark files (replacing one reruns the
    evaluation) and a user's target."""
    sets = {
        s["path"]: content_hash(s["path"])
        for s in config["eval"]["sets"]
        if s.get("path")
    }
    return {"eval.sets": sets, "target.path": target_fingerprint()}


# record.smk, included last: these read the other rules' outputs


def recorded_rules():
    """The rules whose outputs this config produces under results/ (not the target rule: its
    conversion is an input of the run, recorded as one)."""
    names = ["expand_dataset", "tokenize", "length_stats", "warmup_compile", "train"]
    names += ["eval_acceptance", "eval_ddtree", "report"]
    if WITH_VLLM:  # eval.smk, included before the record rule calls this
        names.append("eval_vllm")
    if WITH_SGLANG:
        names.append("eval_sglang")
    if WITH_SAMPLING:
        names.append("eval_sampling")
    if config["data"]["regenerate"]["enabled"]:
        names += ["regenerate_shard", "regenerate"]
    return names


# The run's inputs made by rules of their own under resources/, recorded as inputs (name -> the
# stage manifest in the folder to record): the target rule's conversion.
RECORDED_INPUTS = {} if config["target"]["path"] else {"target": target_input()}


def declared_outputs(folders=True):
    """Every output those rules declare, wildcards filled in (logs and working state are not
    outputs and are not recorded); without directory() outputs if not `folders`."""
    paths = set()
    for name in recorded_rules():
        for pattern in workflow.get_rule(name).output:
            if folders or not is_flagged(pattern, "directory"):
                # both splits: the eval rules read the eval split even when data.eval_rows is 0
                paths.update(
                    expand(str(pattern), split=["train", "eval"], shard=range(SHARDS))
                )
    return sorted(paths)


# custody, called by the Snakefile once every rule is defined


def custody_outputs():
    """Every output that a stage manifest records: the recorded rules' and the target
    rule's conversion under resources/."""
    outputs = declared_outputs()
    if not config["target"]["path"]:
        outputs += [str(f) for f in workflow.get_rule("target").output]
    return outputs


def check_custody():
    """Move aside every declared output that differs from what its rule recorded (a flipped
    bit, a truncated copy, an edit) into results/work/damaged/, and return those not made
    again yet: the target rules ask for them, so that Snakemake runs their rules (and what
    follows) before anything reads them. Snakemake itself never looks at an output again once
    its job has ended (dflash.custody).

    Only in the Snakemake process that plans (a cluster job parses the Snakefile again), and
    not while another run holds the lock: its jobs write outputs before their manifests.
    """
    outputs = custody_outputs()
    locks = os.path.join(".snakemake", "locks")
    if workflow.is_main_process and not (os.path.isdir(locks) and os.listdir(locks)):
        manifests = sorted(Path(R, "manifests").glob("*.json"))
        if not config["target"]["path"]:
            manifests.append(Path(TARGET_DIR, "manifest.json"))
        for path, reasons in damaged(manifests, outputs, Path(R), HASHES).items():
            moved = quarantine(path, Path(R))
            logger.warning(
                f"dflash: {custody_rel(path)} is not what its producer wrote; moved to"
                f" {custody_rel(moved)}, it is made again before anything reads it:"
                f" {'; '.join(reasons)}"
            )
        # the run record itself (no stage manifest holds it): one cut short or emptied is
        # moved aside too, so that the command `verify` advises writes it again
        record = Path(R, "MANIFEST.json")
        try:
            if record.is_file():
                read_record(record, "dflash")
        except UserError as e:
            moved = quarantine(record, Path(R))
            logger.warning(
                f"dflash: moved to {custody_rel(moved)}, to be written again by `record`. {e}"
            )
    return pending(outputs, Path(R))
