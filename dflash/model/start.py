"""Where a drafter's weights start (`drafter.init`): random, the target's top layers, or an
exported drafter (ours, an earlier run's, or a public one: the same layout).

An exported drafter must fit the run as configured: nothing is taken from it silently. Every key
that shapes its weights or gives them their meaning is compared with the run's drafter config,
and each difference is named with both values before any training starts.
"""

from __future__ import annotations

import json
from pathlib import Path

from dflash.errors import UserError
from dflash.io import sha256_file

# torch is imported inside the functions that need it: the workflow calls this module at every
# start, where importing torch would cost seconds.
BUILT_IN = ("random", "target_top")
WEIGHTS = "model.safetensors"  # dflash.model.drafter.WEIGHTS
FILES = ("config.json", WEIGHTS)

# Compared keys (as config.json names them) -> the config key that sets it in the run; None:
# the run takes it from the target.
CHECKED = {
    "dflash_config.target_layer_ids": "drafter.target_layer_ids",
    "block_size": "drafter.block_size",
    "dflash_config.mask_token_id": "target.mask_token_id",
    "num_hidden_layers": "drafter.num_layers",
    "hidden_size": None,
    "intermediate_size": None,
    "num_attention_heads": None,
    "num_key_value_heads": None,
    "head_dim": None,
    "vocab_size": None,
    "num_target_layers": None,
    "rope_theta": None,
}


def init_path(init: str) -> Path | None:
    """The exported drafter `drafter.init` names, or None for `random` and `target_top`."""
    return None if init in BUILT_IN else Path(init)


def read_config(path: Path) -> dict:
    """The exported drafter's config.json; a UserError naming the folder when it is none."""
    if not path.is_dir():
        raise UserError(f"drafter.init: {path}: no such directory")
    missing = [name for name in FILES if not (path / name).is_file()]
    if missing:
        raise UserError(
            f"drafter.init: {path} is not an exported drafter: it has no {' and no '.join(missing)}"
            f" (an exported drafter holds config.json and {WEIGHTS}, as results/drafter does)"
        )
    try:
        config = json.loads((path / "config.json").read_text())
    except ValueError as e:
        raise UserError(f"drafter.init: {path}/config.json is no JSON: {e}") from None
    dflash = config.get("dflash_config") if isinstance(config, dict) else None
    if not isinstance(dflash, dict) or not {"target_layer_ids", "mask_token_id"} <= dflash.keys():
        raise UserError(
            f"drafter.init: {path}/config.json is no DFlash drafter config: it has no"
            " dflash_config with target_layer_ids and mask_token_id"
        )
    return config


def check_fits(path: Path, run) -> None:
    """Refuse an exported drafter that differs from the run's drafter (a DrafterConfig) in any
    CHECKED key."""
    from dflash.model.drafter import DrafterConfig

    try:
        init = DrafterConfig.from_hf(read_config(path))
    except TypeError as e:  # a field the public layout always has is missing
        raise UserError(f"drafter.init: {path}/config.json: {e}") from None
    differ = []
    for key, setting in CHECKED.items():
        field = key.rsplit(".", 1)[-1]
        ours, theirs = getattr(run, field), getattr(init, field)
        if ours != theirs:
            differ.append(f"{key}: init {theirs}, run {ours} ({setting or 'the target'})")
    if differ:
        raise UserError(
            f"drafter.init: {path} does not fit this run: "
            + "; ".join(differ)
            + ". The run's drafter must equal the init's: set those keys to the init's values,"
            " or start from a drafter made for this target and these target layers"
        )


def load_init(model, path: Path) -> None:
    """Copy the exported drafter's weights into `model` (a Drafter whose config check_fits
    accepted)."""
    import torch
    from safetensors.torch import load_file

    state = load_file(path / WEIGHTS)
    own = model.state_dict()
    missing, unexpected = sorted(own.keys() - state.keys()), sorted(state.keys() - own.keys())
    wrong = [
        f"{k} {tuple(state[k].shape)} (run {tuple(v.shape)})"
        for k, v in own.items()
        if k in state and v.shape != state[k].shape
    ]
    if missing or unexpected or wrong:
        raise UserError(
            f"drafter.init: {path}/{WEIGHTS} does not hold this drafter's tensors: "
            f"missing {missing[:4]}, unexpected {unexpected[:4]}, other shapes {wrong[:4]}"
        )
    with torch.no_grad():
        for k, v in own.items():
            v.copy_(state[k])


def initialise(model, init: str, target_dir: Path) -> str:
    """Start `model` (a Drafter) as `drafter.init` says (random: as built); returns a line for
    the log."""

    path = init_path(init)
    if path is not None:
        load_init(model, path)
        return f"drafter.init: weights of {path}"
    if init == "target_top":
        return f"drafter.init: target_top: {len(init_from_target_top(model, target_dir))} copied"
    return "drafter.init: random"


def init_identity(init: str) -> str | dict[str, str]:
    """What the init contributes to training's identity: the name, or the sha256 of the exported
    drafter's files (not its path: a moved copy is the same start)."""
    path = init_path(init)
    if path is None:
        return init
    return {name: sha256_file(path / name) for name in FILES}


def init_from_target_top(model, target_dir: str | Path) -> list[str]:
    """Start drafter layer i as target layer L-n+i and the output norm as the target's: the top
    layers already map a residual stream to what the shared LM head reads. Tensors the target
    does not have (Qwen3's q/k norms when the target is Llama) keep their init. Returns the
    target keys copied."""
    from safetensors import safe_open

    files = sorted(Path(target_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"drafter.init: target_top: no *.safetensors in {target_dir}")
    top = model.config.num_target_layers - model.config.num_hidden_layers
    wanted = {"model.norm.weight": "norm.weight"}
    for i, layer in enumerate(model.layers):
        for name, _ in layer.named_parameters():
            wanted[f"model.layers.{top + i}.{name}"] = f"layers.{i}.{name}"
    state, copied = model.state_dict(), []
    for file in files:
        with safe_open(file, "pt") as f:
            for key in wanted.keys() & set(f.keys()):
                state[wanted[key]].copy_(f.get_tensor(key).to(state[wanted[key]].dtype))
                copied.append(key)
    if not copied:
        raise ValueError(f"drafter.init: target_top: no model.layers.* tensors in {target_dir}")
    return sorted(copied)
