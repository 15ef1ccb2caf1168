"""The static regeneration engine's decode step, per batch x cache capacity: where its time goes.

    python bench/regen_step.py --target results/target/hf

Times one `BatchedGreedy.step()` (CUDA-graph replay + host sync) against the same step run
eagerly, and one full prefill call of 300-token prompts (padded to the tier, capacity - 512),
per prompt. The step attends over the whole preallocated cache, so its cost grows with the
capacity (prompt tier + max_new_tokens).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflash.model.engine import BatchedGreedy  # noqa: E402

SHAPES = [(256, 2560), (256, 1024), (512, 768), (512, 1024), (512, 1536), (512, 2560)]


def timed(fn, n: int) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / n


def main():
    from transformers import AutoModelForCausalLM

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", type=Path, required=True)
    args = parser.parse_args()
    model = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.bfloat16)
    model = model.cuda().eval()
    for batch, capacity in SHAPES:
        engine = BatchedGreedy(model, batch, capacity, prompt_width=capacity - 512)
        engine.positions.fill_(100)
        engine.step()  # captures
        rows = list(range(engine.prefill_rows))
        prompts = [list(range(300))] * len(rows)
        engine.prefill(rows, prompts)
        step = timed(engine.step, 50)
        eager = timed(lambda e=engine: e._step(e.tokens, e.positions), 20)
        prefill = timed(lambda e=engine, r=rows, p=prompts: e.prefill(r, p), 20) / len(rows)
        print(
            f"batch {batch} capacity {capacity}: step {step * 1e3:.2f} ms "
            f"(eager {eager * 1e3:.2f}) = {batch / step:.0f} tokens/s; "
            f"prefill {prefill * 1e3:.2f} ms per 300-token prompt ({len(rows)} per call)",
            flush=True,
        )
        del engine
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
