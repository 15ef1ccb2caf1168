"""Compile warmup at Qwen3-8B drafter shapes on a GPU: a cold process, then a warm one that shares
the cache. Prints per-shape first-step and steady step seconds for both.

    python bench/warmup_gpu.py --cache /tmp/cc [--child]
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

SHAPES = [(4, 1024), (2, 2048), (1, 4096)]  # (batch, bucket length) under a 4K-token budget


def warm_config(
    layers: int, anchors: int, mask_token_id: int, device: str = "auto", scope: str = "layers"
) -> dict:
    """The resolved config subset `warm_shapes` reads (written out: the GPU image has no
    jsonschema); bench/gpu.py's warm start uses it too."""
    return {
        "drafter": {
            "num_layers": layers,
            "block_size": 16,
            "max_anchors": anchors,
            "gamma": None,
            "target_layer_ids": None,
        },
        "compile": {
            "enabled": True,
            "device": device,
            "attention": "auto",
            "target": True,
            "scope": scope,
        },
        "target": {"mask_token_id": mask_token_id},
        "train": {"distill": 0},
    }


def child(cache: str) -> None:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = f"{cache}/inductor"
    os.environ["TRITON_CACHE_DIR"] = f"{cache}/triton"
    from dflash.train.warmup import tree_size, warm_shapes

    config = warm_config(5, 256, 151669)
    t0 = time.perf_counter()
    records, setup = warm_shapes(
        Path(__file__).resolve().parents[1] / "config/models/qwen3-8b", config, SHAPES, steps=3
    )
    print(
        json.dumps(
            {
                "seconds": round(time.perf_counter() - t0, 1),
                "shapes": records,
                **setup,
                "cache_files": tree_size(Path(cache))[0],
            }
        )
    )


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--cache", required=True)
    p.add_argument("--child", action="store_true")
    args = p.parse_args()
    if args.child:
        child(args.cache)
        sys.exit()
    for label in ("cold", "warm"):
        out = subprocess.run(
            [sys.executable, __file__, "--cache", args.cache, "--child"],
            capture_output=True,
            text=True,
        )
        last = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else out.stderr[-3000:]
        print(label, last, flush=True)
