"""Pre-job checks: what the workflow refuses, or warns about, before any job runs.

The Snakefile calls `run` once, after Snakemake's schema validation and before any rule is
defined: a mistake found here costs a second, found by a stage it costs the stages before it.
Each check is a function of the `Run` in `CHECKS`, in order: it raises UserError to refuse (the
Snakefile shows the message as Snakemake shows its own, with no traceback) or returns a note
the workflow prints as a warning (None: nothing to say). A check reads the config and the
files it names; it writes nothing and starts no job.

To add a check: write `def check_something(run: Run) -> str | None`, put it in CHECKS where it
belongs (a later check may rely on an earlier one: the config has its nested defaults once
`config_is_valid` has passed), and test it through `run`.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from dflash import locks
from dflash.config import check_levers, check_paths, check_sources, validate
from dflash.errors import UserError


@dataclass(frozen=True)
class Run:
    """What the checks see: the merged config and facts of the Snakemake process."""

    config: dict
    # the Snakemake process that plans, not a cluster job parsing the Snakefile again
    main_process: bool = True
    # the config files given on the command line (empty: the embedded default)
    configfiles: tuple[str, ...] = ()
    workdir: Path = field(default_factory=Path.cwd)
    python: str = sys.executable
    # `snakemake --unlock`: it plans nothing, so no check of what a plan would make applies
    unlocking: bool = False
    # the keys given with `--config key=value`, which the config's errors name as such
    cli_config: dict = field(default_factory=dict)

    @property
    def results(self) -> Path:
        return Path(self.config["results"])

    @property
    def configfile_names(self) -> list[str]:
        """The config files as paths from the working directory, as a user gives them again."""
        return [os.path.relpath(Path(self.workdir, f), self.workdir) for f in self.configfiles]

    @property
    def drafter(self) -> Path:
        """The drafter this run writes (the workflow's DRAFTER)."""
        return self.results / "drafter"


Check = Callable[[Run], "str | None"]
EMBEDDED = Path(__file__).resolve().parents[1] / "config" / "config.yaml"


def config_is_valid(run: Run) -> None:
    """The schema's nested defaults filled in; every path the config names exists; held-out
    counts and held-out eval sets name sources that exist; training's levers go together."""
    files = run.configfile_names or [os.path.relpath(EMBEDDED, run.workdir)]
    check_paths(validate(run.config, files, run.cli_config), "the workflow config")
    check_sources(run.config, "the workflow config")
    check_levers(run.config, "the workflow config")


def python_is_the_environment(run: Run) -> None:
    """The rules call `python` from the bin folder of the Python running Snakemake (its first
    entry on the jobs' PATH): that must be this Python, or the jobs would run another one."""
    folder = os.path.dirname(run.python)
    python = os.path.join(folder, "python")
    if not (os.path.exists(python) and os.path.samefile(python, run.python)):
        raise UserError(
            f"{python} is not the Python running Snakemake ({run.python}), which the rules"
            " call as `python`: run Snakemake from a virtual environment (scripts/setup.sh)"
        )


def locks_explained(run: Run) -> str | None:
    """Locks left by a run killed outright stop this start with Snakemake's LockException, whose
    advice (--unlock) is wrong while the other run is alive: say whose they are, first."""
    return locks.explain(run.workdir) if run.main_process else None


def own_target_defaults(run: Run) -> str | None:
    """A target the workflow does not build is checked here (the target rule and the compile
    warmup check those it builds): its MASK token, chosen among the special tokens its chat
    template never emits when `target.mask_token_id` is null, and `drafter.target_layer_ids`
    inside its depth. Found by training, either cost regeneration. Says what was chosen."""
    target, drafter = run.config["target"], run.config["drafter"]
    if target["random_init"]:  # its tokenizer comes with the target rule; its depth is known
        from dflash.model.layer_ids import check_layer_ids

        path = Path(target["random_init"]["config"])
        depth = json.loads((path / "config.json" if path.is_dir() else path).read_text())
        layers = depth.get("text_config", depth)["num_hidden_layers"]
        check_layer_ids(drafter["target_layer_ids"], layers, drafter["num_layers"], str(path))
        return None
    if not target["path"]:
        return None
    from transformers import AutoConfig

    from dflash.model.layer_ids import check_layer_ids, default_layer_ids
    from dflash.model.mask_token import mask_token_choice

    mask, how = mask_token_choice(target["path"], target["mask_token_id"])
    layers = AutoConfig.from_pretrained(target["path"]).get_text_config().num_hidden_layers
    check_layer_ids(drafter["target_layer_ids"], layers, drafter["num_layers"], target["path"])
    chosen = []
    if target["mask_token_id"] is None:
        chosen.append(f"target.mask_token_id: null -> {mask}, {how}")
    if not drafter["target_layer_ids"]:
        ids = default_layer_ids(layers, drafter["num_layers"])
        chosen.append(f"drafter.target_layer_ids: null -> {ids} (of its {layers} layers)")
    return f"target {target['path']}: " + "; ".join(chosen) if chosen else None


def results_belong_to_this_config(run: Run) -> str | None:
    """A command whose config makes something else than the run already in `results` is
    refused before any job (dflash.run_owner); `--unlock` makes nothing and is let through."""
    if not run.main_process or run.unlocking:
        return None
    from dflash import run_owner

    folder = run.workdir / run.results
    return run_owner.check(run.config, run.configfile_names, folder, str(run.results))


def init_drafter_fits(run: Run) -> None:
    """An exported drafter to start from (drafter.init: <path>) is one; it is not the drafter this
    run writes (training would rewrite its own start, and its new hash would rerun training
    forever); for a user's target, it fits the run."""
    from dflash.model.start import init_path, read_config

    init = init_path(run.config["drafter"]["init"])
    if init is None:
        return
    if os.path.realpath(init) == os.path.realpath(run.drafter):
        raise UserError(
            f"drafter.init: {init} is the drafter this run writes, rewritten by every training:"
            f" copy it out of {run.results}/ first (cp -r {run.drafter} drafters/previous) and"
            " start from the copy"
        )
    read_config(init)
    if run.config["target"]["path"]:
        from dflash.train.features import drafter_config

        drafter_config(run.config, Path(run.config["target"]["path"]))


# In order: the config first (the others read its nested defaults).
CHECKS: list[Check] = [
    config_is_valid,
    python_is_the_environment,
    locks_explained,
    own_target_defaults,
    init_drafter_fits,
    results_belong_to_this_config,
]


def run(config: dict, **facts) -> list[str]:
    """Every check of CHECKS on this config (filled with its nested defaults in place); the
    notes to show. Raises UserError at the first refusal."""
    checked = Run(config, **facts)
    return [note for check in CHECKS if (note := check(checked))]
