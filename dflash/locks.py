"""Whose are this working directory's Snakemake locks: a live run's, or a killed one's?

Snakemake locks the files a run reads and writes (.snakemake/locks) and releases them when it
ends, Ctrl-C included. A run killed outright (kill -9, the out-of-memory killer, a closed SSH
session, a lost node) leaves them, and the next start stops with a LockException whose advice,
`--unlock`, is wrong while another run is alive: both would then write the same files. So the
workflow records each run's process when it starts (`record_run`, in onstart, once it holds its
locks) and forgets it when it ends, and a later start names the case (`explain`).
"""

from __future__ import annotations

import os
import socket
import sys
import time
from pathlib import Path

from dflash import forkserver
from dflash.io import read_json, write_json

LOCKS = Path(".snakemake") / "locks"
RUNS = Path(".snakemake") / "dflash-runs"


def _record(workdir: Path) -> Path:
    return workdir / RUNS / f"{socket.gethostname()}-{os.getpid()}.json"


def record_run(workdir: str | os.PathLike = ".") -> None:
    write_json(
        _record(Path(workdir)),
        {
            # what started the run (a served Snakemake's client, whose command line names it)
            "pid": forkserver.caller_pid(),
            "host": socket.gethostname(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "command": " ".join(sys.argv),
        },
    )


def forget_run(workdir: str | os.PathLike = ".") -> None:
    _record(Path(workdir)).unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    """Whether process `pid` of this host exists and is a snakemake (a pid is reused)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    cmdline = Path(f"/proc/{pid}/cmdline")
    return not cmdline.exists() or b"snakemake" in cmdline.read_bytes()


def explain(workdir: str | os.PathLike = ".") -> str | None:
    """What to do about the locks in `workdir`, or None if there are none."""
    workdir = Path(workdir).resolve()
    locks = workdir / LOCKS
    if not locks.is_dir() or not any(locks.iterdir()):
        return None
    runs = []
    for path in sorted((workdir / RUNS).glob("*.json")):
        try:
            runs.append(read_json(path))
        except (OSError, ValueError):
            continue
    here = socket.gethostname()
    head = f"Snakemake's locks in {locks} belong to"
    described = [f"snakemake pid {r['pid']} on {r['host']}, started {r['started']}" for r in runs]
    live = [
        d for r, d in zip(runs, described, strict=True) if r["host"] == here and _alive(r["pid"])
    ]
    elsewhere = [d for r, d in zip(runs, described, strict=True) if r["host"] != here]
    if live:
        return (
            f"{head} a run that is still alive ({'; '.join(live)}): wait for it to end, or stop"
            " it (kill PID, or Ctrl-C in its terminal: it then releases its locks) before"
            " starting another here. Do not run `snakemake --unlock` now: two runs would write"
            " the same files."
        )
    if elsewhere:
        return (
            f"{head} a run on another host ({'; '.join(elsewhere)}): check there whether it"
            " still runs (`ps -p PID`); only if it does not, run `snakemake --unlock` here."
        )
    if runs:
        return (
            f"{head} a run that is gone ({'; '.join(described)}): it was killed without"
            " releasing them. Run `snakemake --unlock` (with the same arguments as the run),"
            " then start again: unfinished jobs are redone, and regeneration and training"
            " resume from their checkpoints."
        )
    return (
        f"{head} a run this workflow did not record: if `ps -ef | grep snakemake` shows no"
        " other snakemake in this folder, run `snakemake --unlock`, then start again."
    )
