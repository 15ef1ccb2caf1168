"""Train several variants of one config side by side on one GPU, from one data folder, and
compare their learning curves (loss and held-out tau_sim against training tokens).

    python3 bench/sweep.py start --config config/h200.yaml --results results \
        --variant lr2e-3 train.lr=2e-3 --variant deep5 train.lr=2e-3 drafter.num_layers=5
    python3 bench/sweep.py collect --results results --json sweep.json

`start` writes `<results>/sweep/<name>/config.yaml` (the config with the variant's dotted keys
set, values read as YAML), links the base folder's `target` and `data` into it, and starts
`tools/gpu-box/stages.sh ... train` (or `--stages train eval ddtree`) there in the background: each
variant its own process (a small target leaves most of an H200 idle to one). Everything stays
inside the results folder, which is ignored: a lent GPU box removes files git would track when
the next call's working tree arrives. `collect` reads every variant's metrics (the live ones of
a run still going) and the eval's acceptance.json where there is one.

A variant that sets `data.train_fraction` or `data.train_rows` (issue 57's τ against compute)
trains on its own share of the base folder's rows, not on all of them: the rows `expand` would
have kept (`first_rows` over the base's training rows, a prefix of them), their regenerated and
tokenized rows taken from the base (a row's answer depends on that row alone), so the curve's
points cost no regeneration and train side by side with the levers. `expanded/report.json`
gives the kept row count (`compute-curve` reads it).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
from pathlib import Path

import polars as pl
import yaml

ROOT = Path(__file__).resolve().parents[1]


def _value(text: str):
    """YAML, where `2e-3` is a number (YAML 1.1 reads it as a string without a dot)."""
    value = yaml.safe_load(text)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            pass
    return value


def with_overrides(config: dict, pairs: list[str]) -> dict:
    """`config` with each `a.b.c=value` set (value parsed as YAML); the key must exist."""
    for pair in pairs:
        key, _, value = pair.partition("=")
        node = config
        *parents, leaf = key.split(".")
        for name in parents:
            node = node.setdefault(name, {})
        node[leaf] = _value(value)
    return config


SUBSET_KEYS = ("train_rows", "train_fraction")
SAMPLE_COPY = re.compile(r"-s\d+$")  # `expand`'s `<id>-s<k>`: a row's k-th sampled answer


def subset_data(base: Path, folder: Path, base_data: dict, data: dict) -> int:
    """`folder/data` from `base/data`: the training rows `first_rows` keeps under `data`'s
    train_rows and train_fraction (copies of a row for sampled answers follow it), the eval split
    linked; returns the rows kept. The base must hold every row those keys could keep."""
    from dflash.data.expand import first_rows

    if base_data.get("train_fraction", 1.0) < 1.0 or (
        base_data.get("train_rows") is not None
        and (data.get("train_rows") is None or data["train_rows"] > base_data["train_rows"])
    ):
        raise SystemExit(
            f"sweep: {base}/data holds a part of the training rows (data.train_rows "
            f"{base_data.get('train_rows')}, train_fraction {base_data.get('train_fraction')}): "
            "a variant can only take a share of rows the base has"
        )
    src, out = base / "data", folder / "data"
    expanded = pl.read_parquet(src / "expanded/train.parquet")
    rows = [i for i in expanded["id"] if not SAMPLE_COPY.search(i)]
    keep = set(first_rows(rows, data.get("train_rows"), data.get("train_fraction", 1.0)))

    def kept(frame: pl.DataFrame) -> pl.DataFrame:  # in the base's order
        return frame.filter(pl.col("id").str.replace(SAMPLE_COPY.pattern, "").is_in(keep))

    for split in ("expanded", "tokenized"):
        (out / split).mkdir(parents=True, exist_ok=True)
        kept(pl.read_parquet(src / split / "train.parquet")).write_parquet(
            out / split / "train.parquet"
        )
        for name in ("eval.parquet",):
            if not (out / split / name).exists():
                (out / split / name).symlink_to(src / split / name)
    report = json.loads((src / "expanded/report.json").read_text())
    report["train_rows"] = len(keep)
    report["subset_of"] = {"folder": str(src), "train_rows": len(rows), **{
        k: data.get(k) for k in SUBSET_KEYS}}  # fmt: skip
    (out / "expanded/report.json").write_text(json.dumps(report, indent=1))
    return len(keep)


def start(args) -> None:
    base = Path(args.results).resolve()
    base_config = yaml.safe_load(Path(args.config).read_text())
    for name, *pairs in args.variant:
        folder = base / "sweep" / name  # inside the ignored results folder: it survives
        folder.mkdir(parents=True, exist_ok=True)
        config = with_overrides(yaml.safe_load(Path(args.config).read_text()), pairs)
        subset = any(config["data"].get(k) != base_config["data"].get(k) for k in SUBSET_KEYS)
        if subset and not (folder / "data").exists():
            rows = subset_data(base, folder, base_config["data"], config["data"])
            print(f"{name}: {rows} of the base's training rows")
        for shared in ("target", "data"):
            link = folder / shared
            if not link.exists():
                link.symlink_to(base / shared)
        (folder / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
        log = open(folder / "sweep.log", "a")
        cmd = [
            "bash",
            str(ROOT / "tools/gpu-box/stages.sh"),
            str(folder / "config.yaml"),
            str(folder),
        ]
        subprocess.Popen(
            [*cmd, *args.stages],
            stdout=log,
            stderr=log,
            cwd=ROOT,
            start_new_session=True,
            # a lock folder per variant: the evaluations claim "a GPU of their own" (dflash.gpus)
            # and would otherwise run one after the other on the one GPU they all share
            env={**os.environ, "PYTHONUNBUFFERED": "1", "DFLASH_GPU_LOCKS": str(folder / "gpus")},
        )
        print(f"{name}: {' '.join(pairs) or '(the config as is)'} -> {folder}")


def curve(metrics: Path) -> list[dict]:
    rows, seen = [], 0
    for line in metrics.read_text().splitlines():
        m = json.loads(line)
        seen += sum(d["tokens"] for d in m["drafters"])
        if "tau_sim" in m:
            rows.append(
                {
                    "step": m["step"],
                    "tokens_m": round(seen / 1e6, 2),
                    "loss": m["loss"],
                    "tau_sim": m["tau_sim"],
                    "tau_sim_first": m.get("tau_sim_first"),
                }
            )
    return rows


def collect(args) -> None:
    base = Path(args.results).resolve()
    out = {}
    for folder in sorted((base / "sweep").glob("*")):
        # the finished run's metrics, else the live ones of a run still going
        found = [folder / "train/metrics.jsonl", *folder.glob("checkpoints/*/metrics.live.jsonl")]
        found = [m for m in found if m.exists()]
        if not found:
            continue
        metrics = found[0]
        name = folder.name
        config = yaml.safe_load((folder / "config.yaml").read_text())
        summary = folder / "train/summary.json"
        out[name] = {
            "train": config["train"],
            "drafter": config["drafter"],
            "data": {k: config["data"][k] for k in ("token_budget", "max_batch_size")},
            "curve": curve(metrics),
            "summary": json.loads(summary.read_text()) if summary.exists() else None,
        }
        acceptance = folder / "eval/acceptance.json"
        if acceptance.exists():  # real τ per set: the drafter and its baselines
            record = json.loads(acceptance.read_text())
            sets = {"drafter": record["sets"], **record.get("baseline_sets", {})}
            out[name]["tau"] = {
                method: {
                    set_name: {k: m[k] for k in ("tau_macro", "tau_pooled", "n_prompts")}
                    for set_name, m in by_set.items()
                }
                for method, by_set in sets.items()
            }
            out[name]["tau_sim_eval"] = record.get("tau_sim")
        last = out[name]["curve"][-1] if out[name]["curve"] else {}
        print(f"{name:>12}: {len(out[name]['curve'])} points, last {last}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="verb", required=True)
    s = sub.add_parser("start")
    s.add_argument("--config", required=True)
    s.add_argument("--results", required=True, help="the base folder holding target/ and data/")
    s.add_argument(
        "--stages",
        nargs="+",
        default=["train"],
        help="tools/gpu-box/stages.sh stages per variant, e.g. train eval (default: train)",
    )
    s.add_argument(
        "--variant", nargs="+", action="append", required=True, metavar=("NAME", "KEY=VALUE")
    )
    c = sub.add_parser("collect")
    c.add_argument("--results", required=True)
    c.add_argument("--json")
    args = p.parse_args()
    start(args) if args.verb == "start" else collect(args)


if __name__ == "__main__":
    main()
