"""`dflash eval`: real speculative decoding of the exported drafter on the eval prompts.

Methods, all decoded by the same loop on the same prompts: `target` (no drafts: plain greedy, the
reference every other output must equal token for token, and the speed baseline), `lookup`
(prompt lookup, no model), `untrained` (the drafter as initialised before training) and `drafter`
(the trained one, loaded from its exported HF directory, as a serving engine would). Teacher-forced
τ of the same drafter on the held-out tokenized rows is reported next to the real τ: a large gap
means training and inference disagree.
"""

from __future__ import annotations

import logging
import statistics
from pathlib import Path

import polars as pl
import torch

from dflash.errors import UserError
from dflash.eval.decode import DrafterProposer, Generation, Proposer, TargetSession, generate
from dflash.eval.lookup import prompt_lookup_draft
from dflash.eval.metrics import acceptance
from dflash.eval.sets import EvalPrompt, load_eval_set
from dflash.io import sha256_file, write_json
from dflash.manifest import write_manifest
from dflash.model.drafter import Drafter, load_drafter
from dflash.model.objective import default_gamma, dflash_loss
from dflash.model.step import resolve_device
from dflash.model.target import load_target

log = logging.getLogger(__name__)


class LookupProposer(Proposer):
    def __init__(self, block_size: int):
        self.block_size = block_size

    def propose(self, committed, features):
        return prompt_lookup_draft(committed, self.block_size - 1)


def eos_ids(target_dir: Path, tokenizer) -> set[int]:
    from transformers import GenerationConfig

    ids = {tokenizer.eos_token_id}
    try:
        eos = GenerationConfig.from_pretrained(target_dir).eos_token_id
        ids |= set(eos if isinstance(eos, list) else [eos])
    except OSError:
        pass
    return {i for i in ids if i is not None}


def encode(tokenizer, prompt: EvalPrompt) -> list[int]:
    text = tokenizer.apply_chat_template(
        prompt.messages, add_generation_prompt=True, tokenize=False
    )
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def eval_prompts(config: dict, held_out: Path) -> list[EvalPrompt]:
    prompts = []
    for i, spec in enumerate(config["eval"]["sets"]):
        spec = dict(spec)
        if spec["format"] == "held_out" and not spec.get("path"):
            spec["path"] = str(held_out)
        spec.setdefault("max_prompts", config["eval"]["max_prompts"])
        prompts += load_eval_set(spec, key=f"eval.sets[{i}]")
    return prompts


def summarize(prompts, gens: list[Generation], block_size: int, reference) -> dict:
    """Metrics overall and per eval set; `reference`: target-only generations (lossless)."""

    def block(idx):
        seconds = sum(gens[i].seconds for i in idx)
        tokens = sum(len(gens[i].tokens) for i in idx)
        out = acceptance([gens[i].accepted for i in idx], block_size)
        out["tokens"] = tokens
        out["tokens_per_s"] = round(tokens / seconds, 2) if seconds else None
        out["lossless"] = round(
            statistics.fmean(gens[i].tokens == reference[i].tokens for i in idx), 4
        )
        return out

    names = sorted({p.set_name for p in prompts})
    return {
        "overall": block(range(len(prompts))),
        "sets": {n: block([i for i, p in enumerate(prompts) if p.set_name == n]) for n in names},
    }


@torch.no_grad()
def teacher_forced_tau(drafter, session: TargetSession, rows: pl.DataFrame, config) -> float:
    """τ of the training objective (block accuracy under teacher forcing) on held-out rows."""
    d = config["drafter"]
    gamma = d["gamma"] or default_gamma(drafter.config.block_size)
    embed, head = session.model.get_input_embeddings(), session.model.lm_head.weight
    taus, weights = [], []
    for i, (ids, mask) in enumerate(zip(rows["input_ids"], rows["loss_mask"], strict=True)):
        session.reset()
        _, features = session.forward(list(ids))
        ids_t = torch.tensor([ids], device=head.device)
        mask_t = torch.tensor([mask], device=head.device)
        gen = torch.Generator().manual_seed(config["seed"] * 7919 + i)
        _, m = dflash_loss(
            drafter, embed, head, features[None], ids_t, mask_t, gen, d["max_anchors"], gamma
        )
        if m["blocks"]:
            taus.append(m["tau"])
            weights.append(m["blocks"])
    return round(sum(t * w for t, w in zip(taus, weights, strict=True)) / sum(weights), 4)


class Setup:
    """What every eval command loads: the target with a KV cache, the drafter, the prompts."""

    def __init__(self, args):
        from transformers import AutoTokenizer

        config = self.config = args.config
        device = resolve_device(config["eval"]["device"])
        target = load_target(args.target, dtype=torch.float32, device=device)
        tokenizer = AutoTokenizer.from_pretrained(args.target)
        self.drafter = load_drafter(args.drafter, dtype=torch.float32, device=device).eval()
        self.session = TargetSession(target, self.drafter.config.target_layer_ids)
        self.embed, self.head = target.get_input_embeddings(), target.lm_head.weight
        self.block_size = self.drafter.config.block_size
        self.stop = eos_ids(args.target, tokenizer)
        self.prompts = eval_prompts(config, args.held_out)
        self.encoded = [encode(tokenizer, p) for p in self.prompts]
        self.max_new = config["eval"]["max_new_tokens"]
        self.sha = {
            "drafter_sha256": sha256_file(Path(args.drafter) / "model.safetensors"),
            "target_sha256": sha256_file(Path(args.target) / "model.safetensors"),
        }

    def decode(self, name: str, proposer: Proposer) -> list[Generation]:
        gens = [
            generate(self.session, proposer, ids, self.max_new, self.stop) for ids in self.encoded
        ]
        _log(name, gens)
        return gens


def _log(name: str, gens: list[Generation]) -> None:
    tokens, seconds = sum(len(g.tokens) for g in gens), sum(g.seconds for g in gens)
    log.info("%s: %d tokens in %.1f s (%.1f tokens/s)", name, tokens, seconds, tokens / seconds)


def _check_lossless(setup: Setup, gens: dict, record: dict, output: Path) -> None:
    failed = output.with_suffix(".failed.json")
    if record["lossless"] >= 1.0:
        failed.unlink(missing_ok=True)  # an earlier failure's evidence, now stale
        return
    reference = gens["target"]
    bad = {
        name: [setup.prompts[i].id for i, g in enumerate(gs) if g.tokens != reference[i].tokens]
        for name, gs in gens.items()
    }
    write_json(failed, record | {"mismatches": bad})
    raise UserError(f"speculative output differs from the target's greedy output: {bad}")


def _manifest(args) -> None:
    if args.manifest:
        inputs = {"drafter": args.drafter, "held_out": args.held_out}
        if getattr(args, "tokenized", None):
            inputs["tokenized"] = args.tokenized
        write_manifest(
            args.manifest,
            args.command,
            inputs,
            {"output": args.output},
            params=args.config,
            code=(__name__,),
        )


def run(args) -> None:
    """results/eval/acceptance.json: the trained drafter, its baselines, teacher-forced τ."""
    setup = Setup(args)
    config = setup.config
    torch.manual_seed(config["seed"])  # the same initialisation training started from
    untrained = Drafter(setup.drafter.config).to(setup.head.device).eval()
    methods = {
        "target": Proposer(),
        "lookup": LookupProposer(setup.block_size),
        "untrained": DrafterProposer(untrained, setup.embed, setup.head),
        "drafter": DrafterProposer(setup.drafter, setup.embed, setup.head),
    }
    gens = {name: setup.decode(name, proposer) for name, proposer in methods.items()}
    results = {
        name: summarize(setup.prompts, gens[name], setup.block_size, gens["target"])
        for name in methods
    }
    base = results["target"]["overall"]["tokens_per_s"]
    for r in results.values():
        r["overall"]["speedup"] = round(r["overall"]["tokens_per_s"] / base, 3)
    rows = pl.read_parquet(args.tokenized).head(config["eval"]["max_prompts"])
    tf = teacher_forced_tau(setup.drafter, setup.session, rows, config)
    headline = results["drafter"]["overall"]
    record = {
        "block_size": setup.block_size,
        "max_new_tokens": setup.max_new,
        **headline,
        "sets": results["drafter"]["sets"],
        "teacher_forced_tau": tf,
        "teacher_forced_gap": round(tf - headline["tau_pooled"], 4),
        "baselines": {k: v["overall"] for k, v in results.items() if k != "drafter"},
        **setup.sha,
        "lossless": min(r["overall"]["lossless"] for r in results.values()),
    }
    _check_lossless(setup, gens, record, Path(args.output))
    write_json(args.output, record)
    _manifest(args)
    log.info(
        "tau %.3f (macro %.3f), teacher-forced %.3f, speedup %.2fx, lossless %.2f",
        record["tau_pooled"],
        record["tau_macro"],
        tf,
        record["speedup"],
        record["lossless"],
    )


def run_ddtree(args) -> None:
    """results/eval/ddtree.json: τ and speedup of tree drafting by node budget (and the chain)."""
    from dflash.eval.decode import generate_tree

    setup = Setup(args)
    tree_cfg = setup.config["eval"]["ddtree"]
    proposer = DrafterProposer(setup.drafter, setup.embed, setup.head)
    gens = {"target": setup.decode("target", Proposer()), "chain": setup.decode("chain", proposer)}
    for budget in tree_cfg["budgets"]:
        name = f"tree-{budget}"
        gens[name] = [
            generate_tree(
                setup.session, proposer, ids, setup.max_new, setup.stop, budget, tree_cfg["topk"]
            )
            for ids in setup.encoded
        ]
        _log(name, gens[name])
    base = summarize(setup.prompts, gens["target"], setup.block_size, gens["target"])
    rows = []
    for name, gs in gens.items():
        if name == "target":
            continue
        overall = summarize(setup.prompts, gs, setup.block_size, gens["target"])["overall"]
        rows.append(
            {
                "method": name,
                "budget": int(name.split("-")[1])
                if name.startswith("tree")
                else setup.block_size - 1,
                "tau_pooled": overall["tau_pooled"],
                "tau_macro": overall["tau_macro"],
                "tokens_per_s": overall["tokens_per_s"],
                "speedup": round(overall["tokens_per_s"] / base["overall"]["tokens_per_s"], 3),
                "lossless": overall["lossless"],
            }
        )
    record = {
        "block_size": setup.block_size,
        "topk": tree_cfg["topk"],
        "n_prompts": len(setup.prompts),
        "max_new_tokens": setup.max_new,
        "target_tokens_per_s": base["overall"]["tokens_per_s"],
        "results": rows,
        **setup.sha,
        "lossless": min(r["lossless"] for r in rows),
    }
    _check_lossless(setup, gens, record, Path(args.output))
    write_json(args.output, record)
    _manifest(args)
    for r in rows:
        log.info("%s", r)
