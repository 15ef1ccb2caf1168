"""Which GPU a job takes when Snakemake runs several GPU jobs at once on one host.

Snakemake counts GPUs (`resources: gpu=1` against `--resources gpu=N`) but does not say which
one a job may use, so every job would pick `cuda:0`. A job here takes the first visible GPU that
no other job holds, through an exclusive `flock` on a per-GPU lock file named by the GPU's UUID
(the same physical GPU under any CUDA_VISIBLE_DEVICES numbering, e.g. two SLURM jobs on one
node). The kernel drops the lock when the process ends, however it ends: a killed job never
leaves its GPU claimed.
"""

from __future__ import annotations

import fcntl
import logging
import os
import tempfile
from pathlib import Path

import torch

from dflash.errors import UserError

log = logging.getLogger(__name__)
_held: list[int] = []  # lock file descriptors, open for the life of the process


def lock_dir() -> Path:
    return Path(os.environ.get("DFLASH_GPU_LOCKS") or Path(tempfile.gettempdir()) / "dflash-gpus")


def claim_gpu() -> torch.device:
    """The first visible GPU not held by another process of this host (CPU when none)."""
    count = torch.cuda.device_count()
    if count == 0:
        return torch.device("cpu")
    folder = lock_dir()
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(count):
        uuid = str(torch.cuda.get_device_properties(i).uuid)
        fd = os.open(folder / f"{uuid}.lock", os.O_CREAT | os.O_RDWR, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        _held.append(fd)
        log.info("claimed GPU %d (%s)", i, uuid)
        return torch.device("cuda", i)
    raise UserError(
        f"all {count} visible GPUs are held by other jobs (locks in {folder}): run with "
        "--resources gpu=N no larger than the GPUs this host has free"
    )
