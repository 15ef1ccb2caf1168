"""`auto` batch sizes resolved before any job: the memory a training rank has (the free memory of
this host's GPUs, `gpu_memory_gb` where the planning host has none, a CPU's fixed sizes) and the
target's shapes, through `dflash.plan.memory`. The config then holds numbers, so every rule's
params, the compile warmup's shapes and training agree.

A run keeps the sizes its first start chose (`results/work/auto-memory.json`) while its target,
config and GPU kind are the same and they still fit: free memory that moves by a few GB between
two starts must not change the batches, which would restart training from its first step.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

from dflash.errors import UserError
from dflash.io import sha256_json, write_json
from dflash.model.layer_ids import default_layer_ids
from dflash.plan.memory import KEYS, USE, Fit, Model, fit, need
from dflash.plan.shapes import Shape

MIB = 1 << 20


def target_config(config: dict, built: str | Path | None) -> dict | None:
    """The target's HF config.json where it can be read before any job: a user's folder, a
    rehearsal's model config, or the target rule's folder once built; None otherwise."""
    t = config["target"]
    if t.get("path"):
        path = Path(os.path.expanduser(t["path"])) / "config.json"
    elif t.get("random_init"):
        path = Path(t["random_init"]["config"])
        path = path / "config.json" if path.is_dir() else path
    elif built is not None:
        path = Path(built) / "config.json"
    else:
        return None
    return json.loads(path.read_text()) if path.is_file() else None


def gpu_memory(config: dict) -> tuple[float, str]:
    """(free bytes, where) of the GPUs training will use: `gpu_memory_gb` when set, else the
    least free memory among this host's visible GPUs (nvidia-smi: no CUDA context is made)."""
    if config.get("gpu_memory_gb") not in (None, "auto"):
        return config["gpu_memory_gb"] * 1e9, "the GPU gpu_memory_gb names"
    smi = shutil.which("nvidia-smi")
    if smi is None:
        raise UserError(
            "auto batch sizes need the GPU's memory, and this host has no nvidia-smi (a SLURM"
            " login node?): set gpu_memory_gb to the training GPU's free memory, or numbers for"
            f" {', '.join(KEYS.values())}"
        )
    query = [smi, "--query-gpu=index,name,memory.free", "--format=csv,noheader,nounits"]
    out = subprocess.run(query, capture_output=True, text=True, check=False).stdout
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    rows = [[c.strip() for c in line.split(",")] for line in out.strip().splitlines()]
    if visible and all(v.strip().isdigit() for v in visible.split(",")):
        rows = [r for r in rows if r[0] in {v.strip() for v in visible.split(",")}]
    if not rows:
        raise UserError(
            "nvidia-smi lists no GPU: set gpu_memory_gb, or numbers for " + KEYS["token_budget"]
        )
    index, name, free = min(rows, key=lambda r: float(r[2]))
    return float(free) * MIB, f"GPU {index}, {name}"


def model_of(config: dict, target: dict) -> Model:
    shape = Shape.from_config(target, "the target's config.json")
    d = config["drafter"]
    n_ids = len(d["target_layer_ids"] or default_layer_ids(shape.layers, d["num_layers"]))
    colocated = config["train"]["topology"]["targets"] == 0
    return Model.of(shape, d["num_layers"], d["block_size"], n_ids, colocated)


def _apply(config: dict, values: dict) -> None:
    for key, value in values.items():
        section, name = KEYS[key].split(".")
        config[section][name] = value


def resolve(config: dict, on_gpu: bool, built: str | Path | None, pin: Path | None) -> Fit:
    """Replace every `auto` among the batch sizes in `config` by a number; the fit says what
    was chosen and why. `pin`: the run's record of an earlier start's choice (read here; written
    by `keep`)."""
    data, drafter = config["data"], config["drafter"]
    if "auto" not in (data["token_budget"], data["max_batch_size"], drafter["max_anchors"]):
        return Fit({}, "")
    if not on_gpu:
        chosen = fit(None, data, drafter, None)
        _apply(config, chosen.values)
        return chosen
    target = target_config(config, built)
    if target is None:
        raise UserError(
            f"{', '.join(KEYS.values())}: auto needs the target's shapes before any job, and the"
            " target rule has not built the target yet: run `snakemake --cores all target`"
            " first, or set numbers for them"
        )
    model = model_of(config, target)
    identity = sha256_json({"target": target, "model": model.__dict__, "data": data,
                            "drafter": drafter})  # fmt: skip
    free, where = gpu_memory(config)
    earlier = _read(pin)
    if earlier and earlier["identity"] == identity:
        sizes = {**data, "max_anchors": drafter["max_anchors"], **earlier["values"]}
        if need(model, sizes, sizes["max_anchors"])[0] <= free * USE:
            _apply(config, earlier["values"])
            note = f"{earlier['note']}; kept from the run's first start"
            return Fit(earlier["values"], note, identity)
    chosen = fit(model, data, drafter, (free, where))
    chosen.identity = identity
    _apply(config, chosen.values)
    return chosen


def _read(pin: Path | None) -> dict | None:
    try:
        return json.loads(Path(pin).read_text()) if pin else None
    except (OSError, json.JSONDecodeError):
        return None


def keep(chosen: Fit, pin: Path) -> None:
    """Record a new choice for the run's next starts (a real run, never a dry run)."""
    earlier = _read(pin)
    if chosen.identity and chosen.values and (earlier or {}).get("identity") != chosen.identity:
        record = {"identity": chosen.identity, "values": chosen.values, "note": chosen.note}
        write_json(pin, record)
