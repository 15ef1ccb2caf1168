"""results/eval/vllm.json: the run's drafter in a serving engine. vLLM's DFlash method serves the
run's target and drafter on the evaluation's prompts, and its own figures are set beside ours.

Two engines, each in a process of its own (`dflash.eval.vllm_serve`): the target alone, then the
target with the drafter (`speculative_config={"method": "dflash", ...}`). Every prompt is decoded
alone (batch 1; a later turn after the engine's own answer to the one before, as the evaluation
does), so vLLM's speculative-decoding counters, read before and after it, give that prompt's
acceptance length: 1 + accepted draft tokens / drafting rounds, the τ our evaluation reports
(tokens committed per verify round). Then tokens/s in waves of each `eval.vllm.concurrency`.
Compared per set, macro and pooled, with `eval/acceptance.json`'s drafter on the same prompts.
The two engines' greedy texts part at near ties (bf16), so each τ is also judged on other tokens:
our drafter's τ on exactly vLLM's answers (the decoding walk of `dflash.model.tau_sim`) is set
beside vLLM's, leaving only the engines' arithmetic between them.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

from dflash.errors import UserError
from dflash.eval.metrics import text_digest
from dflash.io import read_json, write_json

log = logging.getLogger(__name__)


def vllm_installed() -> bool:
    return importlib.util.find_spec("vllm") is not None


def acceptance_length(rows: list[dict]) -> float | None:
    """Pooled over `rows`: 1 + accepted draft tokens / drafting rounds."""
    drafts = sum(r["drafts"] for r in rows)
    return round(1 + sum(r["accepted"] for r in rows) / drafts, 4) if drafts else None


def _macro(values) -> float | None:
    values = [v for v in values if v is not None]
    return round(statistics.fmean(values), 4) if values else None


def _pct(ours: float | None, theirs: float | None) -> float | None:
    return round(100 * (theirs - ours) / ours, 2) if ours and theirs is not None else None


def same_text(rows, alone, ours: dict, stop: set[int]) -> dict | None:
    """Where vLLM decoded exactly the text our evaluation's drafter decoded, the two acceptance
    lengths are judged on the same tokens and differ only by the drafter's arithmetic in each
    engine; elsewhere the texts parted at a near tie (bf16) and τ was measured on other text.
    None for an acceptance.json without per-prompt digests (older runs)."""
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
        "vllm_macro": _macro(acceptance_length([rows[i]]) for i in idx),
        "ours_macro": _macro(mine[rows[i]["id"]][1] for i in idx),
        # vLLM's target alone against ours: how often the two engines' greedy texts agree at all
        "target_alone_same": sum(text_digest(a["tokens"], stop) == targets[a["id"]] for a in alone),
    }


def compare(
    served: dict,
    target_alone: dict,
    acceptance: dict,
    stop: set[int],
    walked: list[float | None] | None = None,
) -> dict:
    """vLLM's figures beside the evaluation's (`acceptance.json`) on the same prompts, and where
    `walked` is given (our drafter's τ on vLLM's own answers, `walk_served`), beside ours on
    exactly vLLM's tokens."""
    rows = served["prompts"]
    ours = acceptance["per_prompt"]
    ours_tau = dict(zip(ours["ids"], ours["methods"]["drafter"]["tau"], strict=True))
    missing = [r["id"] for r in rows if r["id"] not in ours_tau]
    if missing:
        raise UserError(
            f"eval_vllm: prompts {missing[:5]} are not in eval/acceptance.json's per_prompt; the "
            "two stages read different eval sets (rerun eval_acceptance)"
        )
    per_prompt = [acceptance_length([r]) for r in rows]
    sets = {}
    for name in dict.fromkeys(r["set"] for r in rows):
        idx = [i for i, r in enumerate(rows) if r["set"] == name]
        mine = acceptance["sets"].get(name, {})
        entry = {
            "prompts": len(idx),
            "vllm_macro": _macro(per_prompt[i] for i in idx),
            "vllm_pooled": acceptance_length([rows[i] for i in idx]),
            "ours_macro": mine.get("tau_macro"),
            "ours_pooled": mine.get("tau_pooled"),
        }
        entry["diff_pct_macro"] = _pct(entry["ours_macro"], entry["vllm_macro"])
        entry["diff_pct_pooled"] = _pct(entry["ours_pooled"], entry["vllm_pooled"])
        if walked is not None:
            entry.update(_on_same_tokens([per_prompt[i] for i in idx], [walked[i] for i in idx]))
        sets[name] = entry
    alone = {r["id"]: r["tokens"] for r in target_alone["prompts"]}
    drafts = sum(r["drafts"] for r in rows)
    positions = [sum(col) for col in zip(*(r["per_position"] for r in rows), strict=False)]
    speed = {"1": _speed(rows, target_alone["prompts"])}
    for c, fig in served["concurrency"].items():
        base = target_alone["concurrency"][c]["tokens_per_s"]
        speed[c] = {"target": base, "dflash": fig["tokens_per_s"],
                    "speedup": round(fig["tokens_per_s"] / base, 3)}  # fmt: skip
    return {
        "vllm": served["vllm"],
        "n_prompts": len(rows),
        "acceptance_length": {
            "vllm_macro": _macro(per_prompt),
            "vllm_pooled": acceptance_length(rows),
            "ours_macro": acceptance["tau_macro"],
            "ours_pooled": acceptance["tau_pooled"],
            "diff_pct_macro": _pct(acceptance["tau_macro"], _macro(per_prompt)),
            "diff_pct_pooled": _pct(acceptance["tau_pooled"], acceptance_length(rows)),
        },
        "sets": sets,
        "on_vllm_text": _on_same_tokens(per_prompt, walked) if walked is not None else None,
        "same_text": same_text(rows, target_alone["prompts"], ours, stop),
        "per_position": [round(n / drafts, 4) for n in positions] if drafts else [],
        "identical_to_target_alone": round(
            statistics.fmean(r["tokens"] == alone.get(r["id"]) for r in rows), 4
        ),
        "tokens_per_s": speed,
        "startup_s": {"target": target_alone["startup_s"], "dflash": served["startup_s"]},
        "per_prompt": {
            "ids": [r["id"] for r in rows],
            "sets": [r["set"] for r in rows],
            "vllm": per_prompt,
            "ours": [ours_tau[r["id"]] for r in rows],
            "ours_on_vllm_text": walked,
            "tokens": [len(r["tokens"]) for r in rows],
            "text": [text_digest(r["tokens"], stop) for r in rows],
        },
    }


def compare_sampled(served: dict[str, list], ours: dict | None) -> list[dict]:
    """At each temperature and draft rule, per eval set: vLLM's acceptance length pooled over
    the set's prompts and every seed, beside our τ pooled over the same prompts and seeds
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
                sets[name] = {"vllm_pooled": theirs, "ours_pooled": tau,
                              "diff_pct_pooled": _pct(tau, theirs),
                              "per_seed": [acceptance_length([s]) for s in pooled]}  # fmt: skip
            every = [seed[n] for seed in run["seeds"] for n in seed]
            overall = mine.get("overall", {}).get("tau_pooled")
            out.append({"temperature": run["temperature"], "top_p": run["top_p"],
                        "top_k": run["top_k"], "draft_rule": rule, "seeds": len(run["seeds"]),
                        "vllm_pooled": acceptance_length(every), "ours_pooled": overall,
                        "diff_pct_pooled": _pct(overall, acceptance_length(every)),
                        "sets": sets})  # fmt: skip
    return out


def _on_same_tokens(vllm: list, walked: list) -> dict:
    """vLLM's acceptance length beside our drafter's τ on the very tokens vLLM emitted (prompts
    with something to draft): what is left between them is the engines' arithmetic alone."""
    pairs = [(v, w) for v, w in zip(vllm, walked, strict=True) if v is not None and w is not None]
    v, w = _macro(p[0] for p in pairs), _macro(p[1] for p in pairs)
    return {"walked_prompts": len(pairs), "vllm_on_its_text": v, "ours_on_vllm_text": w,
            "diff_pct_same_tokens": _pct(w, v)}  # fmt: skip


def walk_served(args, config: dict, rows: list[dict]) -> list[float | None]:
    """Our drafter's τ on each of vLLM's answers (`predicted.tau_on_texts`), with the target and
    drafter loaded as the evaluation loads them (`setup.load_models`), after vLLM's engines
    have exited and handed the GPU back."""
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


def _serve(request: dict, folder: Path, name: str) -> dict:
    """One engine in a process of its own; its log goes to the stage's log (stderr)."""
    request_path, output_path = folder / f"{name}.request.json", folder / f"{name}.json"
    request_path.write_text(json.dumps(request))
    cmd = [sys.executable, "-m", "dflash.eval.vllm_serve", str(request_path), str(output_path)]
    log.info("vLLM, %s: %s", name, " ".join(cmd))
    done = subprocess.run(cmd, env=os.environ.copy(), check=False)
    if done.returncode != 0:
        raise UserError(
            f"eval_vllm: the vLLM engine for the {name} exited with status {done.returncode}; "
            "its output is in this stage's log above"
        )
    return json.loads(output_path.read_text())


def run(args) -> None:
    from transformers import AutoTokenizer

    from dflash.eval.setup import eos_ids, eval_prompts

    config = args.config
    settings = config["eval"]["vllm"]
    if not vllm_installed():
        raise UserError(
            "eval_vllm: vLLM is not installed here (`import vllm` fails). Install it (docs/"
            "serving.md says which version serves DFlash drafters) or set eval.vllm.enabled: false"
        )
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    prompts = eval_prompts(config, args.held_out)
    drafter_config = json.loads((Path(args.drafter) / "config.json").read_text())
    sampling = config["eval"]["sampling"]
    specs = [
        {"temperature": t, "top_p": sampling["top_p"], "top_k": sampling["top_k"],
         "seeds": sampling["seeds"]}
        for t in sampling["temperatures"]
    ]  # fmt: skip
    request = {
        "target": str(args.target),
        "chat_template_kwargs": config["data"]["chat_template_kwargs"],
        "drafter": str(args.drafter),
        "block_size": drafter_config["block_size"],
        "dtype": "float32" if config["eval"]["dtype"] == "float32" else "bfloat16",
        "max_new_tokens": config["eval"]["max_new_tokens"],
        "eos_ids": sorted(eos_ids(args.target, tokenizer)),
        "prompts": [asdict(p) for p in prompts],
        "concurrency": settings["concurrency"],
        "max_model_len": settings["max_model_len"],
        "gpu_memory_utilization": settings["gpu_memory_utilization"],
    }
    rules = [r for r in sampling["draft_rules"] if specs]
    # at temperature, the prompts eval_sampling decoded (eval.sampling.max_prompts a set)
    capped = eval_prompts(config, args.held_out, sampling["max_prompts"])
    request["sampling_prompts"] = [asdict(p) for p in capped]
    with tempfile.TemporaryDirectory(prefix="eval-vllm-") as tmp:
        alone = _serve({**request, "drafter": None}, Path(tmp), "target alone")
        # the greedy draft rule's engine also gives the sampled figures of that rule
        greedy = specs if "greedy" in rules else []
        served = _serve({**request, "sampling": greedy}, Path(tmp), "target with the drafter")
        if "probabilistic" in rules:  # an engine of its own: the rule is the engine's setting
            probabilistic = {**request, "sampling": specs, "prompts_alone": False,
                             "draft_sample_method": "probabilistic"}  # fmt: skip
            drawn = _serve(probabilistic, Path(tmp), "drafter with probabilistic drafts")
    acceptance = json.loads(Path(args.acceptance).read_text())
    walked = walk_served(args, config, served["prompts"])
    record = compare(served, alone, acceptance, set(request["eos_ids"]), walked)
    if specs:
        record["sampled"] = compare_sampled(
            {"greedy": served.get("sampled", []), "probabilistic": drawn["sampled"]}
            if "probabilistic" in rules
            else {"greedy": served.get("sampled", [])},
            read_json(args.sampling) if args.sampling else None,
        )
    record["dtype"], record["max_new_tokens"] = request["dtype"], request["max_new_tokens"]
    write_json(args.output, record)
    a = record["acceptance_length"]
    log.info("vLLM %s: acceptance length %s macro (ours %s, %+.1f %%), %s pooled (ours %s); "
             "batch 1 %sx the target alone", record["vllm"], a["vllm_macro"], a["ours_macro"],
             a["diff_pct_macro"] or 0.0, a["vllm_pooled"], a["ours_pooled"],
             record["tokens_per_s"]["1"]["speedup"])  # fmt: skip


def summary_section(record: dict) -> str:
    """The paragraph and table `results/summary.md` gives vLLM's figures."""
    a, speed = record["acceptance_length"], record["tokens_per_s"]
    walked = record.get("on_vllm_text")  # absent from records before the walk

    def pct(x):
        return "–" if x is None else f"{x:+.1f} %"

    lines = [
        f"**Served by vLLM {record['vllm']}** (`eval/vllm.json`; its DFlash method, each prompt "
        "alone, acceptance length from vLLM's own counters): "
        f"{a['vllm_macro']} macro / {a['vllm_pooled']} pooled against this evaluation's τ "
        f"{a['ours_macro']:.3f} / {a['ours_pooled']:.3f} ({pct(a['diff_pct_macro'])} / "
        f"{pct(a['diff_pct_pooled'])}); outputs identical to vLLM's target alone on "
        f"{100 * record['identical_to_target_alone']:.0f} % of prompts; tokens/s over vLLM's "
        "target alone: "
        + ", ".join(
            f"{'batch 1' if c == '1' else f'concurrency {c}'} {s['speedup']:.2f}x "
            f"({s['dflash']:.0f} against {s['target']:.0f})"
            # JSON sorts the keys as text (1, 32, 8): order them as numbers
            for c, s in sorted(speed.items(), key=lambda item: int(item[0]))
        )
        + ".",
        "",
        "| eval set | prompts | vLLM macro | ours | diff | vLLM pooled | ours | diff |"
        + (" ours on vLLM's tokens | diff |" if walked else ""),
        "|---|---|---|---|---|---|---|---|" + ("---|---|" if walked else ""),
    ]
    for name, s in record["sets"].items():
        lines.append(
            f"| {name} | {s['prompts']} | {s['vllm_macro']} | {s['ours_macro']} | "
            f"{pct(s['diff_pct_macro'])} | {s['vllm_pooled']} | {s['ours_pooled']} | "
            f"{pct(s['diff_pct_pooled'])} |"
            + (f" {s['ours_on_vllm_text']} | {pct(s['diff_pct_same_tokens'])} |" if walked else "")
        )
    if walked:
        lines += [
            "",
            f"Our drafter's τ on exactly the tokens vLLM emitted (the decoding walk, "
            f"{walked['walked_prompts']} prompts): {walked['ours_on_vllm_text']} macro against "
            f"vLLM's {walked['vllm_on_its_text']} ({pct(walked['diff_pct_same_tokens'])}): the "
            "engines' arithmetic alone. The columns before compare τ on each engine's own text.",
        ]
    if same := record.get("same_text"):
        lines += [
            "",
            f"On the {same['prompts']} of {same['of']} prompts where vLLM decoded exactly our "
            f"drafter's text, acceptance length {same['vllm_macro']} (vLLM) against "
            f"{same['ours_macro']} (ours), macro; elsewhere the texts parted at a near tie and τ "
            f"was judged on other tokens. vLLM's target alone decoded our target's text on "
            f"{same['target_alone_same']} of {same['of']} prompts.",
        ]
    for run in record.get("sampled", []):
        lines += [
            "",
            f"At temperature {run['temperature']} (top-p {run['top_p']}, top-k "
            f"{run['top_k'] or 'all'}), vLLM's `{run['draft_rule']}` draft rule, each set's "
            f"prompts together over {run['seeds']} seeds: acceptance length {run['vllm_pooled']}"
            f" pooled against ours {run['ours_pooled']} ({pct(run['diff_pct_pooled'])}); "
            + ", ".join(
                f"{n} {s['vllm_pooled']} / {s['ours_pooled']} ({pct(s['diff_pct_pooled'])})"
                for n, s in run["sets"].items()
            )
            + ".",
        ]
    return "\n".join(lines) + "\n"
