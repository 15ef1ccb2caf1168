"""A drafter rank: the DFlash step under DDP, the optimiser and its schedule (`optim.py`),
checkpoints, and one logged line per optimizer step (live metrics, TensorBoard, tau_sim)."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import time
from pathlib import Path

import torch

from dflash.config import check_levers
from dflash.errors import UserError
from dflash.host import HostMonitor, process_age_s
from dflash.io import sha256_file
from dflash.manifest import code_hash
from dflash.model.drafter import Drafter
from dflash.model.objective import default_gamma
from dflash.model.start import init_identity, initialise
from dflash.model.step import (
    TrainStep,
    dpace_settings,
    feature_width,
    resolve_attention,
    run_shapes,
)
from dflash.model.target import load_embeddings
from dflash.stages import TRAINING_CODE
from dflash.train import comm, optim
from dflash.train.batches import batch_generator
from dflash.train.board import Board
from dflash.train.checkpoint import BackgroundCheckpoints, load_state
from dflash.train.features import (
    FeatureModel,
    HeldOut,
    drafter_config,
    out_of_memory_hint,
    target_dtype,
)
from dflash.train.progress import Progress, QueuedStep
from dflash.train.runs import Trace, keep_metrics_upto, resume_point
from dflash.train.telemetry import Window, node_gpu_uuids, step_record, watch_syncs

log = logging.getLogger(__name__)


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
        check_levers(config)
        self.writer = BackgroundCheckpoints()
        t, d, data = config["train"], config["drafter"], config["data"]
        self.topo = ctx.topology
        self.device = ctx.device
        self.dcfg = drafter_config(config, target_dir)
        self.width = feature_width(self.dcfg, t["distill"])
        if self.topo.colocated:
            self.target = FeatureModel.load(
                target_dir, self.dcfg.target_layer_ids, self.device, config
            )
            embed = self.target.features.embed_tokens
            head = self.target.features.lm_head.weight
        else:
            self.target = None
            embed, head = load_embeddings(target_dir, target_dtype(self.device), self.device)
            self.receiver = comm.FeatureReceiver(ctx, torch.bfloat16)
        self.held_out = None
        if held_out is not None and t["tau_sim"]["every"] > 0 and ctx.rank == 0:
            self.held_out = HeldOut.load(ctx, config, target_dir, self.dcfg, held_out, self.target)
        torch.manual_seed(config["seed"])  # every drafter starts from the same weights
        # drawn on the device: on the host, an 8B target's 5-layer drafter (1B parameters)
        # took 9 to 14 s to initialise on an H200 box, a third of a warm start
        with torch.device(self.device):
            self.drafter = Drafter(self.dcfg)
        log.info(initialise(self.drafter, d["init"], target_dir))
        if frozen := optim.freeze_layers(self.drafter, config):  # before DDP wraps the drafter
            log.info("frozen (train.finetune.freeze_layers): %s", ", ".join(frozen))
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
            compile_scope=config["compile"]["scope"],
            compile_mode=config["compile"]["mode"],
            wrap=self._ddp if self.ddp else None,
            distill=t["distill"],
            copy_weight=d["copy_anchor_weight"],
            dpace=dpace_settings(d),
        )
        per_rank = self.topo.usable(len(batches.plan(0))) // self.topo.drafters
        if per_rank == 0:
            raise UserError(
                f"an epoch has fewer batches than train.topology.drafters "
                f"({self.topo.drafters}): use more data or fewer drafters"
            )
        self.total_steps = t["epochs"] * math.ceil(per_rank / t["grad_accum"])
        self.optimizer, self.scheduler = optim.build(
            self.drafter, config, self.total_steps, self.device
        )
        self.contract = {
            "drafter": self.dcfg.to_hf(),
            "gamma": gamma,
            "max_anchors": d["max_anchors"],
            # an exported drafter by its files' sha256: a replaced file starts a new run
            "init": init_identity(d["init"]),
            "data_sha256": sha256_file(batches.path),
            "seed": config["seed"],
            "train": {k: t[k] for k in ("epochs", "lr", "grad_accum", "warmup_ratio", "distill")},
            "batching": {
                k: data[k] for k in ("buckets", "max_length", "token_budget", "max_batch_size")
            },
            # Weights depend on the drafter count, not on how many targets feed them (or whether
            # they are colocated): a run may resume with a different number of target ranks.
            "drafters": self.topo.drafters,
            # only where it is set, so that runs from before the key keep their contract
            **(
                {"copy_anchor_weight": d["copy_anchor_weight"]}
                if d["copy_anchor_weight"] != 1.0
                else {}
            ),
            **({"loss": {"name": d["loss"], **d["dpace"]}} if d["loss"] != "decayed" else {}),
            **optim.contract(config),
            # The training code itself (the train rule's code param): resuming a run with other
            # code would silently mix two runs, or re-export a finished one.
            "code": code_hash(*TRAINING_CODE),
        }
        self.step, self.epoch, self.position = 0, 0, 0
        self.compile_s: float | None = None  # seconds compile_shapes took (None: compile off)
        self.startup_s: float | None = None  # from the process's start to its first step
        self.ready_s: float | None = None  # the same clock, once resumed, before compiling

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
        self.writer.save(self.run, self.step, state, meta, keep)

    def features(self, plan, mine: list[int]):
        """(batch, tensors, features, link stats, seconds waited) for this rank's batches. The
        target's work is queued as the current window's `features` phase; the wait for a
        target rank's features is host time."""
        if self.topo.colocated:
            for i in mine:
                upper, rows = plan[i]
                tensors = self.batches.tensors(rows, upper, self.device)
                with self.window.phase("features"):
                    feats = self.target.queue(tensors[0])
                yield i, tensors, feats, None, None
            return
        wanted = [
            (i, self.topo.source_rank(i), (*self.batches.shape(*plan[i]), self.width)) for i in mine
        ]
        for i, feats, stats, wait in self.receiver.stream(wanted):
            upper, rows = plan[i]
            self.window.time["wait"] += wait
            yield i, self.batches.tensors(rows, upper, self.device), feats, stats, wait

    def compile_shapes(self) -> None:
        """Run every batch shape once before training, so no compile stalls a peer mid-run.

        With the warmup rule's cache these are cache hits; gradients are discarded.
        """
        shapes = self.batches.shapes()
        started = time.perf_counter()
        no_sync = self.step_fn.model.no_sync if self.ddp else None
        vocab = self.dcfg.vocab_size
        if self.target is not None:
            self.target.compile_shapes(shapes)
        run_shapes(self.step_fn, shapes, self.width, vocab, self.compute_dtype, no_sync=no_sync)
        self.compile_s = round(time.perf_counter() - started, 1)
        log.info("%s compiled %d shapes in %.1f s", self.ctx.name, len(shapes), self.compile_s)

    def fit(self) -> None:
        """Train to the end (resuming if this run has checkpoints)."""
        self.resume()
        live = self.live_metrics
        trace = Trace(self.run / "telemetry", self.ctx.rank)
        if self.ctx.rank == 0:  # before compiling: a misconfigured live view fails at once
            keep_metrics_upto(live, self.step)
            self.board = Board(self.run, self.step, self.config)
        self.ready_s = process_age_s()
        failed = True
        try:
            if self.config["compile"]["enabled"]:
                self.compile_shapes()
            self.startup_s = process_age_s()
            log.info("%s: first step %s s after its process started", self.ctx.name, self.startup_s)
            if self.ctx.rank == 0:
                self.host = HostMonitor(node_gpu_uuids(self.device))
                self.progress = Progress(self.total_steps, self.step, log)
            with watch_syncs(self.device):
                self._train_epochs(live, trace)
            self.writer.wait()  # the last checkpoint is on disk before the run counts as done
            failed = False
        finally:
            self.writer.wait(raise_error=False)
            if self.ctx.rank == 0:
                if hasattr(self, "progress"):
                    self.progress.close()
                if hasattr(self, "host"):
                    self.host.close()
                self.board.close(failed)  # an MLflow run ends with the process: FAILED or not

    def _train_epochs(self, live: Path, trace: Trace) -> None:
        """The steps, queued without waiting for the device: a step's record (its metrics are
        device tensors) is written once the next step is queued, so the GPU never idles while
        the host logs, assembles a batch or launches kernels. Records are written at once
        before a checkpoint and at an epoch's end."""
        t = self.config["train"]
        accum, seed, dtype = t["grad_accum"], self.config["seed"], self.compute_dtype
        while self.epoch < t["epochs"]:
            pending = None  # written by the epoch's end at the latest
            plan = self.batches.plan(self.epoch)
            usable = self.topo.usable(len(plan))
            per_rank = usable // self.topo.drafters
            mine = self.topo.batches(self.ctx.rank, len(plan), self.position)
            self.window, metrics = Window(self.device), []
            for i, (ids, mask, _), feats, stats, wait in self.features(plan, mine):
                window = self.window
                micro = i // self.topo.drafters  # this drafter's micro-batch index in the epoch
                last = (micro + 1) % accum == 0 or micro + 1 == per_rank
                if stats is not None:
                    window.link(self.topo.source_rank(i), stats)
                window.tokens += self.batches.tokens(plan[i][1])
                event = {"epoch": self.epoch, "batch": i, "src": self.topo.source_rank(i)}
                trace(**event, **({} if wait is None else {"wait_s": wait}))
                no_sync = self.step_fn.model.no_sync if self.ddp and not last else None
                with no_sync() if no_sync else contextlib.nullcontext():
                    with out_of_memory_hint("the drafter step", ids, self.config):
                        generator = batch_generator(seed, self.epoch, i)
                        with window.phase("forward"):
                            loss, m = self.step_fn.loss(
                                feats.to(dtype), ids, mask, generator, host=False
                            )
                        with window.phase("backward"):
                            (loss / accum).backward()
                metrics.append(m)
                if not last:
                    continue
                self.position = (micro + 1) * self.topo.drafters
                lr = self.scheduler.get_last_lr()[0]
                with window.phase("optimizer"):
                    grad_norm = self.optimizer_step()
                window.seal()
                tau_sim = self.simulated_tau()  # waits for the device: not training time
                next_start = time.perf_counter()
                if pending is not None:
                    self.log_step(pending, live)
                pending = QueuedStep(
                    self.step, self.epoch, i, lr, grad_norm, window, metrics, tau_sim
                )
                if self.step % t["checkpoint_every"] == 0 and self.position != usable:
                    self.log_step(pending, live)
                    pending = None
                    self.checkpoint()
                self.window, metrics = Window(self.device, start=next_start), []
            if pending is not None:
                self.log_step(pending, live)
            self.epoch, self.position = self.epoch + 1, 0
            self.checkpoint()

    @property
    def compute_dtype(self) -> torch.dtype:
        """Features enter the step in bf16 on GPU (autocast); fp32 on CPU."""
        return torch.bfloat16 if self.device.type == "cuda" else torch.float32

    def optimizer_step(self) -> torch.Tensor:
        """Clip, step, schedule; returns the gradient norm before clipping (a device tensor)."""
        clip = self.config["train"]["grad_clip"]
        norm = torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), clip)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return norm

    def simulated_tau(self) -> dict:
        """tau_sim on the held-out slice every `train.tau_sim.every` steps and at the last."""
        if self.held_out is None:
            return {}
        sim = self.config["train"]["tau_sim"]
        if self.step % sim["every"] and self.step != self.total_steps:
            return {}
        step = self.step_fn
        found = self.held_out.tau_sim(
            self.drafter,
            step.embed_tokens,
            step.head_weight,
            self.compute_dtype,
            sim["max_new_tokens"],
        )
        return {k: v for k, v in found.items() if v is not None}

    def log_step(self, queued: QueuedStep, live: Path) -> None:
        """Write a queued step's line (waits for the device to finish that step)."""
        gathered = self.ctx.drafter_gather((queued.window.close(), queued.means()))
        if self.ctx.rank != 0:
            return
        windows, means = zip(*gathered, strict=True)
        record = {
            "step": queued.step,
            "epoch": queued.epoch,
            "batch": queued.batch,
            "lr": queued.lr,
            "grad_norm": round(float(queued.grad_norm), 4),
            **step_record(list(windows), self.topo, list(means)),
            "host": self.host.window(),
        }
        record |= queued.tau_sim
        with live.open("a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
        self.board.log(record)
        self.progress.update(record)
