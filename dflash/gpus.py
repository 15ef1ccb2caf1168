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
import time
from pathlib import Path

import torch

log = logging.getLogger(__name__)
_held: list[int] = []  # lock file descriptors, open for the life of the process


def lock_dir() -> Path:
    return Path(os.environ.get("DFLASH_GPU_LOCKS") or Path(tempfile.gettempdir()) / "dflash-gpus")


def claim_gpu(poll_s: float = 1.0) -> torch.device:
    """The first visible GPU not held by another process of this host (CPU when none).

    When every GPU is held (Snakemake was told of more GPUs than this host has free, e.g. the
    default profile's count on a smaller host), wait for one to be freed instead of failing a job
    that would run fine a little later.
    """
    count = torch.cuda.device_count()
    if count == 0:
        return torch.device("cpu")
    folder = lock_dir()
    folder.mkdir(parents=True, exist_ok=True)
    uuids = [str(torch.cuda.get_device_properties(i).uuid) for i in range(count)]
    waiting = False
    while True:
        for i, uuid in enumerate(uuids):
            fd = os.open(folder / f"{uuid}.lock", os.O_CREAT | os.O_RDWR, 0o666)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            _held.append(fd)
            log.info("claimed GPU %d (%s)", i, uuid)
            return torch.device("cuda", i)
        if not waiting:
            log.info(
                "all %d visible GPUs are held by other jobs (locks in %s): waiting", count, folder
            )
            waiting = True
        time.sleep(poll_s)
