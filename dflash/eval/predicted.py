"""What held-out rows predict about real τ, reported beside it by `dflash eval`: `tau_sim`
(the decoding walk read off one teacher-forced pass, `dflash.model.tau_sim`) on the prompts'
tokenized rows, and the older `teacher_forced_tau` (acceptance over random anchors, which
overstates real τ)."""

from __future__ import annotations

from pathlib import Path

import polars as pl
import torch

from dflash.eval.decode import Generation
from dflash.model.objective import default_gamma, dflash_loss
from dflash.model.tau_sim import response_spans, simulate, tau_macro


def held_out_names(config: dict) -> set[str]:
    return {
        s.get("name") or s["format"] for s in config["eval"]["sets"] if s["format"] == "held_out"
    }


@torch.no_grad()
def full_features(model, ids: list[int], layer_ids: list[int]) -> torch.Tensor:
    """(1, s, n*H) features of a whole sequence from one plain forward (no cache)."""
    device = model.get_input_embeddings().weight.device
    out = model(input_ids=torch.tensor([ids], device=device), output_hidden_states=True)
    return torch.cat([out.hidden_states[i + 1] for i in layer_ids], dim=-1)


@torch.no_grad()
def teacher_forced_tau(drafter, model, rows: pl.DataFrame, config) -> float:
    """τ of the training objective (block accuracy under teacher forcing) on held-out rows."""
    d = config["drafter"]
    gamma = d["gamma"] or default_gamma(drafter.config.block_size)
    embed, head = model.get_input_embeddings(), model.lm_head.weight
    taus, weights = [], []
    for i, (ids, mask) in enumerate(zip(rows["input_ids"], rows["loss_mask"], strict=True)):
        features = full_features(model, list(ids), drafter.config.target_layer_ids)
        ids_t = torch.tensor([ids], device=head.device)
        mask_t = torch.tensor([mask], device=head.device)
        gen = torch.Generator().manual_seed(config["seed"] * 7919 + i)
        _, m = dflash_loss(
            drafter, embed, head, features, ids_t, mask_t, gen, d["max_anchors"], gamma
        )
        if m["blocks"]:
            taus.append(m["tau"])
            weights.append(m["blocks"])
    return round(sum(t * w for t, w in zip(taus, weights, strict=True)) / sum(weights), 4)


def simulated(setup, tokenized: Path, reference: list[Generation], real: list) -> dict:
    """tau_sim on the held-out prompts' tokenized rows (their first response, capped at
    max_new_tokens as decoding is) beside the real τ on the same prompts, overall and on the rows
    whose regenerated response the eval's own greedy continuation matches: where they differ
    (regenerated in bf16, decoded here in fp32) the drafter is judged against other text."""
    names = held_out_names(setup.config)
    held = {p.id: i for i, p in enumerate(setup.prompts) if p.set_name in names}
    frame = pl.read_parquet(tokenized).filter(pl.col("id").is_in(list(held)))
    rows = []  # (prompt index, ids, response span, response matches the eval's continuation)
    for row_id, ids, mask in zip(frame["id"], frame["input_ids"], frame["loss_mask"], strict=True):
        spans = response_spans(mask)
        if spans:
            first, end = spans[0]
            response, decoded = list(ids[first : end + 1]), reference[held[row_id]].tokens
            n = min(len(response), len(decoded), setup.max_new)
            rows.append((held[row_id], list(ids), first, end, response[:n] == decoded[:n]))
    if not rows:
        return {"rows": 0}

    def with_features():  # one row's features at a time: a large target's would not all fit
        layer_ids = setup.drafter.config.target_layer_ids
        for _, ids, first, end, _ in rows:
            first_only = torch.zeros(len(ids), dtype=torch.long)
            first_only[first : end + 1] = 1
            yield full_features(setup.model, ids, layer_ids), torch.tensor(ids), first_only

    rounds = simulate(
        setup.drafter, setup.embed, setup.head, with_features(), max_new_tokens=setup.max_new
    )

    def compare(picked: list[int]) -> dict:
        sim = tau_macro([rounds[k] for k in picked])
        tau = tau_macro([real[rows[k][0]].accepted for k in picked])
        gap = round(100 * (sim - tau) / tau, 2) if sim and tau else None
        return {"rows": len(picked), "tau_sim": sim, "tau_macro": tau, "gap_pct": gap}

    matching = [k for k, row in enumerate(rows) if row[4]]
    return {
        **compare(list(range(len(rows)))),
        "diverged_rows": len(rows) - len(matching),
        "matching_rows": compare(matching),
    }


def tau_on_texts(
    model, drafter, texts: list[tuple[list[int], list[int]]], max_new_tokens: int
) -> list[float | None]:
    """τ per prompt that our drafter would reach decoding exactly `texts` (prompt ids, response
    tokens as another engine emitted them: the target's own greedy answer there), read off the
    decoding walk (tau_sim), which on the target's own continuation gives real decoding's rounds
    one for one. Another engine's acceptance length on those tokens minus this is then only the
    two engines' arithmetic, not two different texts."""
    layer_ids = drafter.config.target_layer_ids

    def rows():  # one prompt's features at a time
        for prompt, response in texts:
            ids = list(prompt) + list(response)
            mask = torch.tensor([0] * len(prompt) + [1] * len(response))
            yield full_features(model, ids, layer_ids), torch.tensor(ids), mask

    embed, head = model.get_input_embeddings(), model.lm_head.weight
    rounds = simulate(drafter, embed, head, rows(), max_new_tokens=max_new_tokens)
    # an empty response (a prompt answered by its stop token alone) has no span: no rounds
    spans = iter(rounds)
    return [tau_macro([next(spans)]) if response else None for _, response in texts]
