"""`dflash sample-eval` (rule `eval_sampling`): τ at temperature, as users serve, beside the
greedy figures of `eval_acceptance` (and `eval_ddtree`) on the same prompts.

For each temperature of `eval.sampling` (with its top-p and top-k) and each seed, every prompt is
decoded by the target alone (plain sampling: the speed baseline, and the answer a later turn
follows) and by every method of eval_acceptance (the untrained drafter aside) and, with
`eval.sampling.ddtree`, every tree of eval_ddtree, each decoding with a stream of its own
(`Setup.decode_all`). The drafter drafts its argmax (vLLM's default `draft_sample_method:
greedy`) or, with `probabilistic` among `eval.sampling.draft_rules`, tokens drawn from its own
distribution (`drafter/probabilistic`). Per method: τ macro (over prompts and seeds) and pooled,
per set, the spread of τ macro over the seeds, and the greedy τ of the same prompts (read from
acceptance.json and ddtree.json) with the ratio. Outputs cannot equal the target's token for
token at a temperature: losslessness there is a property of the rule, tested for its
distribution (tests/test_sampling.py).

tau_sim at each temperature (`dflash.model.tau_sim_sampled`) is reported beside the real τ on the
held-out prompts, read off the held-out rows' regenerated answers (what training logs) and off
the target's own sampled answers of this evaluation (the text distribution real decoding met).
"""

from __future__ import annotations

import logging
import statistics

import polars as pl
import torch

from dflash.eval.decode import SampledDrafts
from dflash.eval.predicted import held_out_names
from dflash.eval.run import chain_methods, summarize, tree_methods
from dflash.eval.setup import Setup
from dflash.eval.verify import Sampled
from dflash.io import read_json, write_json
from dflash.model.memory import peak_memory_gb
from dflash.model.sampling import Sampling, probabilities
from dflash.model.tau_sim import response_spans, tau_macro
from dflash.model.tau_sim_sampled import argmax_ceiling, simulate_sampled, target_top

log = logging.getLogger(__name__)

PROBABILISTIC = "drafter/probabilistic"


def run(args) -> None:
    """results/eval/sampling.json: every temperature's figures (its manifest is the
    registry's, dflash.stages)."""
    cfg = args.config["eval"]["sampling"]
    setup = Setup(args, cfg["max_prompts"])
    greedy = greedy_taus(read_json(args.acceptance))
    if cfg["ddtree"] and args.ddtree:  # the trees' (its chain is acceptance.json's drafter)
        trees = greedy_taus(read_json(args.ddtree))
        greedy |= {name: taus for name, taus in trees.items() if name.startswith("tree-")}
    runs = []
    for temperature in cfg["temperatures"]:
        sampling = Sampling(temperature, cfg["top_p"], cfg["top_k"])
        rule = Sampled(sampling, setup.session.device)
        methods = _methods(setup, rule, cfg)
        decoded = []  # per seed: (prompts, their ids, generations by method)
        for seed in range(cfg["seeds"]):
            gens = setup.decode_all(methods, rule, seed)
            decoded.append((*setup.sampled, gens))
        runs.append(_run(setup, sampling, decoded, greedy))
        log_run(runs[-1])
    record = {
        "block_size": setup.block_size,
        "max_new_tokens": setup.max_new,
        **{k: cfg[k] for k in ("top_p", "top_k", "seeds", "max_prompts", "draft_rules")},
        "runs": runs,
        **setup.sha,
    }
    write_json(args.output, record)
    log.info("peak GPU memory: %s GB", peak_memory_gb())


def _methods(setup: Setup, rule: Sampled, cfg: dict) -> dict:
    """What decodes under `rule`: eval_acceptance's methods, the probabilistic draft rule, and
    eval_ddtree's trees (its chain is the drafter's)."""
    methods = chain_methods(setup, rule, untrained=False)
    if "probabilistic" in cfg["draft_rules"]:
        methods[PROBABILISTIC] = setup.chain(SampledDrafts(setup.proposer, rule), rule)
    if "greedy" not in cfg["draft_rules"]:
        methods.pop("drafter")
    if cfg["ddtree"]:
        trees = tree_methods(setup, rule)
        trees.pop("chain")
        methods |= trees
    return methods


def greedy_taus(record: dict) -> dict[str, dict[str, float | None]]:
    """Each method's greedy τ per prompt id, from acceptance.json or ddtree.json."""
    ours = record["per_prompt"]
    return {
        name: dict(zip(ours["ids"], m["tau"], strict=True)) for name, m in ours["methods"].items()
    }


def _run(setup, sampling: Sampling, decoded: list, greedy: dict) -> dict:
    """One temperature: each method pooled over the seeds, its spread, its ratio to greedy τ on
    the same prompts, and tau_sim."""
    prompts = [p for ps, _, _ in decoded for p in ps]
    first = decoded[0][0]

    def figures_of(ps, gens):
        return summarize(ps, gens, setup.block_size)

    target = figures_of(prompts, [g for _, _, gs in decoded for g in gs["target"]])
    methods, per_prompt = {}, {"ids": [p.id for p in first], "sets": [p.set_name for p in first]}
    for name in decoded[0][2]:
        figures = figures_of(prompts, [g for _, _, gs in decoded for g in gs[name]])
        figures["seeds"] = _spread([figures_of(ps, gs[name]) for ps, _, gs in decoded])
        base = target["overall"]["tokens_per_s"]
        if name != "target" and base:
            figures["overall"]["speedup"] = round(figures["overall"]["tokens_per_s"] / base, 3)
        # per prompt, τ under each seed (later turns follow each seed's own answer)
        taus = [[_tau(gs[name][i]) for _, _, gs in decoded] for i in range(len(first))]
        if name != "target":
            per_prompt[name] = taus
        same = greedy.get(name.split("/")[0])
        if same is not None:
            _beside_greedy(figures, first, taus, same)
        methods[name] = figures
    return {
        "temperature": sampling.temperature,
        "label": sampling.label,
        "methods": methods,
        "per_prompt": per_prompt,
        "tau_sim": _tau_sim(setup, sampling, decoded),
        "argmax_ceiling": _argmax_ceiling(setup, sampling, decoded, methods.get("drafter")),
    }


def _beside_greedy(figures: dict, prompts: list, taus: list, greedy: dict) -> None:
    """Greedy τ macro and this τ macro on the prompts both decoded (`same_prompts`), and their
    ratio (`of_greedy`), overall and per set."""

    def add(block: dict, idx: list[int]) -> None:
        both = [i for i in idx if greedy.get(prompts[i].id) is not None]
        mine = [t for i in both for t in taus[i] if t is not None]
        if both and mine:
            block["same_prompts"] = len(both)
            block["greedy_macro"] = round(statistics.fmean(greedy[prompts[i].id] for i in both), 4)
            block["sampled_macro_same_prompts"] = round(statistics.fmean(mine), 4)
            block["of_greedy"] = round(
                block["sampled_macro_same_prompts"] / block["greedy_macro"], 4
            )

    add(figures["overall"], list(range(len(prompts))))
    for name, block in figures["sets"].items():
        add(block, [i for i, p in enumerate(prompts) if p.set_name == name])


def _tau(gen) -> float | None:
    return round(statistics.fmean(gen.accepted), 3) if gen.accepted else None


def _spread(per_seed: list[dict]) -> dict:
    """τ macro under each seed, overall and per set, and its standard deviation over seeds."""
    taus = [s["overall"].get("tau_macro") for s in per_seed]
    out = {"tau_macro": taus, "stdev": _stdev(taus), "sets": {}}
    for name in per_seed[0]["sets"]:
        values = [s["sets"][name].get("tau_macro") for s in per_seed]
        out["sets"][name] = {"tau_macro": values, "stdev": _stdev(values)}
    return out


def _stdev(values) -> float | None:
    values = [v for v in values if v is not None]
    return round(statistics.stdev(values), 4) if len(values) > 1 else None


@torch.no_grad()
def _with_top(model, ids: list[int], layer_ids: list[int], sampling: Sampling):
    """(1, s, n*H) features and the target's top tokens per position, from one forward."""
    device = model.get_input_embeddings().weight.device
    out = model(input_ids=torch.tensor([ids], device=device), output_hidden_states=True)
    features = torch.cat([out.hidden_states[i + 1] for i in layer_ids], dim=-1)
    return features, target_top(out.logits[0], sampling)


def _tau_sim(setup, sampling: Sampling, decoded: list) -> dict:
    """tau_sim at `sampling` on the held-out prompts beside their real τ (the drafter's,
    argmax drafts, macro over prompts and seeds): from the held-out rows' first regenerated
    answers, and from the target's own sampled answers in this evaluation."""
    names = held_out_names(setup.config)
    layer_ids = setup.drafter.config.target_layer_ids
    held = [
        (i, p.id) for i, p in enumerate(decoded[0][0]) if p.set_name in names and "#" not in p.id
    ]
    if not held or "drafter" not in decoded[0][2]:
        return {"rows": 0}
    real = tau_macro([gs["drafter"][i].accepted for _, _, gs in decoded for i, _ in held])

    def simulated(texts) -> float | None:  # (prompt ids, answer ids) pairs
        def rows():
            for prompt, answer in texts:
                ids = list(prompt) + list(answer)
                features, top = _with_top(setup.model, ids, layer_ids, sampling)
                mask = torch.tensor([0] * len(prompt) + [1] * len(answer))
                yield features, torch.tensor(ids), mask, top

        taus = simulate_sampled(
            setup.drafter, setup.embed, setup.head, rows(), max_new_tokens=setup.max_new
        )
        taus = [t for t in taus if t is not None]
        return round(statistics.fmean(taus), 4) if taus else None

    own = [(encoded[i], gs["target"][i].tokens) for _, encoded, gs in decoded for i, _ in held]
    out = {"rows": len(held), "tau_macro": real, "on_target_samples": simulated(own)}
    regenerated = _regenerated_answers(setup, {row_id for _, row_id in held})
    if regenerated:
        out["on_regenerated"] = simulated(regenerated)
    for key in ("on_target_samples", "on_regenerated"):
        if out.get(key) and real:
            out[f"{key}_gap_pct"] = round(100 * (out[key] - real) / real, 2)
    return out


@torch.no_grad()
def _argmax_ceiling(setup, sampling: Sampling, decoded: list, drafter: dict | None) -> dict:
    """What argmax drafts could reach here (`argmax_ceiling`), read along the target's own
    sampled answers of every prompt and seed: τ macro overall and per set, and the trained
    drafter's τ (argmax drafts) as a share of it."""
    device = setup.model.get_input_embeddings().weight.device
    by_set: dict[str, list[float]] = {}
    for prompts, encoded, gens in decoded:
        for i, prompt in enumerate(prompts):
            ids = list(encoded[i]) + list(gens["target"][i].tokens)
            first = len(encoded[i])
            last = min(len(ids) - 1, first + setup.max_new - 1)
            if last <= first:  # nothing to draft
                continue
            # the target's best chance for each answer token after the first (drafts fill those):
            # the logits of positions first..len(ids) - 1 only, no cache
            out = setup.model(
                input_ids=torch.tensor([ids], device=device),
                logits_to_keep=len(ids) - first,
                use_cache=False,
            )
            kept = out.logits[0, : last - first].float()
            best = [0.0] * first + probabilities(kept, sampling).max(-1).values.tolist()
            by_set.setdefault(prompt.set_name, []).append(
                argmax_ceiling(best, first, last, setup.block_size)
            )
    if not by_set:
        return {}

    def block(taus: list[float], reached: dict | None) -> dict:
        out = {"tau_macro": round(statistics.fmean(taus), 4), "responses": len(taus)}
        if reached and reached.get("tau_macro"):
            out["drafter_share"] = round(reached["tau_macro"] / out["tau_macro"], 4)
        return out

    sets = (drafter or {}).get("sets", {})
    everything = [t for taus in by_set.values() for t in taus]
    return block(everything, (drafter or {}).get("overall")) | {
        "sets": {name: block(taus, sets.get(name)) for name, taus in by_set.items()}
    }


def _regenerated_answers(setup, row_ids: set[str]) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, first answer ids) of the held-out rows in the tokenized eval split."""
    if setup.tokenized is None:
        return []
    frame = pl.read_parquet(setup.tokenized).filter(pl.col("id").is_in(list(row_ids)))
    out = []
    for ids, mask in zip(frame["input_ids"], frame["loss_mask"], strict=True):
        spans = response_spans(list(mask))
        if spans:
            first, end = spans[0]
            out.append((list(ids[:first]), list(ids[first : end + 1])))
    return out


def log_run(run: dict) -> None:
    """One line per method: τ macro (its spread over seeds), the ratio to greedy, speedup."""
    for name, figures in run["methods"].items():
        o = figures["overall"]
        log.info(
            "%s %s: tau %s macro (stdev over seeds %s), %s pooled, %s of greedy, speedup %s",
            run["label"], name, o.get("tau_macro"), figures["seeds"]["stdev"],
            o.get("tau_pooled"), o.get("of_greedy"), o.get("speedup"),
        )  # fmt: skip
    if run.get("tau_sim", {}).get("rows"):
        log.info("%s tau_sim on the held-out prompts: %s", run["label"], run["tau_sim"])
