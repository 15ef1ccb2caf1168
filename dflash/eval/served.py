"""A serving engine's figures beside this evaluation's: what eval_vllm (`dflash.eval.vllm_stage`)
and eval_sglang (`dflash.eval.sglang_stage`) share.

Each engine's serve module hands back, per prompt decoded alone, the prompt's and the answer's
tokens, wall seconds, and two counts read from the engine: `drafts`, its verify rounds after the
prompt's own forward, and `accepted`, the draft tokens those rounds committed. So 1 + accepted /
drafts is tokens committed per verify round, the τ our evaluation reports; the engine's own
arithmetic lies in how its serve module reads the counts. The record's keys carry the engine's
name (`vllm_macro`, `sglang_macro`, ...), so each engine's JSON reads on its own.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import statistics
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

from dflash.errors import UserError
from dflash.eval.metrics import text_digest

log = logging.getLogger(__name__)


def acceptance_length(rows: list[dict]) -> float | None:
    """Pooled over `rows`: 1 + accepted draft tokens / drafting rounds."""
    drafts = sum(r["drafts"] for r in rows)
    return round(1 + sum(r["accepted"] for r in rows) / drafts, 4) if drafts else None


def macro(values) -> float | None:
    values = [v for v in values if v is not None]
    return round(statistics.fmean(values), 4) if values else None


def pct(ours: float | None, theirs: float | None) -> float | None:
    return round(100 * (theirs - ours) / ours, 2) if ours and theirs is not None else None


def same_text(rows, alone, ours: dict, stop: set[int], engine: str) -> dict | None:
    """Where the engine decoded exactly the text our evaluation's drafter decoded, the two
    acceptance lengths are judged on the same tokens and differ only by the drafter's arithmetic
    in each engine; elsewhere the texts parted at a near tie (bf16) and τ was measured on other
    text. None for an acceptance.json without per-prompt digests (older runs)."""
    texts = ours["methods"]["drafter"].get("text")
    if texts is None:
        return None
    taus = ours["methods"]["drafter"]["tau"]
    mine = dict(zip(ours["ids"], zip(texts, taus, strict=True), strict=True))
    targets = dict(zip(ours["ids"], ours["target"]["text"], strict=True))
    idx = [i for i, r in enumerate(rows) if text_digest(r["tokens"], stop) == mine[r["id"]][0]]
    return {
        "prompts": len(idx),
        "of": len(rows),
        f"{engine}_macro": macro(acceptance_length([rows[i]]) for i in idx),
        "ours_macro": macro(mine[rows[i]["id"]][1] for i in idx),
        # the engine's target alone against ours: how often the two greedy texts agree at all
        "target_alone_same": sum(text_digest(a["tokens"], stop) == targets[a["id"]] for a in alone),
    }


def compare(
    served: dict,
    target_alone: dict,
    acceptance: dict,
    stop: set[int],
    walked: list[float | None] | None,
    engine: str,
) -> dict:
    """The engine's figures beside the evaluation's (`acceptance.json`) on the same prompts, and
    where `walked` is given (our drafter's τ on the engine's own answers, `walk_served`), beside
    ours on exactly the engine's tokens."""
    rows = served["prompts"]
    ours = acceptance["per_prompt"]
    ours_tau = dict(zip(ours["ids"], ours["methods"]["drafter"]["tau"], strict=True))
    missing = [r["id"] for r in rows if r["id"] not in ours_tau]
    if missing:
        raise UserError(
            f"eval_{engine}: prompts {missing[:5]} are not in eval/acceptance.json's per_prompt; "
            "the two stages read different eval sets (rerun eval_acceptance)"
        )
    per_prompt = [acceptance_length([r]) for r in rows]
    sets = {}
    for name in dict.fromkeys(r["set"] for r in rows):
        idx = [i for i, r in enumerate(rows) if r["set"] == name]
        mine = acceptance["sets"].get(name, {})
        entry = {
            "prompts": len(idx),
            f"{engine}_macro": macro(per_prompt[i] for i in idx),
            f"{engine}_pooled": acceptance_length([rows[i] for i in idx]),
            "ours_macro": mine.get("tau_macro"),
            "ours_pooled": mine.get("tau_pooled"),
        }
        entry["diff_pct_macro"] = pct(entry["ours_macro"], entry[f"{engine}_macro"])
        entry["diff_pct_pooled"] = pct(entry["ours_pooled"], entry[f"{engine}_pooled"])
        if walked is not None:
            pairs = [per_prompt[i] for i in idx], [walked[i] for i in idx]
            entry.update(on_same_tokens(*pairs, engine))
        sets[name] = entry
    alone = {r["id"]: r["tokens"] for r in target_alone["prompts"]}
    drafts = sum(r["drafts"] for r in rows)
    # per prompt as long as the engine counted (SGLang's histogram grows with the most accepted)
    columns = itertools.zip_longest(*(r["per_position"] for r in rows), fillvalue=0)
    positions = [sum(col) for col in columns]
    speed = {"1": _speed(rows, target_alone["prompts"])}
    for c, fig in served["concurrency"].items():
        base = target_alone["concurrency"][c]["tokens_per_s"]
        speed[c] = {"target": base, "dflash": fig["tokens_per_s"],
                    "speedup": round(fig["tokens_per_s"] / base, 3)}  # fmt: skip
    return {
        engine: served[engine],
        "n_prompts": len(rows),
        "acceptance_length": {
            f"{engine}_macro": macro(per_prompt),
            f"{engine}_pooled": acceptance_length(rows),
            "ours_macro": acceptance["tau_macro"],
            "ours_pooled": acceptance["tau_pooled"],
            "diff_pct_macro": pct(acceptance["tau_macro"], macro(per_prompt)),
            "diff_pct_pooled": pct(acceptance["tau_pooled"], acceptance_length(rows)),
        },
        "sets": sets,
        f"on_{engine}_text": (
            on_same_tokens(per_prompt, walked, engine) if walked is not None else None
        ),
        "same_text": same_text(rows, target_alone["prompts"], ours, stop, engine),
        "per_position": [round(n / drafts, 4) for n in positions] if drafts else [],
        "identical_to_target_alone": round(
            statistics.fmean(r["tokens"] == alone.get(r["id"]) for r in rows), 4
        ),
        "tokens_per_s": speed,
        "startup_s": {"target": target_alone["startup_s"], "dflash": served["startup_s"]},
        "per_prompt": {
            "ids": [r["id"] for r in rows],
            "sets": [r["set"] for r in rows],
            engine: per_prompt,
            "ours": [ours_tau[r["id"]] for r in rows],
            f"ours_on_{engine}_text": walked,
            "tokens": [len(r["tokens"]) for r in rows],
            "text": [text_digest(r["tokens"], stop) for r in rows],
        },
    }


def compare_sampled(served: dict[str, list], ours: dict | None, engine: str) -> list[dict]:
    """At each temperature and draft rule, per eval set: the engine's acceptance length pooled
    over the set's prompts and every seed, beside our τ pooled over the same prompts and seeds
    (eval/sampling.json; the probabilistic rule's is `drafter/probabilistic`)."""
    ours_runs = {run["temperature"]: run for run in (ours or {}).get("runs", [])}
    out = []
    for rule, runs in served.items():
        method = "drafter" if rule == "greedy" else "drafter/probabilistic"
        for run in runs:
            mine = ours_runs.get(run["temperature"], {}).get("methods", {}).get(method, {})
            sets = {}
            for name in run["seeds"][0]:
                pooled = [seed[name] for seed in run["seeds"]]
                theirs = acceptance_length(pooled)
                tau = mine.get("sets", {}).get(name, {}).get("tau_pooled")
                sets[name] = {f"{engine}_pooled": theirs, "ours_pooled": tau,
                              "diff_pct_pooled": pct(tau, theirs),
                              "per_seed": [acceptance_length([s]) for s in pooled]}  # fmt: skip
            every = [seed[n] for seed in run["seeds"] for n in seed]
            overall = mine.get("overall", {}).get("tau_pooled")
            out.append({"temperature": run["temperature"], "top_p": run["top_p"],
                        "top_k": run["top_k"], "draft_rule": rule, "seeds": len(run["seeds"]),
                        f"{engine}_pooled": acceptance_length(every), "ours_pooled": overall,
                        "diff_pct_pooled": pct(overall, acceptance_length(every)),
                        "sets": sets})  # fmt: skip
    return out


def on_same_tokens(theirs: list, walked: list, engine: str) -> dict:
    """The engine's acceptance length beside our drafter's τ on the very tokens it emitted
    (prompts with something to draft): what is left between them is the engines' arithmetic."""
    pairs = [(v, w) for v, w in zip(theirs, walked, strict=True) if v is not None and w is not None]
    v, w = macro(p[0] for p in pairs), macro(p[1] for p in pairs)
    return {"walked_prompts": len(pairs), f"{engine}_on_its_text": v,
            f"ours_on_{engine}_text": w, "diff_pct_same_tokens": pct(w, v)}  # fmt: skip


def walk_served(args, config: dict, rows: list[dict]) -> list[float | None]:
    """Our drafter's τ on each of the engine's answers (`predicted.tau_on_texts`), with the
    target and drafter loaded as the evaluation loads them (`setup.load_models`), after the
    engines have exited and handed the GPU back."""
    from dflash.eval.predicted import tau_on_texts
    from dflash.eval.setup import load_models

    model, drafter, _ = load_models(config, args.target, args.drafter)
    texts = [(r["prompt_ids"], r["tokens"]) for r in rows]
    return tau_on_texts(model, drafter, texts, config["eval"]["max_new_tokens"])


def _speed(rows: list[dict], alone: list[dict]) -> dict:
    """Batch 1: new tokens over each request's wall time (its prefill included, unlike our
    evaluation's clock, which starts after the prompt's forward)."""

    def rate(rs):
        return round(sum(len(r["tokens"]) for r in rs) / sum(r["seconds"] for r in rs), 1)

    target, dflash = rate(alone), rate(rows)
    return {"target": target, "dflash": dflash, "speedup": round(dflash / target, 3)}


def base_request(args, config: dict) -> tuple[dict, list[dict]]:
    """What every engine's serve module is asked (the run's target, drafter, prompts, stop
    tokens, sizes) and the temperatures of eval.sampling it serves."""
    from transformers import AutoTokenizer

    from dflash.eval.setup import eos_ids, eval_prompts

    tokenizer = AutoTokenizer.from_pretrained(args.target)
    drafter_config = json.loads((Path(args.drafter) / "config.json").read_text())
    sampling = config["eval"]["sampling"]
    specs = [
        {"temperature": t, "top_p": sampling["top_p"], "top_k": sampling["top_k"],
         "seeds": sampling["seeds"]}
        for t in sampling["temperatures"]
    ]  # fmt: skip
    # at temperature, the prompts eval_sampling decoded (eval.sampling.max_prompts a set)
    capped = eval_prompts(config, args.held_out, sampling["max_prompts"])
    request = {
        "target": str(args.target),
        "chat_template_kwargs": config["data"]["chat_template_kwargs"],
        "drafter": str(args.drafter),
        "block_size": drafter_config["block_size"],
        "dtype": "float32" if config["eval"]["dtype"] == "float32" else "bfloat16",
        "max_new_tokens": config["eval"]["max_new_tokens"],
        "eos_ids": sorted(eos_ids(args.target, tokenizer)),
        "prompts": [asdict(p) for p in eval_prompts(config, args.held_out)],
        "sampling_prompts": [asdict(p) for p in capped],
    }
    return request, specs


def serve_in_process(module: str, request: dict, folder: Path, name: str, env=None) -> dict:
    """One engine in a process of its own (`python -m MODULE REQUEST OUTPUT`); its log goes to
    the stage's log (stderr)."""
    stage = f"eval_{module.rpartition('.')[2].removesuffix('_serve')}"
    request_path, output_path = folder / f"{name}.request.json", folder / f"{name}.json"
    request_path.write_text(json.dumps(request))
    cmd = [sys.executable, "-m", module, str(request_path), str(output_path)]
    log.info("%s, %s: %s", stage, name, " ".join(cmd))
    done = subprocess.run(cmd, env=env or os.environ.copy(), check=False)
    if done.returncode != 0:
        raise UserError(
            f"{stage}: the engine for the {name} exited with status {done.returncode}; its output "
            "is in this stage's log above"
        )
    return json.loads(output_path.read_text())


def log_result(record: dict, engine: str, label: str) -> None:
    """The stage's last log line: the engine's acceptance length beside ours, and its speedup."""
    a = record["acceptance_length"]
    log.info("%s %s: acceptance length %s macro (ours %s, %+.1f %%), %s pooled (ours %s); "
             "batch 1 %sx the target alone", label, record[engine], a[f"{engine}_macro"],
             a["ours_macro"], a["diff_pct_macro"] or 0.0, a[f"{engine}_pooled"], a["ours_pooled"],
             record["tokens_per_s"]["1"]["speedup"])  # fmt: skip


def engine_main(serve, argv: list[str] | None = None) -> None:
    """An engine process's entry (`python -m dflash.eval.X_serve REQUEST OUTPUT`): the request
    (JSON) in, `serve(request)`'s answer (JSON) out."""
    request_path, output_path = argv or sys.argv[1:]
    result = serve(json.loads(Path(request_path).read_text()))
    Path(output_path).write_text(json.dumps(result))
