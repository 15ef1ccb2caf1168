"""What a stage of the registry (dflash/stages/__init__.py) declares, and what follows from it.

- `run`: "module:function"; the function takes the parsed arguments and returns None, or a dict
  of what its manifest records beyond its declared arguments ({"inputs": ..., "outputs": ...,
  "params": ...}), or ELSEWHERE where another process of the stage records it (torchrun ranks);
- `args`: its command-line arguments. A role says what a path is: IN, a file it reads (checked
  against its producer's record before any work, and hashed into its manifest); REF, one it
  reads that is checked but not hashed again (the target's folder, GBs, identified by its own
  manifest); OUT, a file it writes (hashed into its manifest); PATH, a place (resume state, a
  cache); PARAM, a setting recorded in the manifest's params;
- `config`: the config keys it reads (dotted; a section stands for all its keys; "" for the
  whole config), which its rule passes as --config;
- `inert`: those of them no output of the stage depends on (besides INERT, which holds for all):
  the others are the rule's rerun triggers, one param a key so that a dry run's reason names the
  key ("train.lr=0.0006"), and the params of the stage manifest;
- `code`: the modules whose source, with every `dflash` module they import, is the stage's code:
  a rerun trigger too, one param a file.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from dflash.config import flatten

IN, REF, OUT, PARAM, PATH = "in", "ref", "out", "param", "path"
# A stage function's answer for a process that writes no manifest (another rank records the run).
ELSEWHERE = "recorded by another process"

# Keys no output depends on, in any stage: places of caches and results, trackers, timeouts,
# checkpoint cadence (resuming is byte-identical), parallelism that does not change the bytes.
INERT = (
    "results",
    "resources",
    "gpu_jobs",
    "gpu_memory_gb",  # how `auto` batch sizes are found; the sizes found are triggers
    "overwrite_results",  # one command's leave to plan over another config's run
    "cache_dir",
    "compile.cache_dir",
    "data.num_proc",
    "drafter.init",  # a path: the init drafter's files are the train rule's trigger (their sha256)
    "train.tensorboard",
    "train.mlflow",
    "train.wandb",
    "train.checkpoint_every",
    "train.keep_checkpoints",
    "train.timeout_s",
    "train.startup_timeout_s",
    "train.queue_depth",
    "train.rdzv_endpoint",
)


@dataclass(frozen=True)
class Arg:
    flag: str  # "--held-out", or a positional argument's name
    help: str
    role: str | None = None
    required: bool = True
    options: dict = field(default_factory=dict)  # argparse's: type, nargs, default, action, ...

    @property
    def dest(self) -> str:
        return self.options.get("dest") or self.flag.lstrip("-").replace("-", "_")

    def add_to(self, parser) -> None:
        options = {"type": Path} if self.role in (IN, REF, OUT, PATH) else {}
        options |= self.options
        if self.flag.startswith("-"):
            options["required"] = self.required
        parser.add_argument(self.flag, help=self.help, **options)


@dataclass(frozen=True)
class Stage:
    command: str
    run: str  # "module:function"
    help: str
    args: tuple[Arg, ...] = ()
    rules: tuple[str, ...] = ()  # the workflow rules that run it
    config: tuple[str, ...] = ()  # keys it reads ("" : the whole config); () : no --config
    inert: tuple[str, ...] = ()  # of those, keys its outputs do not depend on (with INERT)
    code: tuple[str, ...] = ()  # modules it runs (default: the run function's)
    manifest: bool = True  # writes a stage manifest (--manifest)
    description: str | None = None

    @property
    def modules(self) -> tuple[str, ...]:
        return self.code or (self.run.split(":")[0],)

    def paths(self, role: str) -> tuple[Arg, ...]:
        return tuple(a for a in self.args if a.role == role)

    def reads(self, args) -> dict:
        """What the stage reads (IN and REF arguments given): checked before any work."""
        found = {a.dest: getattr(args, a.dest, None) for a in self.args if a.role in (IN, REF)}
        return {k: v for k, v in found.items() if v is not None}

    def passed(self, config: dict) -> dict:
        """The config the stage reads: its keys of `config`, nested as there."""
        return subset(config, self.config)

    def depends(self, config: dict) -> dict:
        """Dotted key -> value of every config key the stage's outputs depend on."""
        flat = flatten(self.passed(config))
        inert = (*INERT, *self.inert)
        return {k: v for k, v in flat.items() if k and not _under(k, inert)}

    def recorded(self, args, made: dict | None) -> tuple[dict, dict, dict]:
        """(inputs, outputs, params) of the stage's manifest: its IN and OUT arguments, its PARAM
        arguments and the config its outputs depend on, and what the function returned."""
        made = made or {}

        def given(role):
            found = {a.dest: getattr(args, a.dest, None) for a in self.paths(role)}
            return {k: v for k, v in found.items() if v is not None}

        config = getattr(args, "config", None) or {}
        params = unflatten(self.depends(config)) | given(PARAM) | made.get("params", {})
        inputs = given(IN) | made.get("inputs", {})
        return inputs, given(OUT) | made.get("outputs", {}), params


def _under(key: str, prefixes) -> bool:
    return any(key == p or key.startswith(p + ".") for p in prefixes)


def unflatten(flat: dict) -> dict:
    out: dict = {}
    for key, value in flat.items():
        *parents, leaf = key.split(".")
        node = out
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return out


def subset(config: dict, keys) -> dict:
    """The named keys of a nested config ("" : all of it), nested as there; a key the config
    lacks is left out."""
    out: dict = {}
    for key in keys:
        if key == "":
            return json.loads(json.dumps(config))
        *parents, leaf = key.split(".")
        src = config
        for p in parents:
            src = src.get(p) if isinstance(src, dict) else None
        if not isinstance(src, dict) or leaf not in src:
            continue  # no empty parents for a key the config lacks
        dst = out
        for p in parents:
            dst = dst.setdefault(p, {})
        dst[leaf] = json.loads(json.dumps(src[leaf]))
    return out
