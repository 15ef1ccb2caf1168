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
tokenized rows taken from the base, so the curve's points cost no regeneration and train side
by side with the levers. With the static engine (`engine: auto` on a GPU) a row's answer depends
on that row alone, so they are the very rows a run of that share makes; with `hf` or vLLM, whose
batches can round a near tie apart, the same target's answers in the same mode. A variant that
changes any other key the rows are made from is refused. `expanded/report.json`
gives the kept row count (`compute-curve` reads it). `data.domain_rows` takes a share by domain
the same way (e.g. `data.domain_rows={chat: 6000, code: 0, math: 0}`: the chat rows alone).

`drafter.init=sweep:NAME` fine-tunes from variant NAME's drafter: the variant starts once NAME's
training has ended (issue 57's fine-tune: a chat drafter moved onto the mixture, in one sweep).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import re
import shutil
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


SUBSET_KEYS = ("domain_rows", "train_rows", "train_fraction")
SAMPLE_COPY = re.compile(r"-s\d+$")  # `expand`'s `<id>-s<k>`: a row's k-th sampled answer


def rows_changed(base: dict, config: dict) -> list[str]:
    """The keys, but for the share keys, that differ between the two configs among those the
    training rows depend on: what the stages that make them record (`Stage.depends`)."""
    from dflash.stages import STAGES

    share = tuple(f"data.{k}" for k in SUBSET_KEYS)
    changed = set()
    for name in ("target", "expand", "regenerate", "tokenize"):
        was, now = STAGES[name].depends(base), STAGES[name].depends(config)
        changed |= {k for k in was.keys() | now.keys() if was.get(k) != now.get(k)}
    return sorted(k for k in changed if not k.startswith(share))


def share_refused(base: dict, config: dict) -> str | None:
    """Why the base's training rows cannot give the variant's (None where they can). `expand`
    keeps first_rows(cap_rows(rows, domain_rows), train_rows, train_fraction): each a prefix
    (per domain for the caps) of the rows before it, so a variant's rows are a share of the
    base's when every other key that makes rows is the base's, and its caps, row count and
    fraction keep no row the base's left out."""
    if other := rows_changed(base, config):
        return f"the variant changes {', '.join(other)}, which make the rows themselves"
    base_data, data = base["data"], config["data"]
    if base_data.get("train_fraction", 1.0) < 1.0:
        return f"data.train_fraction {base_data['train_fraction']} there"
    base_caps, caps = base_data.get("domain_rows") or {}, data.get("domain_rows") or {}
    rows, base_rows = data.get("train_rows"), base_data.get("train_rows")
    if caps != base_caps:
        if base_rows is not None:
            return f"data.train_rows is {base_rows} there, and the variant changes data.domain_rows"
        wider = [
            d for d, cap in base_caps.items()
            if cap is not None and (caps.get(d) is None or caps[d] > cap)
        ]  # fmt: skip
        if wider:
            return f"data.domain_rows caps {', '.join(sorted(wider))} there below the variant's"
    elif base_rows is not None and (rows is None or rows > base_rows):
        return f"data.train_rows is {base_rows} there, the variant asks {rows}"
    return None


def subset_data(base: Path, folder: Path, base_config: dict, config: dict) -> int:
    """`folder/data` from `base/data`, written whole or not at all: the training rows `expand`
    keeps under the variant's domain_rows, train_rows and train_fraction (a row's copies for
    sampled answers follow it), the eval split linked; returns the prompts kept."""
    from dflash.data.domains import cap_rows, counts
    from dflash.data.expand import first_rows

    if why := share_refused(base_config, config):
        raise SystemExit(
            f"sweep: {base}/data cannot give this variant's rows ({why}): a variant can only "
            "take a share of rows the base has"
        )
    data = config["data"]
    src = base / "data"
    expanded = pl.read_parquet(src / "expanded/train.parquet", columns=["id", "domain"])
    rows = [r for r in expanded.to_dicts() if not SAMPLE_COPY.search(r["id"])]
    capped, _ = cap_rows(rows, data.get("domain_rows") or {})
    shared = first_rows(capped, data.get("train_rows"), data.get("train_fraction", 1.0))
    keep = {r["id"] for r in shared}

    def kept(frame: pl.DataFrame) -> pl.DataFrame:  # in the base's order
        return frame.filter(pl.col("id").str.replace(SAMPLE_COPY.pattern, "").is_in(keep))

    out = folder / "data.partial"
    shutil.rmtree(out, ignore_errors=True)
    for split in ("expanded", "tokenized"):
        (out / split).mkdir(parents=True)
        train = kept(pl.read_parquet(src / split / "train.parquet"))
        train.write_parquet(out / split / "train.parquet")
        (out / split / "eval.parquet").symlink_to(src / split / "eval.parquet")
        if split == "expanded":
            train_rows = train.height  # copies included, as `expand` counts them
    report = json.loads((src / "expanded/report.json").read_text())
    report["train_rows"] = train_rows
    if "train_prompts" in report:  # `expand` counts them where each has several answers
        report["train_prompts"] = len(keep)
    report.setdefault("domains", {})["train"] = counts(shared)
    report["share_of"] = {"folder": str(src), "prompts": len(rows)}
    report["share_of"] |= {k: data.get(k) for k in SUBSET_KEYS}
    (out / "expanded/report.json").write_text(json.dumps(report, indent=1))
    out.rename(folder / "data")
    return len(keep)


def after_sibling(config: dict, base: Path) -> Path | None:
    """`drafter.init: sweep:NAME` (a fine-tune from another variant of the same sweep) made
    that variant's exported drafter's path; returns that variant's folder, whose training this
    one waits for, or None."""
    init = str(config["drafter"].get("init") or "")
    if not init.startswith("sweep:"):
        return None
    sibling = base / "sweep" / init.removeprefix("sweep:")
    config["drafter"]["init"] = str(sibling / "drafter")
    return sibling


def waiting_for(sibling: Path, command: list[str]) -> list[str]:
    """`command`, started once `sibling`'s training has ended; nothing if it failed first."""
    wait = (
        'while [ ! -e "$0/train/summary.json" ]; do '
        'if grep -q FAILED "$0/sweep.log" 2>/dev/null; then echo "$0 failed"; exit 1; fi; '
        'sleep 2; done; exec "$@"'
    )
    return ["bash", "-c", wait, str(sibling), *command]


def start(args) -> None:
    base = Path(args.results).resolve()
    base_config = yaml.safe_load(Path(args.config).read_text())
    for name, *pairs in args.variant:
        folder = base / "sweep" / name  # inside the ignored results folder: it survives
        folder.mkdir(parents=True, exist_ok=True)
        config = with_overrides(copy.deepcopy(base_config), pairs)
        sibling = after_sibling(config, base)
        # the variant's data made again at every start: a name may take another share
        data = folder / "data"
        if data.is_symlink():
            data.unlink()
        shutil.rmtree(data, ignore_errors=True)
        if any(config["data"].get(k) != base_config["data"].get(k) for k in SUBSET_KEYS):
            prompts = subset_data(base, folder, base_config, config)
            print(f"{name}: {prompts} of the base's training prompts")
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
        cmd = [*cmd, *args.stages]
        subprocess.Popen(
            waiting_for(sibling, cmd) if sibling else cmd,
            stdout=log,
            stderr=log,
            cwd=ROOT,
            start_new_session=True,
            # a lock folder per variant: the evaluations claim "a GPU of their own" (dflash.gpus)
            # and would otherwise run one after the other on the one GPU they all share
            env={**os.environ, "PYTHONUNBUFFERED": "1", "DFLASH_GPU_LOCKS": str(folder / "gpus")},
        )
        after = f", after {sibling.name}'s training" if sibling else ""
        print(f"{name}: {' '.join(pairs) or '(the config as is)'} -> {folder}{after}")


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
