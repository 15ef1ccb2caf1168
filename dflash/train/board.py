"""Live training curves, from the records metrics.jsonl gets, while the run goes on.

TensorBoard event files beside each run's checkpoints:

    tensorboard --logdir results/checkpoints

One folder per run (`run-<contract>/tensorboard`), so runs of other configs appear side by side.
A resumed run purges the events after the step it resumed from, as it does its live metrics.
Without the `tensorboard` package (a lean GPU image), training says so once and carries on.

MLflow (`train.mlflow`): `auto` logs where the `mlflow` package is installed and
`MLFLOW_TRACKING_URI` names a tracking server or store (how MLflow users configure it), `true`
requires both, `false` never logs. One MLflow run per training run: its id is kept in the run
folder, so a resumed run continues the same MLflow run (MLflow keeps a metric's history, so the
steps after the checkpoint appear twice there); an attempt that fails ends it FAILED, the one
that finishes ends it FINISHED. The run's parameters are the config, flattened.

Weights & Biases (`train.wandb`): `auto` logs where the `wandb` package is installed and
`WANDB_PROJECT` or `WANDB_MODE` is set (how W&B users configure it; `WANDB_MODE=offline` writes
the run locally, for `wandb sync` later, and needs no network or account), `true` requires both,
`false` never logs. One W&B run per training run, in project `WANDB_PROJECT` (default dflash),
named after the run folder, with the config; its id is kept in the run folder, so a resumed run
continues the same W&B run (W&B steps only go forward: the steps a resume repeats keep the values
the first attempt logged there); a failed attempt finishes it with exit code 1. Its files go
under the run folder (`wandb/`) unless `WANDB_DIR` says otherwise.

metrics.jsonl stays the record; all three are views of it. A tracker that is not configured is
not imported.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import secrets
from pathlib import Path

from dflash.config import flatten
from dflash.errors import UserError
from dflash.io import atomic_path

log = logging.getLogger(__name__)

# metrics record key -> TensorBoard tag
SCALARS = {
    "loss": "train/loss",
    "tau": "train/tau_teacher_forced",
    "tau_sim": "train/tau_sim_held_out",
    "tau_sim_first": "train/tau_sim_held_out_first_answers",
    "lr": "train/lr",
    "grad_norm": "train/grad_norm",
    "tokens_per_s": "throughput/tokens_per_s",
}


class Board:
    """Every live view: TensorBoard and, where configured, MLflow and Weights & Biases."""

    def __init__(self, run: Path, step: int, config: dict):
        # both checked before either starts a run: a `true` that cannot log fails here
        mlflow = mlflow_module(config["train"]["mlflow"])
        wandb = wandb_module(config["train"]["wandb"])
        self.views = [TensorBoard(run / "tensorboard", step, config["train"]["tensorboard"])]
        if mlflow is not None:
            self.views.append(MLflowRun(mlflow, run, config))
        if wandb is not None:
            self.views.append(WandbRun(wandb, run, config))

    def log(self, record: dict) -> None:
        for view in self.views:
            view.log(record)

    def close(self, failed: bool = False) -> None:
        for view in self.views:
            view.close(failed)


def scalars(record: dict) -> dict[str, float]:
    """The record's curves by tag: SCALARS and the acceptance rate per block slot."""
    out = {tag: record[key] for key, tag in SCALARS.items() if key in record}
    for k, acc in enumerate(record.get("acc", []), start=1):
        out[f"acceptance_per_slot/{k:02d}"] = acc
    for key, value in record.items():  # tau_sim at each temperature, e.g. tau_sim_T=1
        if key.startswith("tau_sim_T="):
            out[f"train/tau_sim_held_out_{key.removeprefix('tau_sim_')}"] = value
    return out


class TensorBoard:
    def __init__(self, folder: Path, step: int, enabled: bool = True):
        self.writer = None
        if not enabled:
            return
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            log.info("train.tensorboard: the tensorboard package is not installed; no event files")
            return
        self.writer = SummaryWriter(str(folder), purge_step=step or None)

    def log(self, record: dict) -> None:
        if self.writer is None:
            return
        for tag, value in scalars(record).items():
            self.writer.add_scalar(tag, value, record["step"])
        self.writer.flush()  # live: a reader sees each step as it is logged

    def close(self, failed: bool = False) -> None:
        if self.writer is not None:
            self.writer.close()


def tracker_module(key: str, mode, configured: bool, variables: str):
    """The tracker's module when `train.<key>` (auto | true | false) says to log, else None:
    imported only then (wandb and mlflow take seconds to import)."""
    if mode is False or (mode == "auto" and not configured):
        return None
    module = None
    if importlib.util.find_spec(key) is not None:
        module = importlib.import_module(key)
    if mode is True and (module is None or not configured):
        missing = f"the {key} package" if module is None else variables
        raise UserError(f"train.{key}: true, but {missing} is missing (or set it to auto)")
    return module


def mlflow_module(mode):
    """The `mlflow` module when `train.mlflow` says to log (MLFLOW_TRACKING_URI set), else None."""
    configured = bool(os.environ.get("MLFLOW_TRACKING_URI"))
    return tracker_module("mlflow", mode, configured, "MLFLOW_TRACKING_URI")


def wandb_module(mode):
    """The `wandb` module when `train.wandb` says to log (WANDB_PROJECT or WANDB_MODE set, and
    WANDB_MODE not disabled), else None."""
    wandb_mode = os.environ.get("WANDB_MODE", "")
    configured = wandb_mode != "disabled" and bool(wandb_mode or os.environ.get("WANDB_PROJECT"))
    return tracker_module("wandb", mode, configured, "WANDB_PROJECT or WANDB_MODE")


class MLflowRun:
    """One MLflow run per training run (its id kept in the run folder, for resumes)."""

    def __init__(self, mlflow, run: Path, config: dict):
        self.mlflow = mlflow
        id_file = run / "mlflow_run_id"
        mlflow.set_experiment(os.environ.get("MLFLOW_EXPERIMENT_NAME", "dflash"))
        if id_file.exists():
            self.active = mlflow.start_run(run_id=id_file.read_text().strip())
        else:
            self.active = mlflow.start_run(run_name=run.name)
            # MLflow's limit on a parameter value: 500 characters
            mlflow.log_params({k: str(v)[:500] for k, v in flatten(config).items()})
            with atomic_path(id_file) as tmp:
                tmp.write_text(self.active.info.run_id)
        log.info("mlflow: run %s at %s", self.active.info.run_id, mlflow.get_tracking_uri())

    def log(self, record: dict) -> None:
        self.mlflow.log_metrics(scalars(record), step=record["step"])

    def close(self, failed: bool = False) -> None:
        # a resumed run is the same MLflow run: FAILED until a later attempt finishes it
        self.mlflow.end_run(status="FAILED" if failed else "FINISHED")


class WandbRun:
    """One W&B run per training run (its id kept in the run folder, for resumes)."""

    def __init__(self, wandb, run: Path, config: dict):
        self.wandb = wandb
        id_file = run / "wandb_run_id"
        if id_file.exists():
            run_id = id_file.read_text().strip()
        else:
            run_id = secrets.token_hex(8)
            with atomic_path(id_file) as tmp:
                tmp.write_text(run_id)
        folder = None
        if not os.environ.get("WANDB_DIR"):
            folder = run  # wandb adds its own wandb/ folder
        self.active = wandb.init(
            project=os.environ.get("WANDB_PROJECT") or "dflash",
            name=run.name,
            id=run_id,
            resume="allow",
            config=config,
            dir=folder,
        )
        log.info("wandb: run %s (%s)", run_id, "offline" if self.active.offline else "online")

    def log(self, record: dict) -> None:
        self.active.log(scalars(record), step=record["step"])

    def close(self, failed: bool = False) -> None:
        self.active.finish(exit_code=1 if failed else 0)
