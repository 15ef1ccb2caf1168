"""A run's folder belongs to its config: a command whose config makes something else (another
target, data, drafter or training) than the run already in `results` refuses before any job,
naming both configs and what to do. README's commands once left out `--configfile`, and
`snakemake all` then planned the whole embedded default over one's own finished run.

What a run is "of" is recorded when it starts (`results/work/run-config.json`: the config
files and the config); a run from before that record is read from its `MANIFEST.json`. The same
config files, edited, are the same run (changed keys rerun what depends on them, as always; the
note names them); other files, or none where the run had some, must make the same things, or
the command passes `--config overwrite_results=true` to make its own over them.
"""

from __future__ import annotations

import json
from pathlib import Path

from dflash.errors import UserError
from dflash.io import write_json

RECORD = Path("work") / "run-config.json"
MAKES = ("seed", "target", "data", "drafter", "train")
# keys that change how fast or where something is made, or what is logged, not what is made
IGNORED = (
    "data.num_proc",
    "data.previous_stats",
    "data.regenerate.shards",
    "data.regenerate.batch_size",
    "data.regenerate.device",
    "data.regenerate.engine",
    "data.regenerate.attention",
    "train.checkpoint_every",
    "train.keep_checkpoints",
    "train.device",
    "train.tensorboard",
    "train.mlflow",
    "train.wandb",
    "train.nnodes",
    "train.rdzv_endpoint",
    "train.queue_depth",
    "train.timeout_s",
    "train.startup_timeout_s",
    "train.topology",
    "train.tau_sim",
)
SHOWN = 4  # differing keys named in a message
EMBEDDED = "the embedded default (config/config.yaml)"


def _ignored(key: str) -> bool:
    return any(key == i or key.startswith(i + ".") for i in IGNORED)


def _diff(old, new, prefix: str, out: list) -> None:
    """Differing keys, descending only where both sides are mappings (a target given by `path`
    against one by `gguf_wheel` is one difference each, not one per wheel field)."""
    if isinstance(old, dict) and isinstance(new, dict):
        for key in sorted(old.keys() | new.keys()):
            _diff(old.get(key), new.get(key), f"{prefix}{key}.", out)
    elif old != new and "auto" not in (old, new) and not _ignored(prefix[:-1]):
        out.append((prefix[:-1], old, new))


def differences(old: dict, new: dict) -> list[str]:
    """`key: old -> new` for each key of what a run makes that differs, target and data sources
    first; `auto` matches the number it resolved to."""
    out: list = []
    _diff({k: old.get(k) for k in MAKES}, {k: new.get(k) for k in MAKES}, "", out)
    first = ("target", "data.sources")
    out.sort(key=lambda d: (next((i for i, p in enumerate(first) if d[0].startswith(p)), 2), d[0]))
    return [f"{key}: {_short(a)} -> {_short(b)}" for key, a, b in out]


def _short(value) -> str:
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= 60 else text[:57] + "..."


def recorded(results: Path) -> tuple[list[str] | None, dict] | None:
    """(config files, config) of the run in `results`: its start record, else its MANIFEST.json
    (config files unknown); None when no run is there."""
    for path, files in ((results / RECORD, True), (results / "MANIFEST.json", False)):
        try:
            record = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if isinstance(record, dict) and isinstance(record.get("config"), dict):
            return (record.get("configfiles") if files else None), record["config"]
    return None


def _named(files: list[str] | None) -> str:
    if files is None:
        return "a config its MANIFEST.json holds (from before runs recorded their config files)"
    return " ".join(files) if files else EMBEDDED


def _option(files: list[str]) -> str:
    return f"--configfile {' '.join(files)}" if files else "no --configfile (the embedded default)"


def check(config: dict, configfiles: list[str], results: Path, name: str = "") -> str | None:
    """Refuse a config that makes something else than the run in `results` (UserError), or
    return a note when the run's own config files have changed since it started. `name`: the
    folder as the config names it (default: `results`)."""
    found = recorded(results)
    shown_results = name or str(results)
    if found is None or str(config.get("overwrite_results")).lower() == "true":
        return None
    files, old = found
    changed = differences(old, config)
    if not changed:
        return None
    shown = "; ".join(changed[:SHOWN]) + (
        f"; and {len(changed) - SHOWN} more" if len(changed) > SHOWN else ""
    )
    if files is not None and files == configfiles:
        return (
            f"{shown_results}/ holds a run of {_named(files)} as it was then; changed since: {shown}"
            " (what depends on them is made again)"
        )
    keep = _option(files) if files is not None else "the config that made it"
    raise UserError(
        f"{shown_results}/ holds a run of {_named(files)}, and this command's config"
        f" ({_named(configfiles)}) makes something else: {shown}. To keep working on that run,"
        f" give it {keep}; to start another run beside it, set `results:` in your config to"
        f" another folder; to make this config's outputs over it, add --config"
        " overwrite_results=true"
    )


def record(config: dict, configfiles: list[str], results: Path) -> None:
    """What the run in `results` is of, written when a run starts (never by a dry run)."""
    write_json(results / RECORD, {"configfiles": configfiles, "config": config})
