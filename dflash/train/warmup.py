"""warmup_compile: compile the drafter training step for every bucket shape, on one thread, and
the target's decoder layer that computes training's features (`compile.target`).

Why: compiling from several threads or processes at once serialises on a global lock and races in
FX tracing (seen as crashes when one thread traces while another runs compiled code), and without a
persistent cache every training process spends minutes recompiling on every start or resume. This
stage compiles each (batch size, bucket length) shape once, in one process, into the
inductor/Triton cache that training processes then point at. Compiled training pads every batch to
its bucket's shape (`dflash.train.batches.Batches`), so the shapes follow from the config alone and
the warmup can run while the data is still being regenerated.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

from dflash.data.batching import bucket_batch_size, bucket_bounds
from dflash.io import write_json

log = logging.getLogger(__name__)


def cache_dir(config: dict) -> Path:
    return Path(config["compile"]["cache_dir"] or Path(config["results"]) / "compile-cache")


def use_cache(path: Path) -> None:
    """Point inductor and Triton at the shared cache (must happen before the first compile).

    Assigned, not defaulted: inductor exports TORCHINDUCTOR_CACHE_DIR into the environment of
    any process that compiled, and a child inheriting that must still use the configured cache.
    """
    path.mkdir(parents=True, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path.resolve() / "inductor")
    os.environ["TRITON_CACHE_DIR"] = str(path.resolve() / "triton")


def bucket_shapes(data: dict) -> list[tuple[int, int]]:
    """(batch size, padded length) of every bucket of the `data` config: the shapes of every
    compiled training batch."""
    return [
        (bucket_batch_size(upper, data["token_budget"], data["max_batch_size"]), upper)
        for upper in bucket_bounds(data["buckets"], data["max_length"])
    ]


def tree_size(path: Path) -> tuple[int, int]:
    files = [p for p in path.rglob("*") if p.is_file()]
    return len(files), sum(p.stat().st_size for p in files)


def warm_shapes(target_dir: Path, config: dict, shapes, steps: int = 3) -> list[dict]:
    import torch
    from transformers import AutoConfig

    from dflash.model.decoder import static_layout
    from dflash.model.drafter import Drafter, DrafterConfig
    from dflash.model.step import (
        TrainStep,
        dpace_settings,
        feature_width,
        resolve_attention,
        resolve_device,
        run_shapes,
    )
    from dflash.train.features import FeatureModel

    dcfg, ccfg = config["drafter"], config["compile"]
    device = resolve_device(ccfg["device"])
    attention = resolve_attention(ccfg["attention"], device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    target_config = AutoConfig.from_pretrained(target_dir)
    mask_id = config["target"]["mask_token_id"] or 0  # a value, not a shape: irrelevant here
    cfg = DrafterConfig.for_target(
        target_config, dcfg["num_layers"], dcfg["block_size"], mask_id, dcfg["target_layer_ids"]
    )
    torch.manual_seed(0)
    # Drawn on the device: an 8B target's drafter (1B numbers) and embedding (622M) took
    # seconds on the host. fp32 master weights, as training keeps them; the embedding's weights
    # do not matter for compilation, only shapes, dtypes and devices.
    with torch.device(device):
        drafter = Drafter(cfg)
        embed = torch.nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
    embed.requires_grad_(False)
    step = TrainStep(
        drafter,
        embed,
        embed.weight,
        max_anchors=dcfg["max_anchors"],
        gamma=dcfg["gamma"],
        attention=attention,
        compile=ccfg["enabled"],
        compile_scope=ccfg["scope"],
        compile_mode=ccfg["mode"],
        distill=config["train"]["distill"],
        copy_weight=dcfg["copy_anchor_weight"],
        dpace=dpace_settings(dcfg),
    )
    width = feature_width(cfg, config["train"]["distill"])
    # step_s is the fastest step after the first: on an H200 the one step right after compiling
    # read 0.18 s for the (8, 2048) shape that trained at 0.11 s a step, a 1.6x misestimate
    records = []
    for (batch, length), times in zip(
        shapes, run_shapes(step, shapes, width, cfg.vocab_size, dtype, steps), strict=True
    ):
        records.append(
            {
                "batch": batch,
                "length": length,
                "first_step_s": round(times[0], 2),
                "step_s": round(min(times[1:] or times), 3),
            }
        )
        log.info("warmup %s", records[-1])
    del step, drafter
    setup = {"device": str(device), "attention": attention, "dtype": str(dtype)}
    if not (ccfg["target"] and static_layout(target_config)):
        return records, setup | {"target_compiled": False}  # features run eagerly: nothing to warm
    features = FeatureModel(one_layer_target(target_config, device), [0], device, config)
    for record, seconds in zip(records, features.compile_shapes(shapes), strict=False):
        record["target_layer_s"] = round(seconds, 2)  # the target's compiled layer, first call
        log.info("warmup target layer %s", record)
    return records, setup | {"target_compiled": features.compiled}


def one_layer_target(target_config, device):
    """The target's architecture cut to one decoder layer, random weights: the compiled layer
    graph training runs in every layer depends on shapes and dtypes, not on weights or depth,
    and an 8B target's one layer loads in a moment."""
    import copy

    import torch
    from transformers import AutoModelForCausalLM

    from dflash.train.features import target_dtype

    config = copy.deepcopy(target_config)
    config.num_hidden_layers = 1
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:1]
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=target_dtype(device))
    return model.eval().requires_grad_(False)


def _peak_gb(device) -> float:
    """Peak device memory of this shape on GPU; the process's peak RSS so far on CPU."""
    import resource

    import torch

    if device.type == "cuda":
        return round(torch.cuda.max_memory_allocated() / 1e9, 2)
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6, 2)


def run(args) -> None:
    config = args.config
    cache = Path(args.cache_dir) if args.cache_dir else cache_dir(config)
    use_cache(cache)
    import torch

    # One thread of compilation, one process: the point of this stage.
    shapes = bucket_shapes(config["data"])
    record = {
        "torch": torch.__version__,
        "enabled": config["compile"]["enabled"],
        "cache_dir": str(cache),
        "shapes": [],
    }
    started = time.perf_counter()
    if config["compile"]["enabled"]:
        record["shapes"], setup = warm_shapes(args.target, config, shapes)
        record.update(setup)
    else:
        record["note"] = "compile.enabled is false: training runs eager; nothing to warm"
    record["seconds"] = round(time.perf_counter() - started, 1)
    record["cache_files"], record["cache_bytes"] = tree_size(cache)
    write_json(args.record, record)
