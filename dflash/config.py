"""Configuration: one JSON Schema (workflow/schemas) validates and fills defaults for both the
Snakemake workflow and the standalone CLI, so the two can never disagree about a default."""

from __future__ import annotations

import copy
import os
from pathlib import Path

import jsonschema
import yaml

from dflash.errors import UserError

SCHEMA_PATH = Path(__file__).resolve().parents[1] / "workflow" / "schemas" / "config.schema.yaml"


class ConfigError(UserError):
    pass


def flatten(obj, prefix: str = "") -> dict:
    """Nested dicts as one level of dotted keys ({"a": {"b": 1}} -> {"a.b": 1}); an empty dict
    is a leaf. For diffing two configs or records, and for MLflow's flat parameters."""
    if isinstance(obj, dict) and obj:
        out = {}
        for k, v in obj.items():
            out.update(flatten(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: obj}


def _with_defaults(validator_class):
    validate_properties = validator_class.VALIDATORS["properties"]

    def set_defaults(validator, properties, instance, schema):
        if isinstance(instance, dict):
            for key, sub in properties.items():
                if "default" in sub and key not in instance:
                    instance[key] = copy.deepcopy(sub["default"])
        yield from validate_properties(validator, properties, instance, schema)

    return jsonschema.validators.extend(validator_class, {"properties": set_defaults})


def load_schema() -> dict:
    return yaml.safe_load(SCHEMA_PATH.read_text())


def validate(config: dict, configfiles=(), cli: dict | None = None) -> dict:
    """Fill defaults in place and raise ConfigError with one line per mistake: where it is (the
    file and line of `configfiles` that set the key, or `--config` for a key of `cli`), the key,
    and what is wrong (`dflash.config_errors`)."""
    from dflash.config_errors import one_line

    validator = _with_defaults(jsonschema.Draft202012Validator)(load_schema())
    errors = sorted(validator.iter_errors(config), key=lambda e: list(map(str, e.absolute_path)))
    if errors:
        files = [str(f) for f in configfiles]
        raise ConfigError("\n".join(line for e in errors for line in one_line(e, files, cli)))
    return config


def _input_paths(config: dict):
    """(key, path, kind) of every file or folder the config says to read: "dir", "file" or
    "any" (a model config may be a config.json or the folder holding one)."""
    target = config.get("target") or {}
    if target.get("path"):
        yield "target.path", target["path"], "dir"
    if target.get("random_init"):
        yield "target.random_init.config", target["random_init"]["config"], "any"
    data = config.get("data") or {}
    for i, source in enumerate(data.get("sources") or []):
        if source.get("path"):
            yield f"data.sources[{i}].path", source["path"], "file"
    if data.get("previous_stats"):
        yield "data.previous_stats", data["previous_stats"], "file"
    for i, spec in enumerate((config.get("eval") or {}).get("sets") or []):
        if spec.get("path"):
            yield f"eval.sets[{i}].path", spec["path"], "file"


def check_paths(config: dict, source: str = "config") -> dict:
    """Raise ConfigError naming each key whose path does not exist, before any job runs: a
    missing file found by a stage costs the stages before it, and found while the workflow is
    parsed it was a FileNotFoundError traceback."""
    wrong = []
    for key, value, kind in _input_paths(config):
        path = expand_user(value)
        if kind == "dir" and not path.is_dir():
            wrong.append(f"{key}: {value}: no such directory")
        elif kind == "file" and not path.is_file():
            wrong.append(f"{key}: {value}: no such file")
        elif not path.exists():
            wrong.append(f"{key}: {value}: no such file or directory")
    if wrong:
        raise ConfigError(
            f"{source} names input paths that do not exist ({'; '.join(wrong)}); relative paths"
            f" are read from the working directory, {Path.cwd()}"
        )
    return config


def check_sources(config: dict, source: str = "config") -> dict:
    """Raise ConfigError where a held-out count or a held_out eval set names a data source the
    config does not list, or one of which no row is held out: found by `expand`, or by the
    evaluation after training, it would cost the stages before them."""
    data = config.get("data") or {}
    names = [s.get("name") for s in data.get("sources") or []]
    eval_rows = data.get("eval_rows")
    per_source = eval_rows if isinstance(eval_rows, dict) else {}
    wrong = [f"data.eval_rows.{n}: no source named {n!r}" for n in per_source if n not in names]
    for i, spec in enumerate((config.get("eval") or {}).get("sets") or []):
        name = spec.get("source")
        if name is not None and name not in names:
            wrong.append(f"eval.sets[{i}].source: no source named {name!r}")
        elif name is not None and per_source and not per_source.get(name):
            wrong.append(f"eval.sets[{i}].source: data.eval_rows holds out no row of {name!r}")
    if wrong:
        raise ConfigError(f"{source}: {'; '.join(wrong)} (data.sources: {names})")
    return config


def finetune_set(tune: dict) -> list[str]:
    """The `train.finetune` keys set to other than their defaults (which change nothing)."""
    default = {"lr": None, "warmup_steps": None, "freeze_layers": 0}
    return [k for k, v in default.items() if tune.get(k, v) != v]


def _torch_version() -> tuple[int, int] | None:
    """(major, minor) of the installed torch, read without importing it (None if unknown)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        major, minor = version("torch").split(".")[:2]
        return int(major), int(minor)
    except (PackageNotFoundError, ValueError):
        return None


# eval_vllm refuses it too, when run by hand on a config whose eval.vllm.enabled is false
TEMPERATURES_ONLY_WITHOUT_ONE = (
    "eval.vllm.greedy: false serves eval.sampling's temperatures only, and "
    "eval.sampling.temperatures is empty: set one, or eval.vllm.greedy: true"
)


def check_levers(config: dict, source: str = "config") -> dict:
    """Raise ConfigError naming the keys where training's options (issue 57's levers) do not go
    together, before any job: D-PACE with distillation or a gamma, a fine-tune schedule without
    an init to fine-tune, more frozen layers than the drafter has, several answers a prompt
    without sampling, Muon on a torch without it, CUDA graphs with gradient accumulation; and
    vLLM asked for temperatures only where there are none."""
    d, t = config.get("drafter") or {}, config.get("train") or {}
    wrong = []
    if d.get("loss") == "dpace":
        if t.get("distill"):
            wrong.append(
                f"drafter.loss: dpace weighs hard labels, so train.distill must be 0 "
                f"(it is {t['distill']})"
            )
        if d.get("gamma") is not None:
            wrong.append(
                f"drafter.gamma ({d['gamma']}) is the decayed loss's; with drafter.loss: dpace "
                f"leave it null"
            )
    tune = t.get("finetune") or {}
    if d.get("init", "random") == "random" and (keys := finetune_set(tune)):
        wrong.append(
            f"train.finetune ({', '.join(keys)}) schedules a fine-tune, but drafter.init is "
            f"random: set drafter.init to the drafter to fine-tune, or remove train.finetune"
        )
    layers = d.get("num_layers", 5)
    if tune.get("freeze_layers", 0) > layers:
        wrong.append(
            f"train.finetune.freeze_layers ({tune['freeze_layers']}) is more than the drafter's "
            f"{layers} layers (drafter.num_layers)"
        )
    regen = (config.get("data") or {}).get("regenerate") or {}
    if regen.get("samples", 1) > 1 and not (
        regen.get("enabled", True) and regen.get("temperature")
    ):
        wrong.append(
            f"data.regenerate.samples ({regen['samples']}) answers a prompt need sampled "
            f"regeneration: set data.regenerate.temperature above 0 (with "
            f"data.regenerate.enabled), else every copy is the same answer"
        )
    if (config.get("compile") or {}).get("mode") == "reduce-overhead" and t.get(
        "grad_accum", 1
    ) > 1:
        wrong.append(
            f"compile.mode: reduce-overhead replays CUDA graphs whose outputs the next step "
            f"overwrites, and the first gradient of a step is such an output: accumulating "
            f"train.grad_accum ({t['grad_accum']}) steps into it would read overwritten memory; "
            f"use compile.mode: default or train.grad_accum: 1"
        )
    found = _torch_version() if t.get("optimizer") == "muon" else None
    if found is not None and found < (2, 9):
        wrong.append(
            f"train.optimizer: muon needs torch.optim.Muon (torch 2.9 or later); this environment "
            f"has torch {found[0]}.{found[1]}"
        )
    e = config.get("eval") or {}
    vllm, sampling = e.get("vllm") or {}, e.get("sampling") or {}
    if (
        vllm.get("enabled", "auto") is not False
        and vllm.get("greedy") is False
        and not sampling.get("temperatures")
    ):
        wrong.append(TEMPERATURES_ONLY_WITHOUT_ONE)
    if wrong:
        raise ConfigError(f"{source}: {'; '.join(wrong)}")
    return config


def load_config(path: str | os.PathLike) -> dict:
    path = Path(path)
    try:
        config = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError(f"cannot read config {path}: {e}") from e
    if not isinstance(config, dict):
        raise ConfigError(f"config {path} must be a mapping, got {type(config).__name__}")
    return validate(config, [path])


def expand_user(path: str) -> Path:
    return Path(os.path.expandvars(os.path.expanduser(path)))
