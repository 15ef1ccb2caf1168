"""Where a run's checkpoints, live metrics and per-rank traces live, and where it resumes: each run
in a folder named by its resume contract."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from dflash.errors import UserError
from dflash.io import atomic_path, read_json, sha256_json
from dflash.train import comm
from dflash.train.checkpoint import check_contract, contract_diff, latest_valid

log = logging.getLogger(__name__)


class Trace:
    """Per-rank event log (one line per batch): routing, waits and queue depth over time."""

    def __init__(self, folder: Path, rank: int):
        folder.mkdir(parents=True, exist_ok=True)
        self.file = (folder / f"rank{rank}.jsonl").open("a", encoding="utf-8")

    def __call__(self, **event) -> None:
        self.file.write(json.dumps(event) + "\n")
        self.file.flush()


def run_folder(checkpoints: Path, contract: dict) -> Path:
    """Each run's checkpoints live in a folder named by its resume contract: a changed config,
    drafter count or training code starts a new run beside the old one (which stays intact),
    while a crashed run finds its own folder again."""
    return checkpoints / f"run-{sha256_json(contract)[:12]}"


def resume_point(ctx: comm.Dist, checkpoints: Path, contract: dict | None) -> dict:
    """Rank 0 (a drafter, the only rank that knows the contract) picks this run's folder and its
    newest valid checkpoint; everyone learns both."""
    point = {"step": 0, "epoch": 0, "position": 0, "folder": None, "run": None}
    if ctx.rank == 0:
        contract = json.loads(json.dumps(contract))  # as it reads back from meta.json
        run = run_folder(checkpoints, contract)
        point["run"] = str(run)
        try:
            found = latest_valid(run)
            if found is not None:
                folder, meta = found
                check_contract(meta["contract"], contract, folder)
                point |= {k: meta[k] for k in ("step", "epoch", "position")}
                point["folder"] = str(folder)
            else:
                _log_new_run(checkpoints, run, contract)
        except UserError as e:
            point = {"error": str(e)}
    point = ctx.broadcast(point)
    if "error" in point:
        raise UserError(point["error"])
    return point


def _log_new_run(checkpoints: Path, run: Path, contract: dict) -> None:
    """Say which earlier run this one differs from (a log line only: never fails the run, and
    reads one meta.json instead of re-hashing old checkpoints)."""
    metas = sorted(checkpoints.glob("run-*/step-*/meta.json"), key=lambda p: p.stat().st_mtime)
    metas = [m for m in metas if m.parents[1] != run]
    if not metas:
        log.info("new run: checkpoints in %s", run)
        return
    try:
        diff = "\n".join(contract_diff(read_json(metas[-1])["contract"], contract))
    except (OSError, ValueError, KeyError, TypeError) as e:
        diff = f"  (cannot read {metas[-1]}: {e})"
    log.info(
        "new run: checkpoints in %s; other runs kept in %s (delete them when no longer "
        "needed), the latest differs in:\n%s",
        run,
        checkpoints,
        diff,
    )


def keep_metrics_upto(live: Path, step: int) -> None:
    """Drop live-log lines past `step`: a crash may have logged steps after the checkpoint."""
    lines = live.read_text().splitlines() if live.exists() else []
    kept = [line for line in lines if json.loads(line)["step"] <= step]
    with atomic_path(live) as tmp:
        tmp.write_text("".join(line + "\n" for line in kept))
