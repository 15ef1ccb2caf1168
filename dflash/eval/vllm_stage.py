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
beside vLLM's, leaving only the engines' arithmetic between them. The comparison itself is
`dflash.eval.served`'s, which eval_sglang shares.
"""

from __future__ import annotations

import importlib.util
import logging
import tempfile
from pathlib import Path

from dflash.config import TEMPERATURES_ONLY_WITHOUT_ONE
from dflash.errors import UserError
from dflash.eval import served as shared
from dflash.eval.served import (
    acceptance_length,
    base_request,
    log_result,
    serve_in_process,
    walk_served,
)
from dflash.eval.served_report import summary_section as engine_section
from dflash.io import read_json, write_json

__all__ = ["acceptance_length", "compare", "compare_sampled", "run", "same_text", "walk_served"]

log = logging.getLogger(__name__)
ENGINE = "vllm"


def vllm_installed() -> bool:
    return importlib.util.find_spec("vllm") is not None


def compare(served, target_alone, acceptance, stop, walked=None) -> dict:
    """vLLM's figures beside the evaluation's (`dflash.eval.served.compare`)."""
    return shared.compare(served, target_alone, acceptance, stop, walked, ENGINE)


def same_text(rows, alone, ours, stop) -> dict | None:
    return shared.same_text(rows, alone, ours, stop, ENGINE)


def compare_sampled(served: dict[str, list], ours: dict | None) -> list[dict]:
    return shared.compare_sampled(served, ours, ENGINE)


def _serve(request: dict, folder: Path, name: str) -> dict:
    return serve_in_process("dflash.eval.vllm_serve", request, folder, name)


def run(args) -> None:
    config = args.config
    settings = config["eval"]["vllm"]
    if not vllm_installed():
        raise UserError(
            "eval_vllm: vLLM is not installed here (`import vllm` fails). Install it (docs/"
            "serving.md says which version serves DFlash drafters) or set eval.vllm.enabled: false"
        )
    request, specs = base_request(args, config)
    request |= {
        "concurrency": settings["concurrency"],
        "max_model_len": settings["max_model_len"],
        "gpu_memory_utilization": settings["gpu_memory_utilization"],
    }
    rules = [r for r in config["eval"]["sampling"]["draft_rules"] if specs]
    if not settings["greedy"]:
        if not specs:
            raise UserError(TEMPERATURES_ONLY_WITHOUT_ONE)
        write_json(args.output, sampled_only(request, specs, rules, args))
        return
    with tempfile.TemporaryDirectory(prefix="eval-vllm-") as tmp:
        alone = _serve({**request, "drafter": None}, Path(tmp), "target alone")
        # the greedy draft rule's engine also gives the sampled figures of that rule
        greedy = specs if "greedy" in rules else []
        served = _serve({**request, "sampling": greedy}, Path(tmp), "target with the drafter")
        if "probabilistic" in rules:  # an engine of its own: the rule is the engine's setting
            drawn = _serve(probabilistic(request, specs), Path(tmp), PROBABILISTIC)
    acceptance = read_json(args.acceptance)
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
    log_result(record, ENGINE, "vLLM")


PROBABILISTIC = "drafter with probabilistic drafts"


def probabilistic(request: dict, specs: list[dict]) -> dict:
    """The request of the engine that draws its drafts from the drafter: sampled figures only
    (the draft rule is an engine setting, so it cannot share the greedy rule's engine)."""
    return {**request, "sampling": specs, "prompts_alone": False,
            "draft_sample_method": "probabilistic"}  # fmt: skip


def sampled_only(request: dict, specs: list[dict], rules: list[str], args) -> dict:
    """eval.vllm.greedy: false: each draft rule's engine at eval.sampling's temperatures alone,
    beside eval_sampling's figures; no target-alone engine, no greedy pass."""
    served, startup = {}, {}
    with tempfile.TemporaryDirectory(prefix="eval-vllm-") as tmp:
        if "greedy" in rules:
            only = {**request, "sampling": specs, "prompts_alone": False}
            out = _serve(only, Path(tmp), "target with the drafter")
            served["greedy"], startup["greedy"] = out["sampled"], out["startup_s"]
        if "probabilistic" in rules:
            out = _serve(probabilistic(request, specs), Path(tmp), PROBABILISTIC)
            served["probabilistic"], startup["probabilistic"] = out["sampled"], out["startup_s"]
    record = {
        ENGINE: out[ENGINE],
        "greedy": False,
        "startup_s": startup,
        "sampled": compare_sampled(served, read_json(args.sampling) if args.sampling else None),
        "dtype": request["dtype"],
        "max_new_tokens": request["max_new_tokens"],
    }
    for run in record["sampled"]:
        log.info("vLLM at T=%s, %s drafts: %s pooled, ours %s (%s %%)", run["temperature"],
                 run["draft_rule"], run[f"{ENGINE}_pooled"], run["ours_pooled"],
                 run["diff_pct_pooled"])  # fmt: skip
    return record


def summary_section(record: dict) -> str:
    """The paragraph and table `results/summary.md` gives vLLM's figures."""
    how = "its DFlash method, each prompt alone, acceptance length from vLLM's own counters"
    return engine_section(record, ENGINE, "vLLM", how)
