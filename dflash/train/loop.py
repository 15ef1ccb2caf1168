"""Drafter training under torchrun: target ranks serve context features, drafter ranks train.

Every rank reads the same tokenized data and derives the same epoch plans (length-bucketed,
shuffled from the seed), so no batch metadata travels: a target computes features for its global
batches and sends them; a drafter receives its batches in order, runs the DFlash step under DDP
and every `grad_accum` batches clips, steps AdamW and the cosine schedule, and logs one line.
Drafter 0 writes checkpoints and the outputs. `targets: 0` (colocated) runs the target on each
drafter rank instead; a colocated single drafter needs no process group at all.

Anchors come from a generator seeded by (seed, epoch, global batch), the drafter from the seed,
and gradient all-reduce order is fixed by the topology, so a resumed run ends with the same
weights as an uninterrupted one, and two runs with one topology agree bit for bit (on CPU).

Here: the entry point and a target rank's loop. The parts: `batches` (rows and epoch plans),
`features` (the target on a rank), `runs` (run folders, resume, traces), `trainer` (a drafter
rank), `progress` (a step as queued, and rank 0's progress bar or log line), `comm` (the links),
`telemetry` (the numbers of a step window).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path

from dflash.errors import UserError
from dflash.host import STARTUP_PHASES, describe_host, process_age_s
from dflash.io import atomic_path, write_json
from dflash.model.drafter import save_drafter
from dflash.model.sampling import serving_mode
from dflash.model.start import init_path
from dflash.stages import ELSEWHERE
from dflash.train import comm
from dflash.train.batches import Batches
from dflash.train.features import FeatureModel, drafter_config, send_held_out
from dflash.train.runs import Trace, resume_point
from dflash.train.telemetry import summarize
from dflash.train.topology import Topology
from dflash.train.trainer import Trainer

log = logging.getLogger(__name__)


def serve_features(
    ctx: comm.Dist, config, target_dir, batches: Batches, checkpoints: Path, held_out
):
    """A target rank: compute features for its batches and send them, `queue_depth` ahead. With
    a sharded target every rank of a group computes its group's batches and the leader sends."""
    dcfg = drafter_config(config, target_dir)
    mesh = ctx.target_mesh()
    model = FeatureModel.load(target_dir, dcfg.target_layer_ids, ctx.device, config, mesh)
    topo = ctx.topology
    sim = config["train"]["tau_sim"]
    if mesh is not None and held_out is not None and sim["every"] > 0:
        if topo.leader(ctx.rank) == topo.group_ranks(0)[0]:  # no rank holds the whole target
            send_held_out(ctx, model, held_out, sim["rows"])
    # every shape before serving, so no compile stalls the drafters mid-run
    model.compile_shapes(batches.shapes())
    start = resume_point(ctx, checkpoints, None)
    sender = comm.FeatureSender(ctx, config["train"]["queue_depth"])
    trace = Trace(Path(start["run"]) / "telemetry", ctx.rank)
    leader = topo.leader(ctx.rank) == ctx.rank
    for epoch in range(start["epoch"], config["train"]["epochs"]):
        plan = batches.plan(epoch)
        first = start["position"] if epoch == start["epoch"] else 0
        for i in topo.batches(ctx.rank, len(plan), first):
            started = time.perf_counter()
            upper, rows = plan[i]
            ids, _, _ = batches.tensors(rows, upper, ctx.device)
            feats, _ = model(ids)  # waits for the device: compute_s is the target's busy time
            tokens = batches.tokens(rows)
            compute_s = time.perf_counter() - started  # batch assembly + forward: the busy time
            if not leader:  # a shard: its group's leader sends the features
                trace(epoch=epoch, batch=i, compute_s=compute_s)
                continue
            sent = sender.send(i, topo.dest_rank(i), feats, compute_s, tokens)
            trace(epoch=epoch, batch=i, dst=topo.dest_rank(i), compute_s=compute_s, **sent)
    sender.drain()


def startup_split(imported_s, built_s, trainer) -> dict | None:
    """Where the seconds before the first step went: the interpreter and imports; the process
    group, data plan, target and drafter; resuming and the live view (MLflow); the compile pass
    (None where /proc is missing)."""
    marks = (imported_s, built_s, trainer.ready_s, trainer.startup_s)
    if None in marks:
        return None
    starts = (0.0, *marks[:-1])
    return {n: round(b - a, 1) for n, a, b in zip(STARTUP_PHASES, starts, marks, strict=True)}


def run(args) -> dict | str:
    imported_s = process_age_s()  # this process's seconds so far: the interpreter and imports
    config = args.config
    t = config["train"]
    topology = Topology(**t["topology"])
    ctx = comm.init(topology, t["device"], t["timeout_s"], t["startup_timeout_s"])
    try:
        made = _run(ctx, args, imported_s)
    except comm.PeerError as e:
        if ctx.distributed:
            # Exit now: with a peer gone, NCCL teardown would wait on the unfinished p2p op.
            print(f"dflash train: error: {e}", file=sys.stderr, flush=True)
            os._exit(1)
        raise
    except UserError as e:
        raise UserError(f"{ctx.name}: {e}") from None
    ctx.close()
    return made


def _run(ctx: comm.Dist, args, imported_s: float | None) -> dict | str:
    """Rank 0 returns what its stage manifest records beyond the arguments; the others, that
    rank 0 records the run."""
    config = args.config
    data, d = config["data"], config["drafter"]
    log.info(
        "batches: data.token_budget %s, data.max_batch_size %s, drafter.max_anchors %s%s",
        data["token_budget"], data["max_batch_size"], d["max_anchors"],
        f" ({os.environ['DFLASH_AUTO_MEMORY']})" if os.environ.get("DFLASH_AUTO_MEMORY") else "",
    )  # fmt: skip
    batches = Batches(config, args.data)
    args.checkpoints.mkdir(parents=True, exist_ok=True)
    if ctx.role[0] == "target":
        serve_features(ctx, config, args.target, batches, args.checkpoints, args.held_out)
        return ELSEWHERE
    trainer = Trainer(ctx, config, args.target, batches, args.checkpoints, args.held_out)
    built_s = process_age_s()
    trainer.fit()
    if ctx.rank != 0:
        return ELSEWHERE
    live = trainer.live_metrics
    save_drafter(trainer.drafter, args.out, trained_on=serving_mode(config))
    lines = live.read_text().splitlines()
    records = [json.loads(line) for line in lines]
    summary = summarize(records, ctx.topology.as_dict(), config["train"]["queue_depth"])
    # before the first step: seconds with the warmup rule's cache, minutes without it
    summary["compile_s"] = trainer.compile_s
    # from the process's start to its first step: imports, loading and the compile pass
    summary["startup_s"] = trainer.startup_s
    summary["startup_split_s"] = startup_split(imported_s, built_s, trainer)
    # whether this rank's target features ran compiled (None: features came from target ranks)
    summary["target_compiled"] = trainer.target.compiled if trainer.target else None
    summary["trained_on"] = serving_mode(config)  # how its training answers were made
    log.info("throughput: %s", summary.get("verdict", "no steps"))
    log.info("host during training: %s", describe_host(summary.get("host")))
    write_json(args.summary, summary)
    with atomic_path(args.metrics) as tmp:
        tmp.write_text("".join(line + "\n" for line in lines))
    init = init_path(config["drafter"]["init"])
    return {
        "inputs": {"init": init} if init else {},
        "params": {"world_size": ctx.topology.world},
    }
