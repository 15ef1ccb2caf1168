"""End-to-end training throughput per topology: `dflash train` under torchrun, as the rule runs it.

Reports, per topology: tokens/s overall and per GPU (or process), each role's capacity (a
target's tokens / compute time, a drafter's tokens / time not waiting), mean queue depth, the
drafter time split, peak memory and the verdict of the run summary.

    # the CPU default: real target and data from a finished `snakemake stats` run
    python bench/pipeline.py --target results/target/hf \
        --data results/data/tokenized/train.parquet --config config/config.yaml --topologies 1+1,0+1
    # GPU, random-init target of a given shape and synthetic rows of one bucket
    python bench/pipeline.py --target-config config/models/smollm2-135m --length 1024 \
        --rows 2048 --topologies 1+1,0+1,0+2

Weights do not matter for speed, so `--target-config` builds a random target of that shape.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml


def synthetic_target(config_dir: Path, out: Path) -> int:
    """Save a random-init causal LM of that config; returns its vocab size."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(config_dir)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(out)
    return cfg.vocab_size


def synthetic_rows(
    path: Path, rows: int, length: int, vocab: int, seed: int = 0, min_length: int | None = None
) -> None:
    """Rows of `min_length..length` tokens (default `length/2+1..length`), uniform; the last 3/4
    of each is trainable (the reply)."""
    import polars as pl
    import torch

    g = torch.Generator().manual_seed(seed)
    low = min_length if min_length is not None else length // 2 + 1
    lengths = torch.randint(low, length + 1, (rows,), generator=g).tolist()
    ids, masks = [], []
    for n in lengths:
        ids.append(torch.randint(4, vocab, (n,), generator=g).tolist())
        masks.append([0] * (n // 4) + [1] * (n - n // 4))
    pl.DataFrame(
        {
            "id": [f"{i:08d}" for i in range(rows)],
            "input_ids": ids,
            "loss_mask": masks,
            "length": lengths,
            "trainable": [sum(m) for m in masks],
        }
    ).write_parquet(path)


def run_topology(args, config: dict, targets: int, drafters: int, work: Path) -> dict:
    config = json.loads(json.dumps(config))
    config["train"]["topology"] = {"targets": targets, "drafters": drafters}
    world = targets + drafters
    out = work / f"{targets}+{drafters}"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += [f"--nproc-per-node={world}", "-m", "dflash", "train", "--config", json.dumps(config)]
    cmd += ["--target", str(args.target), "--data", str(args.data)]
    cmd += ["--out", str(out / "drafter"), "--metrics", str(out / "train/metrics.jsonl")]
    cmd += ["--summary", str(out / "train/summary.json"), "--checkpoints", str(out / "ckpt")]
    # a stage manifest makes `out` a results folder that `dflash compare` reads
    cmd += ["--manifest", str(out / "manifests/train.json")]
    threads = max(1, (os.cpu_count() or 1) // world)
    env = os.environ | {"OMP_NUM_THREADS": str(threads)}
    started = time.perf_counter()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    out.mkdir(parents=True, exist_ok=True)
    (out / "stderr.log").write_text(done.stderr)
    if done.returncode:
        sys.exit(f"{targets}+{drafters} failed:\n{done.stderr[-4000:]}")
    summary = json.loads((out / "train/summary.json").read_text())
    records = [json.loads(x) for x in (out / "train/metrics.jsonl").open()]
    steady = records[1:] or records
    summary["wall_s"] = round(time.perf_counter() - started, 1)
    summary["processes"] = world
    summary["tokens_per_s_per_process"] = round(summary["tokens_per_s"] / world, 1)
    summary["peak_memory_gb"] = max(d["peak_memory_gb"] for r in steady for d in r["drafters"])
    depths = [d for r in steady for d in r.get("queue_depth", {}).values()]
    summary["queue_depth_over_steps"] = [
        round(sum(r["queue_depth"].values()) / len(r["queue_depth"]), 2)
        for r in steady
        if r.get("queue_depth")
    ]
    summary["mean_queue_depth"] = round(sum(depths) / len(depths), 2) if depths else None
    return summary


def table(results: dict) -> str:
    head = (
        f"{'topology':>9} {'tok/s':>9} {'tok/s/proc':>10} {'target cap':>10} "
        f"{'drafter cap':>11} {'queue':>6} {'wait':>6} {'fwd':>6} {'bwd':>6} {'feat':>6} "
        f"{'mem GB':>7}  verdict"
    )
    lines = [head]
    for name, s in results.items():
        t = s["time_split"]
        lines.append(
            f"{name:>9} {s['tokens_per_s']:>9.0f} {s['tokens_per_s_per_process']:>10.0f} "
            f"{s.get('target_capacity_tokens_per_s', 0):>10.0f} "
            f"{s['drafter_capacity_tokens_per_s']:>11.0f} "
            f"{(s['mean_queue_depth'] or 0):>6.2f} {t['wait']:>6.3f} {t['forward']:>6.3f} "
            f"{t['backward']:>6.3f} {t['features']:>6.3f} {s['peak_memory_gb']:>7.2f}  "
            f"{s['bottleneck']}"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", type=Path, help="workflow config (default: the embedded one)")
    p.add_argument("--set", default="{}", help="JSON merged over the config's sections")
    p.add_argument("--target", type=Path, help="target HF directory")
    p.add_argument("--data", type=Path, help="tokenized parquet")
    p.add_argument("--target-config", type=Path, help="HF config dir: random target + rows")
    p.add_argument("--rows", type=int, default=512)
    p.add_argument("--length", type=int, default=1024)
    p.add_argument("--topologies", default="1+1,0+1")
    p.add_argument("--out", type=Path, help="JSON results")
    p.add_argument(
        "--keep",
        type=Path,
        help="copy each topology's results folder here (for `dflash compare A B`)",
    )
    args = p.parse_args()

    repo = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(repo))
    from dflash.config import validate

    config = yaml.safe_load((args.config or repo / "config/config.yaml").read_text())
    for section, values in json.loads(args.set).items():
        config[section] = config.get(section, {}) | values
    work = Path(tempfile.mkdtemp(prefix="dflash-bench-"))
    if args.target_config:
        args.target = work / "target"
        vocab = synthetic_target(args.target_config, args.target)
        args.data = work / "rows.parquet"
        synthetic_rows(args.data, args.rows, args.length, vocab)
        config["target"]["mask_token_id"] = vocab - 1
        config["data"] |= {"buckets": [args.length], "max_length": args.length}
    config["train"] = config.get("train", {}) | {"checkpoint_every": 10**9, "keep_checkpoints": 1}
    config = validate(config, "bench config")

    results = {}
    for spec in args.topologies.split(","):
        targets, drafters = map(int, spec.split("+"))
        results[spec] = run_topology(args, config, targets, drafters, work)
        print(f"{spec}: {results[spec]['verdict']}", flush=True)
        if args.keep:
            shutil.copytree(work / spec, args.keep / spec, ignore=shutil.ignore_patterns("ckpt"))
    print(table(results))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"config": config, "results": results}, indent=1))


if __name__ == "__main__":
    main()
