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
metrics.jsonl stays the record; both are views of it.
"""

from __future__ import annotations

import logging
import os
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
    """Every live view: TensorBoard and, where configured, MLflow."""

    def __init__(self, run: Path, step: int, config: dict):
        self.views = [TensorBoard(run / "tensorboard", step, config["train"]["tensorboard"])]
        mlflow = mlflow_module(config["train"]["mlflow"])
        if mlflow is not None:
            self.views.append(MLflowRun(mlflow, run, config))

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


def mlflow_module(mode):
    """The `mlflow` module when `train.mlflow` (auto | true | false) says to log, else None."""
    if mode is False:
        return None
    try:
        import mlflow
    except ImportError:
        mlflow = None
    configured = bool(os.environ.get("MLFLOW_TRACKING_URI"))
    if mode is True and (mlflow is None or not configured):
        missing = "the mlflow package" if mlflow is None else "MLFLOW_TRACKING_URI"
        raise UserError(f"train.mlflow: true, but {missing} is missing (or set it to auto)")
    return mlflow if mlflow is not None and configured else None


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
