"""Batch-size-1 decoding speed, before and after, in one command: each target session x method on
the same prompts, with τ and the lossless check.

Sessions: `hf` (transformers' DynamicCache, eager: how the eval decoded before static caches) and
`static` (preallocated caches, fixed-shape steps replayed as CUDA graphs on GPU: how it decodes
now). Methods: `target` (no drafts), `lookup` (prompt lookup), `drafter`, `chain` (the drafter's chain
verified as a tree, as the DDTree stage does) and `tree-N` (DDTree of N nodes). Every method's output
must equal the same session's target-only output, and both sessions' target-only outputs must
agree. tokens/s counts the tokens after the prompt's forward over the time after it, as the
eval and the public DFlash benchmark do; the first prompt of each pair is decoded once untimed
(CUDA graph capture, allocator warm-up).

    # a finished run: its target, trained drafter and eval prompts (held-out, MT-Bench, ...)
    python bench/decode.py --target results/target/hf --drafter results/drafter \
        --config config/h200.yaml --held-out results/data/expanded/eval.parquet --prompts 16
    # no run needed: random-init target of a shape, random drafter, random prompts
    python bench/decode.py --target-config config/models/smollm2-135m --prompts 8
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflash.eval.decode import DrafterProposer, Proposer, generate, generate_tree  # noqa: E402
from dflash.eval.metrics import acceptance  # noqa: E402
from dflash.eval.sessions import HFSession, StaticSession  # noqa: E402
from dflash.eval.setup import LookupProposer, encode, eos_ids, eval_prompts  # noqa: E402
from dflash.model.decoder import supports_static  # noqa: E402
from dflash.model.drafter import Drafter, DrafterConfig, load_drafter  # noqa: E402

SESSIONS = {"hf": HFSession, "static": StaticSession}


def real_setup(args, device):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dflash.config import load_config

    config = load_config(args.config)
    dtype = getattr(torch, args.dtype)
    model = AutoModelForCausalLM.from_pretrained(args.target, dtype=dtype).to(device)
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    drafter = load_drafter(args.drafter, dtype=dtype, device=device).eval()
    prompts = eval_prompts(config, args.held_out)
    # Spread the prompts over the sets (held-out first, then MT-Bench, ...).
    by_set: dict[str, list] = {}
    for p in prompts:
        by_set.setdefault(p.set_name, []).append(p)
    picked = [p for ps in zip(*by_set.values(), strict=False) for p in ps][: args.prompts]
    encoded = [encode(tokenizer, p) for p in picked]
    return model.eval(), drafter, encoded, eos_ids(args.target, tokenizer)


def random_setup(args, device):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(args.target_config)
    with torch.device(device):
        dtype = getattr(torch, args.dtype)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
        drafter = Drafter(DrafterConfig.for_target(config, args.drafter_layers, 16, 3))
        drafter = drafter.to(dtype).eval()
    g = torch.Generator().manual_seed(0)
    encoded = [
        torch.randint(4, config.vocab_size, (args.prompt_tokens,), generator=g).tolist()
        for _ in range(args.prompts)
    ]
    return model, drafter, encoded, set()  # no stop token: every prompt decodes max_new_tokens


def decoder(method: str, proposers: dict):
    """`generate` with the method's proposer, or DDTree's `generate_tree` for `tree-BUDGET`."""
    if method == "chain":  # the drafter's chain verified as a tree, as the DDTree stage does
        drafter = proposers["drafter"]
        return lambda session, ids, n, stop: generate_tree(session, drafter, ids, n, stop, None)
    if method.startswith("tree-"):
        budget = int(method.removeprefix("tree-"))
        drafter = proposers["drafter"]
        return lambda session, ids, n, stop: generate_tree(session, drafter, ids, n, stop, budget)
    proposer = proposers[method]
    return lambda session, ids, n, stop: generate(session, proposer, ids, n, stop)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--target", type=Path, help="target HF directory (with --drafter)")
    parser.add_argument("--drafter", type=Path, help="exported drafter directory")
    parser.add_argument("--config", type=Path, help="run config (its eval.sets give the prompts)")
    parser.add_argument("--held-out", type=Path, help="expand's eval split")
    parser.add_argument("--target-config", type=Path, help="random-init target of this config")
    parser.add_argument("--drafter-layers", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--sessions", default="hf,static")
    parser.add_argument("--methods", default="target,lookup,drafter")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    parser.add_argument(
        "--dtype", default="float32", choices=["float32", "bfloat16"],
        help="bfloat16 for the speed of real shapes (fp32: the outputs to compare)",
    )  # fmt: skip
    parser.add_argument("--prompt-tokens", type=int, default=64, help="random prompts' length")
    parser.add_argument(
        "--no-warmup", action="store_true",
        help="time every prompt from a cold start, as the eval stages do (the clock leaves out "
        "CUDA graph captures and compiles: graph_setup_s)",
    )  # fmt: skip
    parser.add_argument(
        "--capacity", type=int, default=0,
        help="grow the static caches to this many rows first (as a long prompt earlier in an "
        "eval stage leaves them): whether a round's cost follows the capacity, not the length",
    )  # fmt: skip
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model, drafter, encoded, stop = (random_setup if args.target_config else real_setup)(
        args, device
    )
    embed, head = model.get_input_embeddings(), model.lm_head.weight
    proposers = {
        "target": Proposer(),
        "lookup": LookupProposer(drafter.config.block_size),
        "drafter": DrafterProposer(drafter, embed, head),
    }
    results, outputs = [], {}
    for name in args.sessions.split(","):
        if name == "static" and not supports_static(model):
            print(f"skipping static: {model.config.model_type} has no static decoder")
            continue
        session = SESSIONS[name](model, drafter.config.target_layer_ids)
        if args.capacity:
            session.reset(args.capacity)
            proposers["drafter"].start([], None, args.capacity)
        for method in args.methods.split(","):
            decode = decoder(method, proposers)
            if not args.no_warmup:
                decode(session, encoded[0], args.max_new_tokens, stop)  # untimed
            started = time.perf_counter()
            gens = [decode(session, ids, args.max_new_tokens, stop) for ids in encoded]
            wall = time.perf_counter() - started
            outputs[name, method] = [g.tokens for g in gens]
            decoded = sum(sum(g.accepted) for g in gens)
            seconds = sum(g.seconds for g in gens)
            m = acceptance([g.accepted for g in gens], drafter.config.block_size)
            row = {
                "session": name,
                "method": method,
                "capacity": getattr(getattr(session, "engine", None), "capacity", None),
                "prompts": len(gens),
                "tokens": decoded,
                "seconds": round(seconds, 3),
                "wall_s": round(wall, 3),
                "tokens_per_s": round(decoded / seconds, 1),
                "graph_setup_s": round(sum(g.setup_s for g in gens), 3),
                # the clock before captures were left out of it
                "tokens_per_s_setup_in": round(
                    decoded / (seconds + sum(g.setup_s for g in gens)), 1
                ),
                "ms_per_forward": round(1000 * seconds / m["rounds"], 3),
                "tau_macro": m["tau_macro"],
                "tau_pooled": m["tau_pooled"],
                "lossless": outputs[name, method] == outputs[name, "target"],
            }
            results.append(row)
            print(json.dumps(row), flush=True)
    sessions = [s for s in args.sessions.split(",") if (s, "target") in outputs]
    agree = len({json.dumps(outputs[s, "target"]) for s in sessions}) == 1
    speed = {(r["session"], r["method"]): r["tokens_per_s"] for r in results}
    summary = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "max_new_tokens": args.max_new_tokens,
        "sessions_agree": agree,
        "speedup_static_over_hf": {
            m: round(speed["static", m] / speed["hf", m], 2)
            for m in args.methods.split(",")
            if ("static", m) in speed and ("hf", m) in speed
        },
        "results": results,
    }
    print(json.dumps({k: v for k, v in summary.items() if k != "results"}))
    if args.out:
        args.out.write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
