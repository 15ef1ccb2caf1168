"""The frozen target on a training rank: the drafter's config for it, its features (bf16), and the
held-out slice `tau_sim` is logged on. A target sharded over a group of target ranks
(`train.topology.target_shards`, `dflash.train.shard`) gives the same features on every rank of
its group."""

from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path

import polars as pl
import torch

from dflash.errors import UserError
from dflash.model.decoder import layer_output
from dflash.model.drafter import DrafterConfig
from dflash.model.precision import native_bf16
from dflash.model.sampling import Sampling
from dflash.model.start import check_fits, init_path
from dflash.model.target import TargetFeatures, load_target, resolve_mask_token
from dflash.model.tau_sim import capped, simulate, tau_macro
from dflash.model.tau_sim_sampled import simulate_sampled, target_top
from dflash.train import comm
from dflash.train.shard import load_sharded
from dflash.train.telemetry import sync

log = logging.getLogger(__name__)


def drafter_config(config: dict, target_dir: Path) -> DrafterConfig:
    """The run's drafter for this target; with an exported drafter as `drafter.init`, checked
    against it here, so every rank refuses a misfit before loading anything."""
    from transformers import AutoConfig

    d = config["drafter"]
    dcfg = DrafterConfig.for_target(
        AutoConfig.from_pretrained(target_dir),
        d["num_layers"],
        d["block_size"],
        resolve_mask_token(target_dir, config["target"]["mask_token_id"]),
        d["target_layer_ids"],
    )
    init = init_path(d["init"])
    if init is not None:
        check_fits(init, dcfg)
    return dcfg


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
    distilling); features in bf16. With `compile.enabled` and `compile.target` its decoder layer
    is compiled: batches then come in their buckets' fixed shapes (`Batches.shape`).

    `target`: the causal LM, or its `TargetFeatures` already built (a sharded target)."""

    def __init__(self, target, layer_ids: list[int], device: torch.device, config):
        distill = config["train"]["distill"] > 0
        if isinstance(target, TargetFeatures):
            self.features = target
        else:
            self.features = TargetFeatures(target, layer_ids, with_output=distill)
        # what the drafter reads: the target layers' part of the features
        self.drafter_width = len(layer_ids) * self.features.embed_tokens.weight.shape[1]
        self.device, self.config = device, config
        self.autocast = native_bf16(device)
        c = config["compile"]
        self.compiled = c["enabled"] and c["target"] and self.features.compile_layers()
        log.info(
            "target features on %s: %s, %s",
            device,
            "bf16" if self.autocast else "fp32",
            "compiled" if self.compiled else "eager",
        )

    @classmethod
    def load(cls, target_dir: Path, layer_ids: list[int], device: torch.device, config, mesh=None):
        """The target from its folder: whole, or with its layers sharded over `mesh` (each rank
        reads only its slices)."""
        dtype = target_dtype(device)
        if mesh is not None:
            distill = config["train"]["distill"] > 0
            target = load_sharded(target_dir, mesh, layer_ids, device, dtype, with_output=distill)
        else:
            target = load_target(target_dir, dtype=dtype, device=device)
        return cls(target, layer_ids, device, config)

    def queue(self, ids, attention=None, compiled: bool = True) -> torch.Tensor:
        """The features of `ids`, queued on the device (no host sync). Batches are right-padded
        (`Batches.tensors`), so they need no attention mask: a real token never attends to a
        later position. `compiled=False` for a one-off shape."""
        with (
            out_of_memory_hint("the target forward", ids, self.config),
            torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast),
        ):
            return self.features(ids, attention, compiled=compiled).to(torch.bfloat16)

    def __call__(self, ids, attention=None, compiled: bool = True) -> tuple[torch.Tensor, float]:
        """(features, seconds the device took for them)."""
        t0 = time.perf_counter()
        feats = self.queue(ids, attention, compiled)
        sync(self.device)
        return feats, time.perf_counter() - t0

    def compile_shapes(self, shapes) -> list[float]:
        """Run each (batch, length) shape once, compiling its graph (or loading it from the
        compile cache) before training needs it; seconds per shape. A no-op when eager.

        A compiler failure is logged and the features run eagerly: they differ from compiled
        ones by rounding only, and a week-long run should not die of an inductor bug."""
        if not self.compiled:
            return []
        try:
            return [
                self(torch.zeros(shape, dtype=torch.long, device=self.device))[1]
                for shape in shapes
            ]
        except torch.OutOfMemoryError:
            raise
        except Exception as e:  # noqa: BLE001  (dynamo and inductor raise many kinds)
            log.warning("compiling the target's layer failed (%s); features run eagerly", e)
            self.features.layer_fn = layer_output
            self.compiled = False
            return []


def held_out_rows(path: Path, rows: int) -> list[tuple[list[int], list[int]]]:
    """(input ids, loss mask) of the held-out slice's rows."""
    frame = pl.read_parquet(path).head(rows)
    return [(list(i), list(m)) for i, m in zip(frame["input_ids"], frame["loss_mask"], strict=True)]


class HeldOut:
    """The fixed held-out slice `tau_sim` is logged on: the first rows of the tokenized eval
    split and their target features, computed once (by a target loaded for the purpose when this
    rank has none, or by target group 0 when the target is sharded) and kept on the host."""

    def __init__(self, path: Path, rows: int, model):
        self.tops: dict[str, list] = {}  # per temperature's label, each row's target top tokens
        self.rows = []
        for ids, mask in held_out_rows(path, rows):
            ids_t = torch.tensor([ids], device=model.device)
            feats, _ = model(ids_t, compiled=False)  # one shape per row: not worth compiling
            feats = feats[..., : model.drafter_width]
            self.rows.append((feats.cpu(), ids_t[0].cpu(), torch.tensor(mask)))

    @classmethod
    def load(cls, ctx: comm.Dist, config, target_dir: Path, dcfg, path: Path, target=None):
        """Drafter 0's held-out slice: its own target's features, a whole target's loaded for the
        purpose, or, when no rank holds the whole target, those target group 0 sends
        (`send_held_out`)."""
        rows, layer_ids = config["train"]["tau_sim"]["rows"], dcfg.target_layer_ids
        if ctx.topology.target_shards > 1:
            leader = ctx.topology.group_ranks(0)[0]
            width = len(layer_ids) * dcfg.hidden_size
            return cls(path, rows, ReceivedFeatures(ctx, leader, width))
        model = target or FeatureModel.load(target_dir, layer_ids, ctx.device, config)
        held_out = cls(path, rows, model)
        del model
        held_out.tops = sampled_tops(target_dir, held_out.rows, config, ctx.device)
        if ctx.device.type == "cuda":
            torch.cuda.empty_cache()
        return held_out

    def tau_sim(self, drafter, embed, head, dtype: torch.dtype, max_new_tokens: int) -> dict:
        """Simulated real-decoding τ of the drafter as it is now: `tau_sim` over every turn's
        whole response, and `tau_sim_first` over each row's first response capped at
        `max_new_tokens`, the protocol of the evaluation's held-out τ (later turns, where the
        target often repeats itself, read higher)."""
        device = head.device
        autocast = torch.bfloat16 if device.type == "cuda" else None
        every, first = [], []
        for f, ids, mask in self.rows:
            row = (f.to(device, dtype), ids, mask)
            responses = simulate(drafter, embed, head, [row], autocast=autocast)
            every += responses
            first += [capped(responses[0], max_new_tokens)] if responses else []
        out = {"tau_sim": tau_macro(every), "tau_sim_first": tau_macro(first)}
        for label, tops in self.tops.items():  # expected τ of speculative sampling, every turn
            taus = []
            for (f, ids, mask), top in zip(self.rows, tops, strict=True):
                row = (f.to(device, dtype), ids, mask, top)
                taus += simulate_sampled(drafter, embed, head, [row], autocast=autocast)
            taus = [t for t in taus if t is not None]
            out[f"tau_sim_{label}"] = round(sum(taus) / len(taus), 4) if taus else None
        return out


def sampled_tops(target_dir: Path, rows: list, config: dict, device: torch.device) -> dict:
    """Each held-out row's most likely target tokens per position at every temperature of
    `train.tau_sim.temperatures` (with eval.sampling's top-p and top-k), from the whole target
    loaded once for it (a sharded target's rows get none: tau_sim at temperature is then off)."""
    temperatures = config["train"]["tau_sim"].get("temperatures") or []
    if not temperatures or not rows:
        return {}
    if config["train"]["topology"].get("target_shards", 1) > 1:
        log.info("tau_sim at temperature: off with a sharded target")
        return {}
    cfg = config["eval"]["sampling"]
    model = load_target(target_dir, dtype=target_dtype(device), device=device)
    samplings = [Sampling(t, cfg["top_p"], cfg["top_k"]) for t in temperatures]
    tops: dict[str, list] = {s.label: [] for s in samplings}
    with torch.no_grad():
        for _, ids, _ in rows:
            logits = model(input_ids=ids[None].to(device)).logits[0]
            for s in samplings:
                tops[s.label].append(target_top(logits, s))
    del model
    return tops


class ReceivedFeatures:
    """The held-out rows' features as target group 0's leader sends them, in row order: what
    `HeldOut` reads from a `FeatureModel`."""

    def __init__(self, ctx: comm.Dist, src: int, drafter_width: int):
        self.ctx, self.src, self.drafter_width = ctx, src, drafter_width
        self.device = ctx.device

    def __call__(self, ids: torch.Tensor, compiled: bool = False) -> tuple[torch.Tensor, float]:
        shape = (*ids.shape, self.drafter_width)
        what = "receiving the held-out slice's features"
        return comm.receive(self.ctx, shape, torch.bfloat16, self.src, what), 0.0


def send_held_out(ctx: comm.Dist, model: FeatureModel, path: Path, rows: int) -> None:
    """Target group 0 (every rank of it runs the forward) computes the held-out rows' features;
    its leader sends them to drafter 0, the rank that logs tau_sim."""
    leader = ctx.rank == ctx.topology.leader(ctx.rank)
    for ids, _ in held_out_rows(path, rows):
        feats, _ = model(torch.tensor([ids], device=model.device), compiled=False)
        if leader:
            feats = feats[..., : model.drafter_width]
            comm.send(ctx, feats, ctx.topology.drafter_rank(0), "sending the held-out features")
