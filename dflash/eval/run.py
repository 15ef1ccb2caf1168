"""`dflash eval`: real speculative decoding of the exported drafter on the eval prompts.

Methods, all decoded by the same loop on the same prompts: `target` (no drafts: plain greedy, the
reference every other output must equal token for token, and the speed baseline), the baselines
of `eval.baselines`: `lookup` (prompt lookup, no model) and `untrained` (the drafter as
initialised before training), `drafter` (the trained one, loaded from its exported HF
directory, as a serving engine would) and, with `eval.with_lookup`, `drafter+lookup`: each round
verifies the drafter's block and prompt lookup's continuation as two branches of one tree and
accepts the longer, as engines that mix n-gram and model drafts do (lossless like the rest; it
costs up to B-1 more verified tokens per round). Prompts with
later turns (MT-Bench) are asked again after the target's own answer, as the public DFlash
benchmark does. The headline τ is `tau_macro` (the mean over prompts of each prompt's mean
acceptance, what the public DFlash benchmark reports); `tau_pooled` stays beside it.

Two predictions from held-out rows are reported next to the real τ: `tau_sim` (the decoding walk
read off one teacher-forced pass, `dflash.model.tau_sim`, on each row's first answer; training
logs the same number as `tau_sim_first`), with its gap
to the real held-out τ and how many held-out rows' regenerated responses differ from the eval's
own greedy continuation (the one way the two can disagree besides numerics); and the older
`teacher_forced_tau` (acceptance averaged over random anchors, which overstates real τ).

`eval.dtype` float32 (the default) is the exact judge: greedy outputs of the speculative loop
(verifying 16 tokens at a time) and of plain decoding (one at a time) must agree token for token.
In bf16, as a serving engine decodes (and far faster on a GPU), the two shapes' different rounding
flips near-tied argmaxes; a difference is then judged at its first token (`dflash.eval.lossless`)
and a near tie is reported, not taken for a lossy loop. `reference_sha256` fingerprints the
target's own greedy tokens: two evaluations with equal ones judged their drafters on the same
text (on one H200 two bf16 processes once decoded different text, 4,489 and 4,433 tokens on the
same held-out prompts, which moved lookup's MT-Bench τ from 3.81 to 3.48).
"""

from __future__ import annotations

import hashlib
import json
import logging
import statistics
from pathlib import Path

import polars as pl
import torch

from dflash.errors import UserError
from dflash.eval.decode import GREEDY, DrafterProposer, Generation
from dflash.eval.lossless import beyond, divergence, judge, recheck_in_float32
from dflash.eval.metrics import acceptance, text_digest
from dflash.eval.overlap import found_in_training
from dflash.eval.predicted import simulated, teacher_forced_tau
from dflash.eval.setup import LookupProposer, Setup
from dflash.io import write_json
from dflash.model.drafter import Drafter
from dflash.model.memory import peak_memory_gb

log = logging.getLogger(__name__)

# The drafter's chain and prompt lookup's continuation verified together as two branches of one
# tree: the round accepts the longer (`generate_tree`, `eval.with_lookup`).
WITH_LOOKUP = "drafter+lookup"


def chain_methods(setup: Setup, rule, untrained: bool = True) -> dict:
    """eval_acceptance's methods decoding under `rule`: the baselines, the drafter, and the
    drafter beside prompt lookup (`untrained=False`: without the untrained drafter)."""
    config = setup.config
    methods = {}
    if "lookup" in config["eval"]["baselines"]:
        methods["lookup"] = setup.chain(LookupProposer(setup.block_size), rule)
    if untrained and "untrained" in config["eval"]["baselines"]:
        torch.manual_seed(config["seed"])  # the same initialisation training started from
        model = Drafter(setup.drafter.config).to(setup.head.device).eval()
        methods["untrained"] = setup.chain(DrafterProposer(model, setup.embed, setup.head), rule)
    methods["drafter"] = setup.chain(setup.proposer, rule)
    if config["eval"]["with_lookup"]:
        methods[WITH_LOOKUP] = setup.tree(setup.proposer, None, 1, True, rule)
    return methods


def tree_variants(tree_cfg: dict) -> list[tuple[str, int, bool]]:
    """(name, node budget, with the lookup branch) of each DDTree method."""
    variants = [(f"tree-{b}", b, False) for b in tree_cfg["budgets"]]
    if tree_cfg["with_lookup"]:
        variants += [(f"{name}+lookup", b, True) for name, b, _ in variants]
    return variants


def tree_methods(setup: Setup, rule) -> dict:
    """eval_ddtree's methods decoding under `rule`: the chain and every tree variant."""
    tree_cfg = setup.config["eval"]["ddtree"]
    methods = {"chain": setup.chain(setup.proposer, rule)}
    return methods | {
        name: setup.tree(setup.proposer, budget, tree_cfg["topk"], lookup, rule)
        for name, budget, lookup in tree_variants(tree_cfg)
    }


def per_prompt(prompts, gens: dict[str, list[Generation]], stop: set[int]) -> dict:
    """Each method's τ per prompt and whether it decoded the target's own text (`same`): in bf16
    methods that part from it at near ties are judged on different text, and a macro τ over few
    prompts can turn on one that loops; this says which prompts a method wins, and on what.
    `text`: each output's digest (another engine's output is compared with it); `seconds`: its
    decoding clock, so a stage's rate can be taken apart prompt by prompt."""
    reference = gens["target"]
    return {
        "ids": [p.id for p in prompts],
        "sets": [p.set_name for p in prompts],
        "target": {
            "text": [text_digest(g.tokens, stop) for g in reference],
            "seconds": [round(g.seconds, 4) for g in reference],
        },
        "methods": {
            name: {
                "tau": [round(statistics.fmean(g.accepted), 3) if g.accepted else None for g in gs],
                "tokens": [len(g.tokens) for g in gs],
                "same": [g.tokens == r.tokens for g, r in zip(gs, reference, strict=True)],
                "text": [text_digest(g.tokens, stop) for g in gs],
                "seconds": [round(g.seconds, 4) for g in gs],
            }
            for name, gs in gens.items()
            if name != "target"
        },
    }


def summarize(prompts, gens: list[Generation], block_size: int, reference=None) -> dict:
    """Metrics overall and per eval set; `reference`: target-only generations (lossless; None
    at a temperature, where outputs cannot be compared token for token)."""

    def block(idx):
        seconds = sum(gens[i].seconds for i in idx)
        decoded = sum(sum(gens[i].accepted) for i in idx)  # tokens after the prompt's forward
        out = acceptance([gens[i].accepted for i in idx], block_size)
        out["tokens"] = sum(len(gens[i].tokens) for i in idx)
        out["tokens_per_s"] = round(decoded / seconds, 2) if seconds else None
        out["graph_setup_s"] = round(sum(gens[i].setup_s for i in idx), 2)  # not in `seconds`
        if reference is not None:
            same = (gens[i].tokens == reference[i].tokens for i in idx)
            out["lossless"] = round(statistics.fmean(same), 4)
        return out

    names = sorted({p.set_name for p in prompts})
    return {
        "overall": block(range(len(prompts))),
        "sets": {n: block([i for i, p in enumerate(prompts) if p.set_name == n]) for n in names},
    }


def tokens_sha256(gens: list[Generation]) -> str:
    """sha256 of the generated tokens of every prompt, in order."""
    return hashlib.sha256(json.dumps([g.tokens for g in gens]).encode()).hexdigest()


def _divergences(setup: Setup, reference: list[Generation], gens: list[Generation]) -> list:
    """Each generation's first difference from the target-only one (with the logit gap), and
    the context of each, (divergence, prompt + shared prefix)."""
    out = []
    for i, (ref, gen) in enumerate(zip(reference, gens, strict=True)):
        d = divergence(setup.model, setup.prompts[i].id, setup.encoded[i], ref.tokens, gen.tokens)
        if d is not None:
            out.append((d, setup.encoded[i] + ref.tokens[: d.position]))
    return out


def _check_lossless(setup: Setup, gens: dict, record: dict, output: Path) -> None:
    """Fail on any output that differs from the target's greedy one, except (outside float32) a
    divergence that starts at a near tie; those are listed in the record as `near_ties`. A
    failure's evidence (`<output>.failed.json`) holds each mismatch's tokens up to it, so its
    gap can be measured again anywhere."""
    failed = output.with_suffix(".failed.json")
    found = {name: _divergences(setup, gens["target"], gs) for name, gs in gens.items()}
    exact = setup.dtype == torch.float32
    margin = setup.config["eval"]["tie_margin"]
    if not exact:  # a gap past the margin in bf16 is measured again in float32
        checks = [c for cs in found.values() for c in cs if beyond(c[0], margin)]
        recheck_in_float32(setup.target_path, checks, setup.embed.weight.device)
    # each divergence's tokens up to it (prompt and shared prefix), kept in a failure's evidence
    contexts = {(name, d.prompt): c for name, cs in found.items() for d, c in cs}
    found = {name: [d for d, _ in cs] for name, cs in found.items()}
    judged = {name: judge(ds, exact, margin) for name, ds in found.items()}
    record["dtype"] = str(setup.dtype).removeprefix("torch.")
    record["near_ties"] = {name: ties for name, (ties, _) in judged.items() if ties}
    bad = {name: real for name, (_, real) in judged.items() if real}
    if not bad:
        failed.unlink(missing_ok=True)  # an earlier failure's evidence, now stale
        if record["near_ties"]:
            log.warning(
                "%s outputs part from the target's own at a near tie (logit gap <= %s in %s "
                "or in float32: rounding): %s",
                sum(map(len, record["near_ties"].values())),
                margin,
                record["dtype"],
                record["near_ties"],
            )
        return
    evidence = {n: [m | {"context": contexts[n, m["prompt"]]} for m in ms] for n, ms in bad.items()}
    write_json(failed, record | {"mismatches": evidence})
    raise UserError(
        f"speculative output differs from the target's greedy output ({record['dtype']}; "
        f"first differing token and the target's logit gap there): {bad}"
    )


def run(args) -> None:
    """results/eval/acceptance.json: the trained drafter, its baselines, tau_sim."""
    setup = Setup(args)
    config = setup.config
    # before the decoding: a failure here costs seconds, not the evaluation
    overlap = found_in_training(setup.prompts, args.train) if args.train else None
    gens = setup.decode_all(chain_methods(setup, GREEDY))
    results = {
        name: summarize(setup.prompts, gs, setup.block_size, gens["target"])
        for name, gs in gens.items()
    }
    base = results["target"]["overall"]["tokens_per_s"]
    for name, r in results.items():
        r["overall"]["speedup"] = round(r["overall"]["tokens_per_s"] / base, 3)
        r["overall"]["host"] = setup.hosts.get(name)
    rows = pl.read_parquet(args.tokenized).head(config["eval"]["max_prompts"])
    tf = teacher_forced_tau(setup.drafter, setup.model, rows, config)
    headline = results["drafter"]["overall"]
    record = {
        "block_size": setup.block_size,
        "max_new_tokens": setup.max_new,
        **headline,
        "sets": results["drafter"]["sets"],
        "tau_sim": simulated(setup, args.tokenized, gens["target"], gens["drafter"]),
        "teacher_forced_tau": tf,
        "teacher_forced_gap": round(tf - headline["tau_macro"], 4),
        "baselines": {k: v["overall"] for k, v in results.items() if k != "drafter"},
        "baseline_sets": {k: v["sets"] for k, v in results.items() if k != "drafter"},
        **setup.sha,
        "reference_sha256": tokens_sha256(gens["target"]),
        "lossless": min(r["overall"]["lossless"] for r in results.values()),
        "per_prompt": per_prompt(setup.prompts, gens, setup.stop),
        # the same fixed steps timed once every method has decoded (dflash.eval.probe)
        "clock_probe": setup.probes,
        "train_overlap": overlap,
    }
    _check_lossless(setup, gens, record, Path(args.output))
    write_json(args.output, record)
    log.info("peak GPU memory: %s GB", peak_memory_gb())
    sim = record["tau_sim"]
    match = sim.get("matching_rows", {})
    log.info(
        "tau %.3f macro (%.3f pooled); on %s held-out rows tau_sim %s vs real %s (gap %s %%), "
        "%s of them diverged from the regenerated data, on the rest tau_sim %s vs real %s; "
        "teacher-forced %.3f, speedup %.2fx, lossless %.2f",
        record["tau_macro"],
        record["tau_pooled"],
        sim.get("rows"),
        sim.get("tau_sim"),
        sim.get("tau_macro"),
        sim.get("gap_pct"),
        sim.get("diverged_rows"),
        match.get("tau_sim"),
        match.get("tau_macro"),
        tf,
        record["speedup"],
        record["lossless"],
    )


def run_ddtree(args) -> None:
    """results/eval/ddtree.json: τ and speedup of tree drafting by node budget (and the chain)."""
    tree_cfg = args.config["eval"]["ddtree"]
    setup = Setup(args, tree_cfg["max_prompts"])
    budgets = {name: b for name, b, _ in tree_variants(tree_cfg)}
    gens = setup.decode_all(tree_methods(setup, GREEDY))
    base = summarize(setup.prompts, gens["target"], setup.block_size, gens["target"])
    rows = []
    for name, gs in gens.items():
        if name == "target":
            continue
        summary = summarize(setup.prompts, gs, setup.block_size, gens["target"])
        overall = summary["overall"]
        rows.append(
            {
                "method": name,
                "budget": budgets.get(name, setup.block_size - 1),
                "lookup": name.endswith("+lookup"),
                "tau_macro": overall["tau_macro"],
                "tau_pooled": overall["tau_pooled"],
                "tokens_per_s": overall["tokens_per_s"],
                "speedup": round(overall["tokens_per_s"] / base["overall"]["tokens_per_s"], 3),
                "lossless": overall["lossless"],
                "host": setup.hosts.get(name),
                "sets": {
                    n: {k: s[k] for k in ("tau_macro", "tau_pooled")}
                    for n, s in summary["sets"].items()
                },
            }
        )
    record = {
        "block_size": setup.block_size,
        "topk": tree_cfg["topk"],
        "n_prompts": len(setup.prompts),
        "max_new_tokens": setup.max_new,
        "target_tokens_per_s": base["overall"]["tokens_per_s"],
        "target_host": setup.hosts.get("target"),
        "results": rows,
        **setup.sha,
        "lossless": min(r["lossless"] for r in rows),
        # the same fields as acceptance.json's: a prompt's clock in both stages side by side
        "per_prompt": per_prompt(setup.prompts, gens, setup.stop),
        "clock_probe": setup.probes,
    }
    _check_lossless(setup, gens, record, Path(args.output))
    write_json(args.output, record)
    log.info("peak GPU memory: %s GB", peak_memory_gb())
    for r in rows:
        log.info("%s", {k: v for k, v in r.items() if k != "sets"})
