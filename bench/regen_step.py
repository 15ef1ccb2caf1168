"""The static regeneration engine's decode step, per batch x cache capacity: where its time goes.

    python bench/regen_step.py --target results/target/hf
    python bench/regen_step.py --target-config bench/configs/smollm2-135m   # random weights

Times one `BatchedGreedy.step()` (CUDA-graph replay + host sync) against the same step run
eagerly, for each decode-step attention (`sdpa`: the whole preallocated cache under a mask, so
its cost grows with the capacity, prompt tier + max_new_tokens; `flex`: only each row's live key
blocks), and one full prefill call of prompts three quarters of the tier (capacity - 512) long,
per prompt, beside one prompt per call (how prefill ran before). The rows' positions are spread
evenly from that prompt length to the end of the cache, as in a refilled batch mid-run.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflash.model.engine import BatchedGreedy  # noqa: E402

SHAPES = [(256, 2560), (256, 1024), (512, 768), (512, 1024), (512, 1536), (512, 2560)]


def shape(text: str) -> tuple[int, int]:
    """`512x2560` -> (512, 2560)."""
    try:
        batch, capacity = map(int, text.split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: want BATCHxCAPACITY, e.g. 512x2560") from None
    return batch, capacity


def timed(fn, n: int) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / n


def main():
    from transformers import AutoConfig, AutoModelForCausalLM

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--target", type=Path)
    source.add_argument("--target-config", type=Path, help="random weights: time is the same")
    parser.add_argument("--attention", nargs="+", default=["sdpa", "flex"])
    parser.add_argument(
        "--shapes", nargs="+", type=shape, help="BATCHxCAPACITY, e.g. 512x2560 (default: SHAPES)"
    )
    args = parser.parse_args()
    shapes = args.shapes or SHAPES
    if args.target:
        model = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.bfloat16)
    else:
        config = AutoConfig.from_pretrained(args.target_config)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model = model.cuda().eval()
    for (batch, capacity), attention in itertools.product(shapes, args.attention):
        tier = capacity - 512
        n = tier * 3 // 4  # a prompt three quarters of its tier long
        engine = BatchedGreedy(model, batch, capacity, prompt_width=tier, attention=attention)
        spread = torch.linspace(n, capacity - 1, batch, device=engine.device).long()

        def step(e=engine, spread=spread):
            e.positions.copy_(spread)  # step() advances them: start each call from the spread
            e.step()

        step()  # captures
        rows = list(range(engine.prefill_rows))
        prompts = [list(range(n))] * len(rows)
        engine.prefill(rows, prompts)
        step_s = timed(step, 50)
        eager = timed(lambda e=engine, p=spread: e._step(e.tokens, p), 20)
        prefill = timed(lambda e=engine, r=rows, p=prompts: e.prefill(r, p), 20) / len(rows)
        del engine
        torch.cuda.empty_cache()
        # before: one prompt per call, padded to a multiple of 64
        alone = BatchedGreedy(model, batch, capacity, prompt_width=-(-n // 64) * 64)
        alone.prefill_rows = 1
        alone.prefill([0], prompts[:1])
        one = timed(lambda e=alone, p=prompts[:1]: e.prefill([0], p), 20)
        print(
            f"batch {batch} capacity {capacity} {attention}: step {step_s * 1e3:.2f} ms "
            f"(eager {eager * 1e3:.2f}) = {batch / step_s:.0f} tokens/s; prefill of a "
            f"{n}-token prompt {prefill * 1e3:.2f} ms ({len(rows)} per call) vs "
            f"{one * 1e3:.2f} ms alone",
            flush=True,
        )
        del alone
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
