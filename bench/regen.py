"""Regeneration speed, before and after, in one command: transformers' `generate` on planned
batches (how regeneration ran before) and the static engine with rows refilled as they finish
(`BatchedGreedy`, CUDA graphs), on the same rows, with how many rows come out token-identical.

    python bench/regen.py --target results/target/hf --rows results/data/expanded/train.parquet \
        --limit 1024 --max-new-tokens 512 --dtype bfloat16 float32

New tokens/s counts generated tokens (stop tokens included) over the wall time of the pass,
model loading excluded; the static pass includes its CUDA graph captures. fp32 should agree on
(nearly) every row; bf16 rounds differently with batch shape, so near-tied argmaxes flip.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflash.data.continuous import regenerate_continuous  # noqa: E402
from dflash.data.expand import read_rows  # noqa: E402
from dflash.data.generation import Generator, plan_batches, regenerate_batch  # noqa: E402


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def hf_pass(gen, rows, batch_size, max_prompt):
    by_id = {r["id"]: r for r in rows}
    out, tokens = {}, 0
    started = time.perf_counter()
    for ids in plan_batches(rows, gen.tokenizer, batch_size, max_prompt):
        convs, n = regenerate_batch(gen, [by_id[i] for i in ids], max_prompt)
        out.update({c.row["id"]: c.result()["turn_token_ids"] for c in convs})
        tokens += n
    _sync()
    return out, tokens, time.perf_counter() - started


def static_pass(gen, rows, batch_size, max_prompt, attention="sdpa", overlap=True):
    by_id = {r["id"]: r for r in rows}
    order = [
        by_id[i] for ids in plan_batches(rows, gen.tokenizer, batch_size, max_prompt) for i in ids
    ]
    out, tiers = {}, []
    started = time.perf_counter()
    tokens = regenerate_continuous(
        gen,
        order,
        max_prompt,
        lambda c: out.__setitem__(c.row["id"], c.result()["turn_token_ids"]),
        batch_size,
        attention=attention,
        stats=tiers,
        overlap=overlap,
    )
    _sync()
    return out, tokens, time.perf_counter() - started, tiers


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", type=Path, required=True)
    parser.add_argument("--rows", type=Path, required=True, help="an expanded split (.parquet)")
    parser.add_argument("--limit", type=int, default=512)
    parser.add_argument("--max-new-tokens", type=int, default=512)
    parser.add_argument("--max-prompt", type=int, default=2048, help="data.max_length")
    parser.add_argument("--hf-batch-size", type=int, default=128, help="today's h200.yaml")
    parser.add_argument("--static-batch-size", type=int, nargs="+", default=[256])
    parser.add_argument("--attention", nargs="+", default=["sdpa"], choices=["sdpa", "flex"])
    parser.add_argument(
        "--overlap", nargs="+", default=["on"], choices=["on", "off"],
        help="the host's work on a step's tokens beside the next step (on) or after it (off)",
    )  # fmt: skip
    parser.add_argument("--skip-hf", action="store_true", help="only the static engine")
    parser.add_argument("--dtype", nargs="+", default=["bfloat16"])
    parser.add_argument("--device", default="auto")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()

    rows = read_rows(args.rows)[: args.limit]
    results = []
    for dtype in args.dtype:
        gen = Generator(args.target, dtype, args.device, args.max_new_tokens)
        result = {"dtype": dtype, "device": str(gen.device), "rows": len(rows), "static": []}
        if not args.skip_hf:
            hf, hf_tokens, hf_s = hf_pass(gen, rows, args.hf_batch_size, args.max_prompt)
            result["hf"] = {
                "batch": args.hf_batch_size,
                "tokens": hf_tokens,
                "seconds": round(hf_s, 1),
                "tokens_per_s": round(hf_tokens / hf_s),
            }
        passes = itertools.product(args.static_batch_size, args.attention, args.overlap)
        for batch, attention, overlap in passes:
            st, st_tokens, st_s, tiers = static_pass(
                gen, rows, batch, args.max_prompt, attention, overlap == "on"
            )
            entry = {
                "batch": batch,
                "attention": attention,
                "overlap": overlap,
                "tokens": st_tokens,
                "seconds": round(st_s, 1),
                "tokens_per_s": round(st_tokens / st_s),
                "tiers": tiers,
            }
            if not args.skip_hf:
                entry["speedup"] = round((st_tokens / st_s) / (hf_tokens / hf_s), 2)
                entry["identical_rows"] = sum(hf[i] == st[i] for i in hf)
            result["static"].append(entry)
        print(json.dumps(result), flush=True)
        results.append(result)
        del gen
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
