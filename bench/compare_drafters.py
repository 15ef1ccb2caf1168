"""Several drafters against one target on identical prompts, prompt by prompt: the A/B of two
trainings without a GPU (fp32 on the CPU is exact, so every method must decode the target's own
text). Each prompt is decoded by the target alone (the reference), prompt lookup and each
drafter, through one session, as `dflash eval` decodes; MT-Bench's second turns are asked after
the target's own first answer. τ per set (MT-Bench by turn), paired differences against the first
drafter, and the raw per-prompt record.

    python bench/compare_drafters.py --config run.yaml --target results/target/hf \
        --held-out results/data/expanded/eval.parquet --per-set 7 --out ab.json \
        --drafter before=drafters/run-1 --drafter after=results/drafter

`run.yaml`: the run's config files merged, with `eval: {device: cpu, dtype: float32}` for the
CPU. 2026-12-05 its predecessor (the same library calls) decoded three drafters on 7 prompts of
each of the recipe's sets in 48 minutes on 2 cores (BENCHMARKS.md, "γ 14 and drafter.init").
In bf16 it refuses to run: outputs part from the target's at near ties, and the pairs would
compare different texts.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflash.config import load_config  # noqa: E402
from dflash.eval.decode import DrafterProposer, Proposer, generate  # noqa: E402
from dflash.eval.sessions import target_session  # noqa: E402
from dflash.eval.setup import LookupProposer, encode, eos_ids, eval_prompts  # noqa: E402
from dflash.model.drafter import load_drafter  # noqa: E402
from dflash.model.precision import resolve_dtype  # noqa: E402
from dflash.model.step import resolve_device  # noqa: E402
from dflash.model.target import load_target  # noqa: E402


def group(row: dict) -> str:
    if row["set"] == "mt_bench":
        return "mt_bench second turns" if "#turn" in row["id"] else "mt_bench first turns"
    return row["set"]


def table(rows: list[dict], methods: list[str]) -> str:
    """τ macro by set, and each drafter's paired difference from the first (mean ± s.e., each
    prompt counted alone: a question's two MT-Bench turns are not independent). Prompts that
    some method ended without a round (an answer of one token) are left out, as the eval does."""
    rows = [r for r in rows if all(m["tau"] is not None for m in r["methods"].values())]
    groups = {}
    for row in rows:
        groups.setdefault(group(row), []).append(row)
    groups["all"] = rows
    first, others = methods[0], [m for m in methods[1:] if m not in ("target", "lookup")]
    lines = ["| set | n | " + " | ".join(methods) + " |", "|---|---|" + "---|" * len(methods)]
    for name, rs in groups.items():
        cells = [f"{statistics.fmean(r['methods'][m]['tau'] for r in rs):.3f}" for m in methods]
        lines.append(f"| {name} | {len(rs)} | " + " | ".join(cells) + " |")
    for m in others:
        diffs = [r["methods"][m]["tau"] - r["methods"][first]["tau"] for r in rows]
        se = statistics.stdev(diffs) / len(diffs) ** 0.5 if len(diffs) > 1 else float("nan")
        wins = sum(d > 0 for d in diffs)
        lines.append(
            f"\n{m} - {first}: {statistics.fmean(diffs):+.3f} ± {se:.3f} per prompt "
            f"({wins} better, {sum(d == 0 for d in diffs)} equal, of {len(diffs)})"
        )
    return "\n".join(lines)


def dump(record: dict) -> str:
    """JSON with one prompt a line: small enough to keep in bench/results, still diffable."""
    head = {key: value for key, value in record.items() if key != "prompts"}
    rows = ",\n".join(json.dumps(row, separators=(",", ":")) for row in record["prompts"])
    return json.dumps(head, indent=1)[:-2] + ',\n "prompts": [\n' + rows + "\n ]\n}\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", type=Path, required=True, help="the run's merged config")
    p.add_argument("--target", type=Path, required=True, help="target HF directory")
    p.add_argument("--held-out", type=Path, required=True, help="expand's eval split")
    p.add_argument("--drafter", action="append", required=True, help="NAME=DIR, twice or more")
    p.add_argument("--per-set", type=int, required=True, help="the first K prompts of each set")
    p.add_argument("--sets", help="comma list of sets (default: every set of the config)")
    p.add_argument("--out", type=Path, required=True, help="per-prompt record (JSON)")
    args = p.parse_args()

    specs = [spec.partition("=") for spec in args.drafter]
    names = [name for name, _, _ in specs]
    if any(not sep for _, sep, _ in specs) or len(specs) < 2:
        sys.exit("--drafter NAME=DIR, given twice or more")
    if len(set(names)) < len(names) or {"target", "lookup"} & set(names):
        sys.exit(f"drafter names must differ from each other and from target, lookup: {names}")
    paths = {name: path for name, _, path in specs}
    config = load_config(args.config)
    device = resolve_device(config["eval"]["device"])
    dtype = resolve_dtype(config["eval"]["dtype"], device)
    if dtype != torch.float32:
        # in bf16 most outputs part from the target's own at near ties, and then the drafters
        # are compared on different texts
        sys.exit(f"eval.dtype resolves to {dtype}: set eval: {{dtype: float32}} for a paired A/B")
    max_new = config["eval"]["max_new_tokens"]
    model = load_target(args.target, dtype=dtype, device=device)
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    stop = eos_ids(args.target, tokenizer)
    drafters = {
        name: load_drafter(path, dtype=dtype, device=device).eval() for name, path in paths.items()
    }
    shapes = {(tuple(d.config.target_layer_ids), d.config.block_size) for d in drafters.values()}
    if len(shapes) != 1:
        sys.exit(f"the drafters read different target layers or block sizes: {sorted(shapes)}")
    ((layer_ids, block),) = shapes
    session = target_session(model, list(layer_ids))
    embed, head = model.get_input_embeddings(), model.lm_head.weight
    methods = {"target": Proposer(), "lookup": LookupProposer(block)}
    methods |= {name: DrafterProposer(d, embed, head) for name, d in drafters.items()}

    by_set: dict[str, list] = {}
    for prompt in eval_prompts(config, args.held_out):
        by_set.setdefault(prompt.set_name, []).append(prompt)
    wanted = args.sets.split(",") if args.sets else list(by_set)
    if unknown := set(wanted) - set(by_set):
        sys.exit(f"--sets: {sorted(unknown)} not among the config's sets {sorted(by_set)}")
    pending = [prompt for s in wanted for prompt in by_set[s][: args.per_set]]
    record = {
        "device": str(device),
        "dtype": str(dtype),
        "torch": torch.__version__,
        "max_new_tokens": max_new,
        "drafters": paths,
        "prompts": [],
    }
    t0 = time.perf_counter()
    with torch.inference_mode():
        while pending:
            prompt = pending.pop(0)
            ids = encode(tokenizer, prompt)
            row = {"set": prompt.set_name, "id": prompt.id, "methods": {}}
            reference = None
            for name, proposer in methods.items():
                out = generate(session, proposer, ids, max_new, stop)
                if reference is None:
                    reference = out
                row["methods"][name] = {
                    "tau": round(statistics.fmean(out.accepted), 4) if out.accepted else None,
                    "accepted": out.accepted,
                    "lossless": out.tokens == reference.tokens,
                }
            record["prompts"].append(row)
            taus = " ".join(f"{n}={m['tau']}" for n, m in row["methods"].items() if n != "target")
            print(f"{time.perf_counter() - t0:7.0f} s {prompt.id[:32]:32s} {taus}", flush=True)
            if prompt.followups:  # the second turn, after the target's own first answer
                answer = tokenizer.decode(reference.tokens, skip_special_tokens=True)
                pending.insert(0, prompt.followup(answer))
    record["wall_s"] = round(time.perf_counter() - t0, 1)
    args.out.write_text(dump(record))
    rows = record["prompts"]
    broken = [(r["id"], n) for r in rows for n, m in r["methods"].items() if not m["lossless"]]
    print(table(rows, [*drafters, "lookup"]))
    if broken:
        sys.exit(f"outputs differ from the target's own: {broken}")


if __name__ == "__main__":
    main()
