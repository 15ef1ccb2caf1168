"""`dflash plan --from-run results/`: a finished run's own measurements, as rate entries.

What each stage of the run wrote (the same files and keys the stages write):
- train/summary.json (dflash.train.loop): `tokens_per_s` (steady steps), `topology`, `startup_s`,
  and for T + D runs the roles' `target_capacity_tokens_per_s` / `drafter_capacity_tokens_per_s`;
- logs/regenerate_train_*.log (dflash.data.regenerate): the line `regenerate: {...}` with
  `new_tokens_this_run` and `seconds` of each shard;
- compile/warmup.json (dflash.train.warmup): `seconds` and one record per bucket `shapes`;
- eval/acceptance.json (dflash.eval.run): `tokens` and `tokens_per_s` of the drafter and of each
  baseline (their decoding seconds), `n_prompts`, `max_new_tokens`;
- manifests/*.json: the stages' params (drafter, regeneration batch) and the GPU model;
- data/stats/stats.json (dflash.data.stats): the rows' mean lengths the rates were measured at;
- the target's config.json, in resources/ where the record names it (`target_config`).
Tokenization records no time of its own, so that stage keeps the shipped table's rate.
"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

from dflash.errors import UserError
from dflash.plan.rates import GPUS
from dflash.plan.shapes import Data, data_from_stats

REGENERATE_LINE = re.compile(r"regenerate: (\{.*\})\s*$")
TIER_LINE = re.compile(r"regenerate: prompt tier \{")


def target_config(run: Path) -> Path:
    """The run's target config.json: in the converted target under resources/ that the run's
    record (MANIFEST.json) or, before the record, a stage manifest names; or under the run
    itself (an earlier layout, results/target/hf). The path the first candidate names, if none
    exists."""
    candidates = [run / "target/hf/config.json"]
    record = run / "MANIFEST.json"
    if record.is_file():
        entry = (json.loads(record.read_text()).get("inputs") or {}).get("target")
        if entry:
            candidates.insert(0, run / entry["path"] / "hf/config.json")
    for manifest in sorted((run / "manifests").glob("tokenize_*.json")):
        target = json.loads(manifest.read_text()).get("inputs", {}).get("target")
        if target:  # as the workflow named it, from its working directory
            for base in (Path.cwd(), run.parent):
                candidates.append(base / target / "config.json")
    return next((c for c in candidates if c.is_file()), candidates[0])


def gpu_kind(manifest: dict) -> str:
    """The kind (a GPUS key) of the GPU a stage ran on, from its manifest's environment."""
    models = manifest.get("environment", {}).get("gpus", {}).get("models") or []
    if not models:
        return "cpu"
    return next((kind for kind in GPUS if kind.upper() in models[0].upper()), models[0].lower())


def run_rates(results: Path, target: dict) -> list[dict]:
    """Rate entries (the shape of dflash.plan.rates.RATES) for the run whose target config is
    `target`, from everything the run measured."""
    results = Path(results)
    if not results.is_dir():
        raise UserError(f"--from-run: no such folder: {results}")
    manifests = {p.stem: json.loads(p.read_text()) for p in results.glob("manifests/*.json")}
    any_manifest = manifests.get("train") or next(iter(manifests.values()), {})
    gpu = gpu_kind(any_manifest)
    stats = results / "data/stats/stats.json"
    data = data_from_stats(stats, "--from-run") if stats.is_file() else None

    def entry(stage: str, value: float, workload: dict, source: Path | str) -> dict:
        return {
            "stage": stage,
            "target": target,
            "gpu": gpu,
            "value": value,
            "workload": workload,
            "source": f"--from-run {source}",
        }

    found = _training(results, manifests.get("train"), data, entry)
    found += _regeneration(results, manifests.get("regenerate_train_0"), data, entry)
    found += _warmup(results, entry) + _evaluation(results, entry)
    if not found:
        raise UserError(
            f"--from-run: nothing measured in {results} (looked for train/summary.json with "
            "data/stats/stats.json and manifests/train.json, logs/regenerate_train_*.log, "
            "compile/warmup.json, eval/acceptance.json)"
        )
    return found


def regeneration(manifest: dict) -> dict:
    """data.regenerate as a regeneration shard's manifest records it (nested since the stage
    registry; flat before)."""
    params = manifest["params"]
    return params.get("data", {}).get("regenerate") or params


def run_settings(results: Path) -> dict:
    """The run's drafter and data settings, from its train manifest and warmup record: a plan
    of the same run defaults to them."""
    results, found = Path(results), {}
    manifest = results / "manifests/train.json"
    if manifest.is_file():
        params = json.loads(manifest.read_text())["params"]
        drafter, data = params.get("drafter", {}), params.get("data", {})
        found = {
            "anchors": drafter.get("max_anchors"),
            "drafter_layers": drafter.get("num_layers"),
            "block_size": drafter.get("block_size"),
            "max_length": data.get("max_length"),
            "epochs": params.get("train", {}).get("epochs"),
        }
    regenerate = results / "manifests/regenerate_train_0.json"
    if regenerate.is_file():
        found["max_new_tokens"] = regeneration(json.loads(regenerate.read_text()))["max_new_tokens"]
    warmup = results / "compile/warmup.json"
    if warmup.is_file() and (shapes := json.loads(warmup.read_text()).get("shapes")):
        found["buckets"] = len(shapes)
    return {k: v for k, v in found.items() if v is not None}


def _training(results: Path, manifest: dict | None, data: Data | None, entry) -> list[dict]:
    path = results / "train/summary.json"
    if not (path.is_file() and manifest and data):
        return []
    summary, drafter = json.loads(path.read_text()), manifest["params"]["drafter"]
    if not summary.get("steps"):
        return []
    workload = {
        "length": data.prompt_tokens + data.new_tokens,
        "prompt": data.prompt_tokens,
        "anchors": drafter["max_anchors"],
        "drafter_layers": drafter["num_layers"],
        "block_size": drafter["block_size"],
    }
    targets, drafters = summary["topology"]["targets"], summary["topology"]["drafters"]
    if targets == 0:
        found = [entry("train", summary["tokens_per_s"] / drafters, workload, path)]
    else:  # the two roles' capacities, per GPU
        found = [
            entry("features", summary["target_capacity_tokens_per_s"] / targets, workload, path),
            entry("drafter_step", summary["drafter_capacity_tokens_per_s"] / drafters, workload, path),
        ]  # fmt: skip
    if summary.get("startup_s") is not None:
        found.append(entry("startup", summary["startup_s"], {}, path))
    return found


def _regeneration(results: Path, manifest: dict | None, data: Data | None, entry) -> list[dict]:
    """The train split's shards: their new tokens over their seconds (one GPU each)."""
    tokens = seconds = 0.0
    tiers = 0  # each shard's prompt tiers: each ends with a drain
    for log in sorted(results.glob("logs/regenerate_train_*.log")):
        for line in log.read_text().splitlines():
            if TIER_LINE.search(line):
                tiers += 1
            elif match := REGENERATE_LINE.search(line):
                rate = ast.literal_eval(match.group(1))
                tokens += rate.get("new_tokens_this_run", 0)
                seconds += rate.get("seconds", 0)
    if not (seconds and manifest and data):
        return []
    params = regeneration(manifest)
    workload = {
        "batch": params["batch_size"],
        "prompt_tokens": data.prompt_tokens,
        "new_tokens": data.new_tokens,
        "max_new_tokens": params["max_new_tokens"],
    }
    if tiers:
        workload |= {"tiers": tiers, "tokens": tokens}
    source = f"{results}/logs/regenerate_train_*.log"
    return [entry("regenerate", tokens / seconds, workload, source)]


def _warmup(results: Path, entry) -> list[dict]:
    path = results / "compile/warmup.json"
    if not path.is_file():
        return []
    record = json.loads(path.read_text())
    shapes = len(record["shapes"])
    if not shapes:  # compile.enabled false: nothing was compiled
        return []
    workload = {"shapes": shapes, "later_s": record["seconds"] / shapes}
    return [entry("warmup", record["seconds"], workload, path)]


def _evaluation(results: Path, entry) -> list[dict]:
    path = results / "eval/acceptance.json"
    if not path.is_file():
        return []
    record = json.loads(path.read_text())
    decoded = [record, *record["baselines"].values()]
    seconds = sum(m["tokens"] / m["tokens_per_s"] for m in decoded if m.get("tokens_per_s"))
    workload = {
        "prompts": record["n_prompts"],
        "new_tokens": record["max_new_tokens"],
        "target_tokens_per_s": record["baselines"]["target"]["tokens_per_s"],
    }
    source = f"{path} (its decoding seconds: no DDTree, loading or τ checks)"
    return [entry("eval", seconds, workload, source)]
