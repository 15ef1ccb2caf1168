"""The training step (`TrainStep`, as training and the warmup run it) under each `compile.mode`
and `compile.scope`, at every bucket shape of a config: the host-inclusive seconds of a step and
its tokens/s, each variant in a fresh process (issue 58 item 3: does a step replayed as CUDA
graphs stop waiting on the host?). The drafter's step only: the target's features and the
optimizer are not in it.

    python bench/step_modes.py --config config/h200.yaml [--target config/models/smollm2-135m] \
        [--variants layers:default,layers:reduce-overhead,model:reduce-overhead] [--steps 8]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def child(config_path: str, target: str, scope: str, mode: str, steps: int) -> dict:
    import torch

    from dflash.config import load_config
    from dflash.train.warmup import bucket_shapes, warm_shapes

    config = load_config(config_path)
    config["compile"] |= {"enabled": True, "scope": scope, "mode": mode}
    shapes = bucket_shapes(config["data"])
    t0 = time.perf_counter()
    records, setup = warm_shapes(Path(target), config, shapes, steps=steps)
    for r in records:
        r["tokens_per_s"] = round(r["batch"] * r["length"] / r["step_s"])
    tokens = sum(r["batch"] * r["length"] for r in records)
    return {
        "scope": scope,
        "mode": mode,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "seconds": round(time.perf_counter() - t0, 1),
        # a step of each shape once: the shapes' tokens over their summed step times
        "tokens_per_s": round(tokens / sum(r["step_s"] for r in records)),
        "shapes": records,
        **setup,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--config", default="config/h200.yaml")
    p.add_argument("--target", default=str(ROOT / "config/models/smollm2-135m"))
    p.add_argument(
        "--variants", default="layers:default,layers:reduce-overhead,model:reduce-overhead"
    )
    p.add_argument("--steps", type=int, default=8, help="steps a shape (graphs record on the 2nd)")
    p.add_argument("--out", default="step_modes.json")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        scope, mode = args.child.split(":")
        print(json.dumps(child(args.config, args.target, scope, mode, args.steps)))
        return
    results = []
    for variant in args.variants.split(","):
        cmd = [sys.executable, __file__, "--config", args.config, "--target", args.target,
               "--steps", str(args.steps), "--child", variant]  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode:
            results.append({"variant": variant, "error": done.stderr[-2000:]})
        else:
            results.append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(json.dumps(results[-1]), flush=True)
    Path(args.out).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
