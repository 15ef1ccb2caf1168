"""Single-process drafter training: the loop each drafter rank runs (colocated target).

Reads like a checklist: resume from the newest valid checkpoint, then for every batch of every
epoch compute target features, run the DFlash step, and every `grad_accum` batches clip, step the
optimizer and schedule, log one JSON line and maybe checkpoint. Anchors come from a generator
seeded by (seed, epoch, batch), and the model is seeded at init, so a resumed run on a CPU ends
with the same weights as an uninterrupted one.
"""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path

import polars as pl
import torch

from dflash.data.batching import bucket_bounds, plan_epoch
from dflash.io import atomic_path, sha256_file
from dflash.model.drafter import Drafter, DrafterConfig, save_drafter
from dflash.model.objective import default_gamma
from dflash.model.step import TrainStep, resolve_attention, resolve_device
from dflash.model.target import TargetFeatures, load_target
from dflash.train.checkpoint import check_contract, latest_valid, load_state, save_checkpoint

log = logging.getLogger(__name__)


def cosine_with_warmup(total_steps: int, warmup_ratio: float):
    warmup = max(1, round(total_steps * warmup_ratio))

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total_steps - warmup)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return factor


def pad_batch(rows: pl.DataFrame, width: int):
    ids = torch.zeros(rows.height, width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    attention = torch.zeros_like(ids)
    for i, (row_ids, row_mask) in enumerate(zip(rows["input_ids"], rows["loss_mask"], strict=True)):
        n = len(row_ids)
        ids[i, :n] = torch.tensor(row_ids)
        mask[i, :n] = torch.tensor(row_mask)
        attention[i, :n] = 1
    return ids, mask, attention


def batch_generator(seed: int, epoch: int, index: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 1_000_003 + epoch * 10_007 + index)


class Trainer:
    def __init__(self, config: dict, target_dir: Path, data_path: Path, checkpoints: Path):
        self.config = config
        t, d, data = config["train"], config["drafter"], config["data"]
        self.device = resolve_device(t["device"])
        self.checkpoints = checkpoints
        self.rows = pl.read_parquet(data_path)
        self.bounds = bucket_bounds(data["buckets"], data["max_length"])
        torch.manual_seed(config["seed"])
        target = load_target(target_dir, device=self.device)
        self.dcfg = DrafterConfig.for_target(
            target.config,
            d["num_layers"],
            d["block_size"],
            config["target"]["mask_token_id"],
            d["target_layer_ids"],
        )
        self.features = TargetFeatures(target, self.dcfg.target_layer_ids)
        self.drafter = Drafter(self.dcfg).to(self.device)
        gamma = d["gamma"] or default_gamma(d["block_size"])
        self.step_fn = TrainStep(
            self.drafter,
            self.features.embed_tokens,
            self.features.lm_head.weight,
            max_anchors=d["max_anchors"],
            gamma=gamma,
            attention=resolve_attention("auto", self.device),
            compile=config["compile"]["enabled"],
        )
        self.optimizer = torch.optim.AdamW(
            self.drafter.parameters(), lr=t["lr"], weight_decay=t["weight_decay"], betas=(0.9, 0.95)
        )
        self.batches_per_epoch = len(self.plan(0))
        self.total_steps = t["epochs"] * math.ceil(self.batches_per_epoch / t["grad_accum"])
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, cosine_with_warmup(self.total_steps, t["warmup_ratio"])
        )
        self.contract = {
            "drafter": self.dcfg.to_hf(),
            "gamma": gamma,
            "max_anchors": d["max_anchors"],
            "data_sha256": sha256_file(data_path),
            "seed": config["seed"],
            "train": {k: t[k] for k in ("epochs", "lr", "grad_accum", "warmup_ratio")},
            "batching": {
                k: data[k] for k in ("buckets", "max_length", "token_budget", "max_batch_size")
            },
            "topology": {"targets": 0, "drafters": 1},
        }
        self.step, self.epoch, self.position = 0, 0, 0

    def plan(self, epoch: int):
        data = self.config["data"]
        return plan_epoch(
            self.rows["length"].to_list(),
            self.bounds,
            data["token_budget"],
            data["max_batch_size"],
            self.config["seed"],
            epoch,
        )

    def resume(self) -> None:
        found = latest_valid(self.checkpoints)
        if found is None:
            return
        folder, meta = found
        check_contract(meta["contract"], json.loads(json.dumps(self.contract)), folder)
        state = load_state(folder)
        self.drafter.load_state_dict(state["drafter"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["rng_cpu"])
        self.step, self.epoch, self.position = meta["step"], meta["epoch"], meta["position"]
        log.info(
            "resumed from %s (step %d, epoch %d, batch %d)",
            folder,
            self.step,
            self.epoch,
            self.position,
        )

    def checkpoint(self) -> None:
        state = {
            "drafter": self.drafter.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "rng_cpu": torch.get_rng_state(),
        }
        meta = {"epoch": self.epoch, "position": self.position, "contract": self.contract}
        save_checkpoint(
            self.checkpoints, self.step, state, meta, self.config["train"]["keep_checkpoints"]
        )

    def optimizer_step(self) -> float:
        clip = self.config["train"]["grad_clip"]
        norm = torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), clip)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return float(norm)

    def fit(self, metrics_log: Path):
        t = self.config["train"]
        accum = t["grad_accum"]
        self.resume()
        live = metrics_log.open("a", encoding="utf-8")
        while self.epoch < t["epochs"]:
            plan = self.plan(self.epoch)
            window = {"tokens": 0, "t_features": 0.0, "t_step": 0.0, "start": time.perf_counter()}
            for index in range(self.position, len(plan)):
                upper, rows = plan[index]
                ids, mask, attention = pad_batch(self.rows[rows], upper)
                ids, mask, attention = (x.to(self.device) for x in (ids, mask, attention))
                t0 = time.perf_counter()
                # The frozen target runs in bf16 autocast (2x faster on CPU, native on GPU).
                with torch.autocast(self.device.type, dtype=torch.bfloat16):
                    feats = self.features(ids, attention)
                feats = feats.to(next(self.drafter.parameters()).dtype)
                t1 = time.perf_counter()
                metrics = self.step_fn(
                    feats,
                    ids,
                    mask,
                    batch_generator(self.config["seed"], self.epoch, index),
                    loss_scale=1.0 / accum,
                )
                window["t_features"] += t1 - t0
                window["t_step"] += time.perf_counter() - t1
                window["tokens"] += int(attention.sum())
                self.position = index + 1
                if self.position % accum and self.position != len(plan):
                    continue
                t2 = time.perf_counter()
                lr = self.scheduler.get_last_lr()[0]
                grad_norm = self.optimizer_step()
                elapsed = time.perf_counter() - window["start"]
                record = {
                    "step": self.step,
                    "epoch": self.epoch,
                    "batch": index,
                    "loss": round(metrics["loss"], 5),
                    "tau": round(metrics["tau"], 4),
                    "acc": [round(a, 4) for a in metrics["acc"]],
                    "lr": lr,
                    "grad_norm": round(grad_norm, 4),
                    "tokens_per_s": round(window["tokens"] / elapsed, 1),
                    "time_s": {
                        "features": round(window["t_features"], 3),
                        "forward_backward": round(window["t_step"], 3),
                        "optimizer": round(time.perf_counter() - t2, 3),
                    },
                }
                live.write(json.dumps(record) + "\n")
                live.flush()
                log.info(
                    "step %d/%d loss %.4f tau %.3f lr %.2e %.0f tok/s",
                    self.step,
                    self.total_steps,
                    metrics["loss"],
                    metrics["tau"],
                    record["lr"],
                    record["tokens_per_s"],
                )
                window = {
                    "tokens": 0,
                    "t_features": 0.0,
                    "t_step": 0.0,
                    "start": time.perf_counter(),
                }
                if self.step % t["checkpoint_every"] == 0 and self.position != len(plan):
                    self.checkpoint()
            self.epoch, self.position = self.epoch + 1, 0
            self.checkpoint()
        live.close()


def metric_lines_upto(path: Path, step: int) -> list[str]:
    """The live log's lines up to `step` (a crash may have logged steps past the checkpoint)."""
    if not path.exists():
        return []
    return [line for line in path.read_text().splitlines() if json.loads(line)["step"] <= step]


def run(args) -> None:
    trainer = Trainer(args.config, args.target, args.data, args.checkpoints)
    live = args.checkpoints / "metrics.live.jsonl"
    args.checkpoints.mkdir(parents=True, exist_ok=True)
    found = latest_valid(args.checkpoints)
    kept = metric_lines_upto(live, found[1]["step"] if found else 0)
    with atomic_path(live) as tmp:
        tmp.write_text("".join(line + "\n" for line in kept))
    trainer.fit(live)
    save_drafter(trainer.drafter, args.out)
    with atomic_path(args.metrics) as tmp:
        tmp.write_text(live.read_text())
