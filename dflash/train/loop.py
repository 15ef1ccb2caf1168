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
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import polars as pl
import torch
import torch.distributed as dist

from dflash.data.batching import bucket_batch_size, bucket_bounds, plan_epoch
from dflash.errors import UserError
from dflash.host import HostMonitor, describe_host
from dflash.io import atomic_path, read_json, sha256_file, sha256_json, write_json
from dflash.manifest import code_hash, write_manifest
from dflash.model.drafter import Drafter, DrafterConfig, init_from_target_top, save_drafter
from dflash.model.objective import default_gamma
from dflash.model.precision import native_bf16
from dflash.model.step import TrainStep, feature_width, resolve_attention, run_shapes
from dflash.model.target import (
    TargetFeatures,
    load_embeddings,
    load_target,
    resolve_mask_token,
)
from dflash.model.tau_sim import simulate, tau_macro
from dflash.stages import TRAINING_CODE
from dflash.train import comm
from dflash.train.board import Board
from dflash.train.checkpoint import (
    check_contract,
    contract_diff,
    latest_valid,
    load_state,
    save_checkpoint,
)
from dflash.train.telemetry import Window, step_record, summarize, sync
from dflash.train.topology import Topology

log = logging.getLogger(__name__)


def cosine_with_warmup(total_steps: int, warmup_ratio: float):
    warmup = max(1, round(total_steps * warmup_ratio))

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total_steps - warmup)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return factor


def batch_generator(seed: int, epoch: int, index: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 1_000_003 + epoch * 10_007 + index)


class Batches:
    """The tokenized rows and the epoch plans every rank derives identically.

    A compiled step is specialised to its shapes, so with `compile.enabled` a bucket's last,
    partial batch is padded with empty rows (no loss mask, hence no anchors and no loss) to the
    bucket's batch size: every batch then has one of the bucket shapes, which the warmup rule
    compiles from the config alone. The real rows' anchors are the same either way (a row's
    random keys do not depend on the rows after it).
    """

    def __init__(self, config: dict, data_path: Path):
        self.config, self.path = config, data_path
        self.rows = pl.read_parquet(data_path)
        # Every row's tokens in one flat array: a batch is a few slice copies instead of a
        # Python conversion per row (~25 ms for 16 rows of ~1,000 tokens, in the step's path).
        lengths = self.rows["length"].to_numpy()
        self.offsets = [0, *np.cumsum(lengths, dtype=np.int64).tolist()]
        self.flat_ids = torch.from_numpy(self.rows["input_ids"].explode().to_numpy().copy())
        self.flat_mask = torch.from_numpy(self.rows["loss_mask"].explode().to_numpy().copy())
        data = config["data"]
        self.bounds = bucket_bounds(data["buckets"], data["max_length"])
        self.pad = config["compile"]["enabled"]

    def shape(self, upper: int, rows: list[int]) -> tuple[int, int]:
        """(rows, width) of the batch `(upper, rows)` as it is fed to the step."""
        if not self.pad:
            return len(rows), upper
        data = self.config["data"]
        return bucket_batch_size(upper, data["token_budget"], data["max_batch_size"]), upper

    def plan(self, epoch: int) -> list[tuple[int, list[int]]]:
        data = self.config["data"]
        return plan_epoch(
            self.rows["length"].to_list(),
            self.bounds,
            data["token_budget"],
            data["max_batch_size"],
            self.config["seed"],
            epoch,
        )

    def tensors(self, rows: list[int], width: int, device: torch.device):
        """Right-padded (input_ids, loss_mask, attention_mask) of a batch, `shape()` rows."""
        ids = torch.zeros(self.shape(width, rows), dtype=torch.long)
        mask = torch.zeros_like(ids)
        attention = torch.zeros_like(ids)
        for i, row in enumerate(rows):
            start, end = self.offsets[row], self.offsets[row + 1]
            ids[i, : end - start] = self.flat_ids[start:end]
            mask[i, : end - start] = self.flat_mask[start:end]
            attention[i, : end - start] = 1
        return ids.to(device), mask.to(device), attention.to(device)


def drafter_config(config: dict, target_dir: Path) -> DrafterConfig:
    from transformers import AutoConfig

    d = config["drafter"]
    return DrafterConfig.for_target(
        AutoConfig.from_pretrained(target_dir),
        d["num_layers"],
        d["block_size"],
        resolve_mask_token(target_dir, config["target"]["mask_token_id"]),
        d["target_layer_ids"],
    )


def target_dtype(device: torch.device) -> torch.dtype:
    """bf16 weights on GPU; fp32 weights on CPU, under bf16 autocast where the CPU has bf16
    units (2x faster there; 50x slower on one without, see `dflash.model.precision`)."""
    return torch.bfloat16 if device.type == "cuda" and native_bf16(device) else torch.float32


@contextlib.contextmanager
def out_of_memory_hint(what: str, ids: torch.Tensor, config: dict):
    try:
        yield
    except torch.OutOfMemoryError:
        data, d = config["data"], config["drafter"]
        raise UserError(
            f"out of memory in {what} on a batch of {ids.shape[0]} x {ids.shape[1]} tokens: "
            f"lower data.token_budget (now {data['token_budget']}) or data.max_batch_size "
            f"(now {data['max_batch_size']}), or drafter.max_anchors (now {d['max_anchors']})"
        ) from None


class FeatureModel:
    """A frozen target truncated to the drafter's layers (whole, with its output appended, when
    distilling); features in bf16."""

    def __init__(self, target_dir: Path, layer_ids: list[int], device: torch.device, config):
        target = load_target(target_dir, dtype=target_dtype(device), device=device)
        distill = config["train"]["distill"] > 0
        self.features = TargetFeatures(target, layer_ids, with_output=distill)
        # what the drafter reads: the target layers' part of the features
        self.drafter_width = len(layer_ids) * self.features.embed_tokens.weight.shape[1]
        self.device, self.config = device, config
        self.autocast = native_bf16(device)
        log.info("target features on %s: %s", device, "bf16" if self.autocast else "fp32")

    def __call__(self, ids, attention) -> tuple[torch.Tensor, float]:
        t0 = time.perf_counter()
        with (
            out_of_memory_hint("the target forward", ids, self.config),
            torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast),
        ):
            feats = self.features(ids, attention).to(torch.bfloat16)
        sync(self.device)
        return feats, time.perf_counter() - t0


class HeldOut:
    """The fixed held-out slice `tau_sim` is logged on: the first rows of the tokenized eval
    split and their target features, computed once (by a target loaded for the purpose when this
    rank has none) and kept on the host."""

    def __init__(self, path: Path, rows: int, model: FeatureModel):
        frame = pl.read_parquet(path).head(rows)
        self.rows = []
        for ids, mask in zip(frame["input_ids"], frame["loss_mask"], strict=True):
            ids_t = torch.tensor([list(ids)], device=model.device)
            feats, _ = model(ids_t, torch.ones_like(ids_t))
            feats = feats[..., : model.drafter_width]
            self.rows.append((feats.cpu(), ids_t[0].cpu(), torch.tensor(list(mask))))

    def tau_sim(self, drafter, embed, head, dtype: torch.dtype) -> float | None:
        """Simulated real-decoding τ of the drafter as it is now (whole responses)."""
        device = head.device
        rows = ((f.to(device, dtype), ids, mask) for f, ids, mask in self.rows)
        autocast = torch.bfloat16 if device.type == "cuda" else None
        return tau_macro(simulate(drafter, embed, head, rows, autocast=autocast))


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


def serve_features(ctx: comm.Dist, config, target_dir, batches: Batches, checkpoints: Path):
    """A target rank: compute features for its batches and send them, `queue_depth` ahead."""
    dcfg = drafter_config(config, target_dir)
    model = FeatureModel(target_dir, dcfg.target_layer_ids, ctx.device, config)
    start = resume_point(ctx, checkpoints, None)
    sender = comm.FeatureSender(ctx, config["train"]["queue_depth"])
    trace = Trace(Path(start["run"]) / "telemetry", ctx.rank)
    topo = ctx.topology
    for epoch in range(start["epoch"], config["train"]["epochs"]):
        plan = batches.plan(epoch)
        first = start["position"] if epoch == start["epoch"] else 0
        for i in topo.batches(ctx.rank, len(plan), first):
            started = time.perf_counter()
            upper, rows = plan[i]
            ids, _, attention = batches.tensors(rows, upper, ctx.device)
            feats, _ = model(ids, attention)
            tokens = int(attention.sum())
            compute_s = time.perf_counter() - started  # batch assembly + forward: the busy time
            sent = sender.send(i, topo.dest_rank(i), feats, compute_s, tokens)
            trace(epoch=epoch, batch=i, dst=topo.dest_rank(i), compute_s=compute_s, **sent)
    sender.drain()


class Trainer:
    """A drafter rank."""

    def __init__(
        self,
        ctx: comm.Dist,
        config: dict,
        target_dir: Path,
        batches,
        checkpoints,
        held_out: Path | None = None,
    ):
        self.ctx, self.config, self.batches, self.checkpoints = ctx, config, batches, checkpoints
        t, d, data = config["train"], config["drafter"], config["data"]
        self.topo = ctx.topology
        self.device = ctx.device
        self.dcfg = drafter_config(config, target_dir)
        self.width = feature_width(self.dcfg, t["distill"])
        if self.topo.colocated:
            self.target = FeatureModel(target_dir, self.dcfg.target_layer_ids, self.device, config)
            embed = self.target.features.embed_tokens
            head = self.target.features.lm_head.weight
        else:
            self.target = None
            embed, head = load_embeddings(target_dir, target_dtype(self.device), self.device)
            self.receiver = comm.FeatureReceiver(ctx, torch.bfloat16)
        self.held_out = None
        if held_out is not None and t["tau_sim"]["every"] > 0 and ctx.rank == 0:
            model = self.target or FeatureModel(
                target_dir, self.dcfg.target_layer_ids, self.device, config
            )
            self.held_out = HeldOut(held_out, t["tau_sim"]["rows"], model)
            del model
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
        torch.manual_seed(config["seed"])  # every drafter starts from the same weights
        self.drafter = Drafter(self.dcfg)
        if d["init"] == "target_top":
            copied = init_from_target_top(self.drafter, target_dir)
            log.info("drafter.init: target_top: %d target tensors copied", len(copied))
        self.drafter.to(self.device)
        gamma = d["gamma"] or default_gamma(d["block_size"])
        self.ddp = ctx.drafter_group is not None
        self.step_fn = TrainStep(
            self.drafter,
            embed,
            head,
            max_anchors=d["max_anchors"],
            gamma=gamma,
            attention=resolve_attention("auto", self.device),
            compile=config["compile"]["enabled"],
            wrap=self._ddp if self.ddp else None,
            distill=t["distill"],
        )
        self.optimizer = torch.optim.AdamW(
            self.drafter.parameters(),
            lr=t["lr"],
            weight_decay=t["weight_decay"],
            betas=(0.9, 0.95),
            fused=self.device.type == "cuda",
        )
        per_rank = self.topo.usable(len(batches.plan(0))) // self.topo.drafters
        if per_rank == 0:
            raise UserError(
                f"an epoch has fewer batches than train.topology.drafters "
                f"({self.topo.drafters}): use more data or fewer drafters"
            )
        self.total_steps = t["epochs"] * math.ceil(per_rank / t["grad_accum"])
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, cosine_with_warmup(self.total_steps, t["warmup_ratio"])
        )
        self.contract = {
            "drafter": self.dcfg.to_hf(),
            "gamma": gamma,
            "max_anchors": d["max_anchors"],
            "init": d["init"],
            "data_sha256": sha256_file(batches.path),
            "seed": config["seed"],
            "train": {k: t[k] for k in ("epochs", "lr", "grad_accum", "warmup_ratio", "distill")},
            "batching": {
                k: data[k] for k in ("buckets", "max_length", "token_budget", "max_batch_size")
            },
            # Weights depend on the drafter count, not on how many targets feed them (or whether
            # they are colocated): a run may resume with a different number of target ranks.
            "drafters": self.topo.drafters,
            # The training code itself (the train rule's code param): resuming a run with other
            # code would silently mix two runs, or re-export a finished one.
            "code": code_hash(*TRAINING_CODE),
        }
        self.step, self.epoch, self.position = 0, 0, 0

    def _ddp(self, module):
        from torch.nn.parallel import DistributedDataParallel

        ids = [self.device.index] if self.device.type == "cuda" else None
        return DistributedDataParallel(
            module, device_ids=ids, process_group=self.ctx.drafter_group, broadcast_buffers=False
        )

    def resume(self) -> None:
        point = resume_point(self.ctx, self.checkpoints, self.contract)
        self.run = Path(point["run"])
        if point["folder"] is None:
            return
        state = load_state(Path(point["folder"]))
        self.drafter.load_state_dict(state["drafter"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["rng"][self.topo.role(self.ctx.rank)[1]])
        self.step, self.epoch, self.position = point["step"], point["epoch"], point["position"]
        log.info(
            "%s resumed from %s (step %d, epoch %d, batch %d)",
            self.ctx.name,
            point["folder"],
            self.step,
            self.epoch,
            self.position,
        )

    @property
    def live_metrics(self) -> Path:
        return self.run / "metrics.live.jsonl"

    def checkpoint(self) -> None:
        rng = self.ctx.drafter_gather(torch.get_rng_state())  # collective: every drafter
        if self.ctx.rank != 0:
            return
        state = {
            "drafter": self.drafter.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "rng": rng,
        }
        meta = {"epoch": self.epoch, "position": self.position, "contract": self.contract}
        keep = self.config["train"]["keep_checkpoints"]
        save_checkpoint(self.run, self.step, state, meta, keep)

    def features(self, plan, mine: list[int]):
        """(batch, tensors, features, phase times, link stats) for this rank's batches."""
        if self.topo.colocated:
            for i in mine:
                upper, rows = plan[i]
                tensors = self.batches.tensors(rows, upper, self.device)
                feats, seconds = self.target(tensors[0], tensors[2])
                yield i, tensors, feats, {"features": seconds}, None
            return
        wanted = [
            (i, self.topo.source_rank(i), (*self.batches.shape(*plan[i]), self.width)) for i in mine
        ]
        for i, feats, stats, wait in self.receiver.stream(wanted):
            upper, rows = plan[i]
            yield i, self.batches.tensors(rows, upper, self.device), feats, {"wait": wait}, stats

    def compile_shapes(self) -> None:
        """Run every batch shape once before training, so no compile stalls a peer mid-run.

        With the warmup rule's cache these are cache hits; gradients are discarded.
        """
        plan = self.batches.plan(0)
        # the warmup's order (by length): the same graphs in the sequence it filled the cache
        shapes = sorted({self.batches.shape(u, rows) for u, rows in plan}, key=lambda s: s[::-1])
        started = time.perf_counter()
        no_sync = self.step_fn.model.no_sync if self.ddp else None
        vocab = self.dcfg.vocab_size
        run_shapes(self.step_fn, shapes, self.width, vocab, self.compute_dtype, no_sync=no_sync)
        log.info(
            "%s compiled %d shapes in %.1f s",
            self.ctx.name,
            len(shapes),
            time.perf_counter() - started,
        )

    def fit(self) -> None:
        """Train to the end (resuming if this run has checkpoints)."""
        self.resume()
        live = self.live_metrics
        trace = Trace(self.run / "telemetry", self.ctx.rank)
        if self.config["compile"]["enabled"]:
            self.compile_shapes()
        if self.ctx.rank == 0:
            keep_metrics_upto(live, self.step)
            self.host = HostMonitor(node_gpu_uuids(self.device))
            self.board = Board(
                self.run / "tensorboard", self.step, self.config["train"]["tensorboard"]
            )
        try:
            self._train_epochs(live, trace)
        finally:
            if self.ctx.rank == 0:
                self.host.close()
                self.board.close()

    def _train_epochs(self, live: Path, trace: Trace) -> None:
        t = self.config["train"]
        accum, seed, dtype = t["grad_accum"], self.config["seed"], self.compute_dtype
        while self.epoch < t["epochs"]:
            plan = self.batches.plan(self.epoch)
            usable = self.topo.usable(len(plan))
            per_rank = usable // self.topo.drafters
            mine = self.topo.batches(self.ctx.rank, len(plan), self.position)
            window, metrics = Window(), []
            for i, (ids, mask, attention), feats, phases, stats in self.features(plan, mine):
                micro = i // self.topo.drafters  # this drafter's micro-batch index in the epoch
                last = (micro + 1) % accum == 0 or micro + 1 == per_rank
                for phase, seconds in phases.items():
                    window.time[phase] += seconds
                if stats is not None:
                    window.link(self.topo.source_rank(i), stats)
                window.tokens += int(attention.sum())
                trace(
                    epoch=self.epoch,
                    batch=i,
                    src=self.topo.source_rank(i),
                    **{f"{k}_s": v for k, v in phases.items()},
                )
                no_sync = self.step_fn.model.no_sync if self.ddp and not last else None
                with no_sync() if no_sync else contextlib.nullcontext():
                    with out_of_memory_hint("the drafter step", ids, self.config):
                        t0 = time.perf_counter()
                        loss, m = self.step_fn.loss(
                            feats.to(dtype), ids, mask, batch_generator(seed, self.epoch, i)
                        )
                        sync(self.device)
                        t1 = time.perf_counter()
                        (loss / accum).backward()
                        sync(self.device)
                window.time["forward"] += t1 - t0
                window.time["backward"] += time.perf_counter() - t1
                metrics.append(m)
                if not last:
                    continue
                self.position = (micro + 1) * self.topo.drafters
                t2 = time.perf_counter()
                lr = self.scheduler.get_last_lr()[0]
                grad_norm = self.optimizer_step()
                sync(self.device)
                window.time["optimizer"] += time.perf_counter() - t2
                sim_started = time.perf_counter()
                tau_sim = self.simulated_tau()
                window.start += time.perf_counter() - sim_started  # not training time
                self.log_step(window, metrics, i, lr, grad_norm, live, tau_sim)
                window, metrics = Window(), []
                if self.step % t["checkpoint_every"] == 0 and self.position != usable:
                    self.checkpoint()
            self.epoch, self.position = self.epoch + 1, 0
            self.checkpoint()

    @property
    def compute_dtype(self) -> torch.dtype:
        """Features enter the step in bf16 on GPU (autocast); fp32 on CPU."""
        return torch.bfloat16 if self.device.type == "cuda" else torch.float32

    def optimizer_step(self) -> float:
        clip = self.config["train"]["grad_clip"]
        norm = torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), clip)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return float(norm)

    def simulated_tau(self) -> float | None:
        """tau_sim on the held-out slice every `train.tau_sim.every` steps and at the last."""
        if self.held_out is None:
            return None
        every = self.config["train"]["tau_sim"]["every"]
        if self.step % every and self.step != self.total_steps:
            return None
        step = self.step_fn
        return self.held_out.tau_sim(
            self.drafter, step.embed_tokens, step.head_weight, self.compute_dtype
        )

    def log_step(
        self, window: Window, metrics: list[dict], batch, lr, grad_norm, live: Path, tau_sim
    ):
        mean = {
            "loss": statistics.fmean(m["loss"] for m in metrics),
            "tau": statistics.fmean(m["tau"] for m in metrics),
            "acc": [statistics.fmean(a) for a in zip(*(m["acc"] for m in metrics), strict=True)],
        }
        gathered = self.ctx.drafter_gather((window.close(self.device), mean))
        if self.ctx.rank != 0:
            return
        windows, means = zip(*gathered, strict=True)
        record = {
            "step": self.step,
            "epoch": self.epoch,
            "batch": batch,
            "lr": lr,
            "grad_norm": round(grad_norm, 4),
            **step_record(list(windows), self.topo, list(means)),
            "host": self.host.window(),
        }
        if tau_sim is not None:
            record["tau_sim"] = tau_sim
        with live.open("a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
        self.board.log(record)
        self.progress(record)

    def progress(self, record: dict) -> None:
        queue = record.get("queue_depth")
        depth = f" queue {statistics.fmean(queue.values()):.1f}" if queue else ""
        sim = f" tau_sim {record['tau_sim']:.3f}" if "tau_sim" in record else ""
        line = (
            f"step {record['step']}/{self.total_steps} loss {record['loss']:.4f} "
            f"tau {record['tau']:.3f}{sim} lr {record['lr']:.2e} "
            f"{record['tokens_per_s']:.0f} tok/s{depth}"
        )
        if sys.stderr.isatty():
            done = record["step"] / self.total_steps
            bar = "#" * int(30 * done)
            print(f"\r[{bar:<30}] {line}", end="", file=sys.stderr, flush=True)
        else:
            log.info(line)


def node_gpu_uuids(device: torch.device) -> list[str]:
    """The GPUs this node's ranks use: rank r takes cuda:LOCAL_RANK (comm.init)."""
    if device.type != "cuda":
        return []
    ranks = min(int(os.environ.get("LOCAL_WORLD_SIZE", "1")), torch.cuda.device_count())
    return [str(torch.cuda.get_device_properties(i).uuid) for i in range(ranks)]


def keep_metrics_upto(live: Path, step: int) -> None:
    """Drop live-log lines past `step`: a crash may have logged steps after the checkpoint."""
    lines = live.read_text().splitlines() if live.exists() else []
    kept = [line for line in lines if json.loads(line)["step"] <= step]
    with atomic_path(live) as tmp:
        tmp.write_text("".join(line + "\n" for line in kept))


def run(args) -> None:
    config = args.config
    t = config["train"]
    topology = Topology(**t["topology"])
    ctx = comm.init(topology, t["device"], t["timeout_s"], t["startup_timeout_s"])
    try:
        _run(ctx, args)
    except comm.PeerError as e:
        if ctx.distributed:
            # Exit now: with a peer gone, NCCL teardown would wait on the unfinished p2p op.
            print(f"dflash train: error: {e}", file=sys.stderr, flush=True)
            os._exit(1)
        raise
    except UserError as e:
        raise UserError(f"{ctx.name}: {e}") from None
    if dist.is_initialized():
        dist.destroy_process_group()


def _run(ctx: comm.Dist, args) -> None:
    config = args.config
    batches = Batches(config, args.data)
    args.checkpoints.mkdir(parents=True, exist_ok=True)
    if ctx.role[0] == "target":
        serve_features(ctx, config, args.target, batches, args.checkpoints)
        return
    trainer = Trainer(ctx, config, args.target, batches, args.checkpoints, args.held_out)
    trainer.fit()
    if ctx.rank != 0:
        return
    live = trainer.live_metrics
    save_drafter(trainer.drafter, args.out)
    lines = live.read_text().splitlines()
    records = [json.loads(line) for line in lines]
    summary = summarize(records, ctx.topology.as_dict(), config["train"]["queue_depth"])
    log.info("throughput: %s", summary.get("verdict", "no steps"))
    log.info("host during training: %s", describe_host(summary.get("host")))
    write_json(args.summary, summary)
    with atomic_path(args.metrics) as tmp:
        tmp.write_text("".join(line + "\n" for line in lines))
    if args.manifest:
        write_manifest(
            args.manifest,
            "train",
            {"data": args.data},
            {"drafter": args.out, "metrics": args.metrics, "summary": args.summary},
            params={**config, "world_size": ctx.topology.world},
            code=TRAINING_CODE,
        )
