"""Failure behaviour on real hardware: start `dflash train` (1 target + 1 drafter) under torchrun,
then freeze (SIGSTOP) or kill (SIGKILL) the target rank after the second checkpoint, and report
how long the run takes to exit and with what message. The CPU tests do the same with gloo; this
checks the NCCL path on GPUs.

    python bench/fail_fast.py --target-config config/models/smollm2-135m --mode stop --timeout 10
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pipeline import synthetic_rows, synthetic_target  # noqa: E402


def child_with_rank(parent: int, rank: int) -> int:
    for pid in map(int, filter(str.isdigit, os.listdir("/proc"))):
        try:
            ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if ppid == parent and f"RANK={rank}".encode() in env:
            return pid
    raise RuntimeError(f"no worker with RANK={rank}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--target-config", type=Path, required=True)
    p.add_argument("--mode", choices=["stop", "kill"], default="stop")
    p.add_argument("--timeout", type=float, default=10)
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="dflash-failfast-"))
    vocab = synthetic_target(args.target_config, work / "target")
    synthetic_rows(work / "rows.parquet", 256, 512, vocab)
    config = {
        "target": {"mask_token_id": vocab - 1},
        "drafter": {"num_layers": 1, "max_anchors": 16},
        "data": {"buckets": [512], "max_length": 512, "token_budget": 2048, "max_batch_size": 4},
        "train": {"checkpoint_every": 1, "timeout_s": args.timeout, "epochs": 5},
    }
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    cmd += ["-m", "dflash", "train", "--config", json.dumps(config), "--target"]
    cmd += [str(work / "target"), "--data", str(work / "rows.parquet"), "--out", str(work / "d")]
    cmd += ["--metrics", str(work / "m.jsonl"), "--summary", str(work / "s.json")]
    cmd += ["--checkpoints", str(work / "ckpt")]
    run = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    while not list(work.glob("ckpt/run-*/step-00000002")):
        if run.poll() is not None:
            sys.exit(run.stderr.read()[-3000:])
        time.sleep(0.05)
    target = child_with_rank(run.pid, 1)
    os.kill(target, signal.SIGSTOP if args.mode == "stop" else signal.SIGKILL)
    started = time.perf_counter()
    err = run.communicate()[1]
    seconds = time.perf_counter() - started
    lines = [x for x in err.splitlines() if "error" in x.lower() or "rank" in x.lower()]
    print("\n".join(lines[-12:]))
    print(f"mode={args.mode} exit code {run.returncode} after {seconds:.1f} s")


if __name__ == "__main__":
    main()
