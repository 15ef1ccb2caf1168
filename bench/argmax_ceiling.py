"""What argmax drafts can reach at a temperature on a target, before any drafter is trained
(issue 55): per eval set, the target's own answers sampled at each temperature, then the
expected τ of a drafter that always drafts the target's argmax (`argmax_ceiling`, as
eval_sampling reports it beside the trained drafter) and the target's mean largest probability
at the answers' drafted positions. First turns only (eval_prompts gives no later MT-Bench turn:
those follow the target's own answer). The ceiling is an estimate, a few per cent low
(`argmax_ceiling`'s docstring).

    python bench/argmax_ceiling.py --target results/target/hf \
        --config config/h200.yaml config/h200-domains.yaml --held-out results/data/expanded/eval.parquet \
        --sampling 1.0:1.0 0.7:0.95 --max-prompts 12 --max-new-tokens 128 --json out.json

Held-out sets need `--held-out` (an expanded eval split); without it they are skipped. Answers
are drawn by transformers' `generate` (temperature, then top-k, then top-p, as the evaluation
warps), a batch of prompts at a time, seeded; the ceiling reads each answer alone.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflash.config import validate  # noqa: E402
from dflash.eval.setup import encode, eval_prompts  # noqa: E402
from dflash.model.sampling import Sampling, probabilities  # noqa: E402
from dflash.model.target import eos_ids  # noqa: E402
from dflash.model.tau_sim_sampled import argmax_ceiling  # noqa: E402


def merged_config(paths: list[Path]) -> dict:
    """The config files merged as Snakemake merges --configfile (later over earlier, lists
    replaced whole), with the defaults filled and checked as a run's are."""
    import yaml
    from snakemake.utils import update_config

    config: dict = {}
    for path in paths:
        update_config(config, yaml.safe_load(path.read_text()) or {})
    return validate(config, paths)


@torch.no_grad()
def sampled_answers(model, tokenizer, stop, prompts: list[list[int]], s: Sampling, new, batch):
    """The target's answers to `prompts` (ids), sampled at `s`, left-padded batches, each cut
    after its first stop token (`stop`: the target's end-of-sequence ids)."""
    device = model.device
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    out = []
    for lo in range(0, len(prompts), batch):
        group = prompts[lo : lo + batch]
        width = max(len(p) for p in group)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in group], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group], device=device)
        gen = model.generate(
            input_ids=ids, attention_mask=mask, do_sample=True, temperature=s.temperature,
            top_p=s.top_p, top_k=s.top_k or 0, max_new_tokens=new, pad_token_id=pad,
        )  # fmt: skip
        for row in gen[:, width:].tolist():
            stops = [i for i, t in enumerate(row) if t in stop]
            out.append(row[: stops[0] + 1] if stops else row)
    return out


@torch.no_grad()
def ceiling_of(model, prompt: list[int], answer: list[int], s: Sampling, block: int):
    """(argmax ceiling, mean largest probability) along one answer."""
    ids = prompt + answer
    first, last = len(prompt), len(ids) - 1
    if last <= first:
        return None, None
    out = model(
        input_ids=torch.tensor([ids], device=model.device),
        logits_to_keep=len(ids) - first,
        use_cache=False,
    )
    # best[j]: the target's largest chance for the token at j + 1, for the drafted positions
    top = probabilities(out.logits[0, : last - first].float(), s).max(-1).values.tolist()
    return argmax_ceiling([0.0] * first + top, first, last, block), statistics.fmean(top)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", type=Path, required=True, help="a converted target (hf folder)")
    p.add_argument("--config", type=Path, nargs="+", default=[Path("config/h200.yaml")])
    p.add_argument("--held-out", type=Path, help="an expanded eval split, for held_out sets")
    p.add_argument("--sampling", nargs="+", default=["1.0:1.0", "0.7:0.95"], help="T:top_p")
    p.add_argument("--max-prompts", type=int, default=12)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--batch", type=int, default=12)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path)
    args = p.parse_args()

    config = merged_config(args.config)
    if args.held_out is None:
        config["eval"]["sets"] = [s for s in config["eval"]["sets"] if s["format"] != "held_out"]
    prompts = eval_prompts(config, args.held_out, args.max_prompts)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    model = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).to(device).eval()
    encoded = [encode(tokenizer, q, config["data"]["chat_template_kwargs"]) for q in prompts]
    block = config["drafter"]["block_size"]
    stop = eos_ids(args.target, tokenizer)
    results = []
    for spec in args.sampling:
        temperature, top_p = (float(x) for x in spec.split(":"))
        s = Sampling(temperature, top_p)
        torch.manual_seed(args.seed)
        started = time.perf_counter()
        answers = sampled_answers(
            model, tokenizer, stop, encoded, s, args.max_new_tokens, args.batch
        )
        by_set: dict[str, list[tuple[float, float]]] = {}
        for q, ids, answer in zip(prompts, encoded, answers, strict=True):
            tau, mean_best = ceiling_of(model, ids, answer, s, block)
            if tau is not None:
                by_set.setdefault(q.set_name, []).append((tau, mean_best))
        row = {"sampling": s.label, "seconds": round(time.perf_counter() - started, 1), "sets": {}}
        for name, pairs in by_set.items():
            row["sets"][name] = {
                "prompts": len(pairs),
                "argmax_ceiling": round(statistics.fmean(t for t, _ in pairs), 3),
                "mean_largest_probability": round(statistics.fmean(b for _, b in pairs), 3),
            }
        everything = [pair for pairs in by_set.values() for pair in pairs]
        row["argmax_ceiling_macro"] = round(statistics.fmean(t for t, _ in everything), 3)
        results.append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        args.json.write_text(json.dumps({"target": str(args.target), "runs": results}, indent=1))


if __name__ == "__main__":
    main()
