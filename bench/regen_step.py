"""The static regeneration engine's decode step, per batch x cache capacity: where its time goes.

    python bench/regen_step.py --target results/target/hf
    python bench/regen_step.py --target-config config/models/smollm2-135m   # random weights

    python bench/regen_step.py --target-config config/models/qwen3-8b --attention flex \
        --compiled 0 1 --shapes 128x1280 128x3584 1x1280 --no-prefill   # fused against not

Times one `BatchedGreedy.step()` (CUDA-graph replay + host sync) against the same step run
without a graph, its layers fused by torch.compile or not, beside the bandwidth roofline (the
weights and each row's live cache read once at 4.8 TB/s), for each decode-step attention
(`sdpa`: the whole preallocated cache under a mask, so its cost grows with the capacity, prompt
tier + max_new_tokens; `flex`: only each row's live key blocks), and one full prefill call of
prompts three quarters of the tier (capacity - 512) long, per prompt, beside one prompt per call
(how prefill ran before). The rows' positions are spread evenly from that prompt length to the
end of the cache, as in a refilled batch mid-run.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflash.model.batched import BatchedGreedy  # noqa: E402
from dflash.model.memory import decode_weight_bytes, kv_bytes_per_token  # noqa: E402

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


def profile_step(fn) -> dict:
    """Device milliseconds of one ungraphed step by kernel kind (`bench/gpu_base.py`'s split)
    and its ten costliest kernels: where a step's time goes against its roofline."""
    from gpu_base import kernel_split
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    averages = prof.key_averages()
    kernels = sorted(
        (e for e in averages if e.self_device_time_total), key=lambda e: -e.self_device_time_total
    )
    top = {e.key[:80]: [round(e.self_device_time_total / 1e3, 3), e.count] for e in kernels[:10]}
    return {**kernel_split(averages), "top_kernels_ms_calls": top}


def main():
    from transformers import AutoConfig, AutoModelForCausalLM

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--target", type=Path)
    source.add_argument("--target-config", type=Path, help="random weights: time is the same")
    parser.add_argument("--attention", nargs="+", default=["sdpa", "flex"])
    parser.add_argument(
        "--compiled", nargs="+", default=["1"], choices=["0", "1"],
        help="the step's layers fused by torch.compile (1) or eager (0); both: 0 1",
    )  # fmt: skip
    parser.add_argument("--no-prefill", action="store_true", help="time the decode step alone")
    parser.add_argument("--out", type=Path, help="append each result as a JSON line here")
    parser.add_argument(
        "--profile", action="store_true",
        help="also the ungraphed step's device time by kernel kind, and its top kernels",
    )  # fmt: skip
    parser.add_argument(
        "--shapes", nargs="+", type=shape, help="BATCHxCAPACITY, e.g. 512x2560 (default: SHAPES)"
    )
    args = parser.parse_args()
    shapes = args.shapes or SHAPES
    if args.target:
        model = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.bfloat16)
    else:
        config = AutoConfig.from_pretrained(args.target_config)
        with torch.device("cuda"):  # drawn on the GPU: an 8B model on the host takes minutes
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model = model.cuda().eval()
    variants = itertools.product(shapes, args.attention, args.compiled)
    for (batch, capacity), attention, compiled in variants:
        tier = capacity - 512
        n = tier * 3 // 4  # a prompt three quarters of its tier long
        engine = BatchedGreedy(
            model, batch, capacity, prompt_width=tier, attention=attention,
            compiled=compiled == "1",
        )  # fmt: skip
        spread = torch.linspace(n, capacity - 1, batch, device=engine.device).long()

        def step(e=engine, spread=spread):
            e.positions.copy_(spread)  # step() advances them: start each call from the spread
            e.step()

        started = time.perf_counter()
        step()  # compiles (when compiled) and captures
        first_s = time.perf_counter() - started
        step_s = timed(step, 50)
        eager = timed(lambda e=engine, p=spread: e._step(e.tokens, p), 20)
        row = {
            "batch": batch, "capacity": capacity, "attention": attention,
            "compiled": compiled == "1", "first_step_s": round(first_s, 2),
            "step_ms": round(step_s * 1e3, 3), "not_graphed_ms": round(eager * 1e3, 3),
            "tokens_per_s": round(batch / step_s),
            "weights_gb": round(decode_weight_bytes(model) / 1e9, 2),
            # each row's cache up to its position, keys and values of every layer
            "kv_gb": round(float(spread.add(1).sum()) * kv_bytes_per_token(model) / 1e9, 2),
        }  # fmt: skip
        row["roofline_ms"] = round((row["weights_gb"] + row["kv_gb"]) / 4.8, 3)
        row["of_roofline"] = round(row["roofline_ms"] / row["step_ms"], 3)
        if args.profile:
            row["profile"] = profile_step(lambda e=engine, p=spread: e._step(e.tokens, p))
        print(json.dumps(row), flush=True)
        if args.out:
            with args.out.open("a") as f:
                f.write(json.dumps(row) + "\n")
        if args.no_prefill:
            del engine, step  # the step's defaults hold the engine: both, or its caches stay
            gc.collect()
            torch.cuda.empty_cache()
            continue
        rows = list(range(engine.prefill_count([n] * batch)))  # packed (flex): as many as fit
        prompts = [list(range(n))] * len(rows)
        engine.prefill(rows, prompts)
        prefill = timed(lambda e=engine, r=rows, p=prompts: e.prefill(r, p), 20) / len(rows)
        del engine, step
        gc.collect()
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
