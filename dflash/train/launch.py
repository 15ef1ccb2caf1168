"""The command lines that start training: one torchrun on one node, or one torchrun per node
(started by srun) meeting at a c10d rendezvous. The train rule and the tests build them here, so
the multi-node test runs what the rule runs. No torch import: the Snakefile reads this."""

from __future__ import annotations

import sys

from dflash.errors import UserError

# Names the run at the rendezvous; the endpoint belongs to one job, so one name is enough.
RDZV_ID = "dflash-train"


def procs_per_node(train: dict, world: int) -> int:
    """Ranks each node starts: the topology's world spread evenly over `train.nnodes`."""
    nnodes = train["nnodes"]
    if nnodes > 1 and (world % nnodes or not train["rdzv_endpoint"]):
        raise UserError(
            f"train.nnodes {nnodes} needs train.rdzv_endpoint (host:port on the first node; now "
            f"{train['rdzv_endpoint']!r}) and targets + drafters ({world}) divisible by nnodes"
        )
    return world // nnodes


def torchrun(train: dict, world: int, python: str = sys.executable) -> list[str]:
    """The torchrun one node runs (the worker's `-m dflash train ...` follows it).

    On several nodes each torchrun learns its node rank from the rendezvous: the same command
    runs on every node.
    """
    per_node = str(procs_per_node(train, world))
    base = [python, "-m", "torch.distributed.run"]
    if train["nnodes"] == 1:
        return [*base, "--standalone", "--nnodes", "1", "--nproc-per-node", per_node]
    return [
        *base,
        *("--nnodes", str(train["nnodes"]), "--nproc-per-node", per_node),
        *("--rdzv-backend", "c10d", "--rdzv-endpoint", train["rdzv_endpoint"]),
        *("--rdzv-id", RDZV_ID),
    ]


def srun(train: dict, cpus: int | None = None) -> list[str]:
    """What starts one torchrun on every node of the job: nothing on one node. `cpus`: the cores
    of a node for its torchrun and ranks (a step that names none gets one core a task)."""
    if train["nnodes"] == 1:
        return []
    cores = ["--cpus-per-task", str(cpus)] if cpus else []
    return ["srun", "--nodes", str(train["nnodes"]), "--ntasks-per-node", "1", *cores]


def command(
    train: dict, world: int, python: str = sys.executable, cpus: int | None = None
) -> list[str]:
    """The train rule's launcher: srun (on several nodes) and torchrun."""
    return [*srun(train, cpus), *torchrun(train, world, python)]
