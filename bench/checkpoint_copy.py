"""The step's stall at a checkpoint: copying the state to host memory, pageable against the
page-locked buffers `HostSnapshots` reuses, at the size of the 8B rehearsal's checkpoint.

    python bench/checkpoint_copy.py --gb 12.58

A state of fp32 tensors of about 64 MB each (a 1.05B-parameter drafter's weights and AdamW's
two moments are 12.58 GB), copied three ways: `.to("cpu")` (how checkpoints copied before),
`HostSnapshots.copy` the first time (its buffers allocated) and the second time (reused).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflash.train.checkpoint import HostSnapshots  # noqa: E402


def timed(fn) -> float:
    torch.cuda.synchronize()
    started = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=12.58)
    args = parser.parse_args()
    n = round(args.gb * 1e9 / (16 * 2**20 * 4))  # tensors of 16M fp32 values
    state = {"t": [torch.randn(16 * 2**20, device="cuda") for _ in range(n)], "step": 1}
    gb = n * 16 * 2**20 * 4 / 1e9
    pageable = timed(lambda: [x.to("cpu", copy=True) for x in state["t"]])
    host = HostSnapshots()
    first = timed(lambda: host.copy(state))
    second = timed(lambda: host.copy(state))
    copy = host.copy(state)
    assert all(torch.equal(a.cpu(), b) for a, b in zip(state["t"], copy["t"], strict=True))
    print(json.dumps({
        "gb": round(gb, 2), "device": torch.cuda.get_device_name(), "torch": torch.__version__,
        "pageable_s": round(pageable, 2), "pinned_first_s": round(first, 2),
        "pinned_reused_s": round(second, 2), "pinned_reused_gb_s": round(gb / second, 1),
    }))  # fmt: skip


if __name__ == "__main__":
    main()
