"""results/eval/sglang.json: the run's drafter in SGLang, its DFlash worker's acceptance length
beside ours, as eval_vllm sets vLLM's (the comparison is `dflash.eval.served`'s).

Two engines, each in a process of its own (`dflash.eval.sglang_serve`): the target alone, then
the target with the drafter (`speculative_algorithm="DFLASH"`). Every prompt is decoded alone
(batch 1; a later turn after the engine's own answer), and its meta_info gives that prompt's
verify rounds and answer length: (completion tokens - 1) / verify rounds is tokens committed per
verify round after the prompt's own forward, the τ our evaluation reports (SGLang's own
`spec_accept_length` also counts the prefill's token: kept beside it, per prompt). Then tokens/s
in waves of each `eval.sglang.concurrency`, our drafter's τ on exactly SGLang's answers (the
decoding walk), and at each temperature of eval.sampling, each set's prompts together per seed,
pooled beside eval/sampling.json's `drafter` (SGLang drafts with the drafter's argmax: the
greedy draft rule only).

SGLang 0.5.17 pins transformers 5.12.1 and flashinfer 0.6.15.post1, not the run's or vLLM's
versions: `eval.sglang.site`, a folder its wheels were installed in (`pip install --target`),
goes first on the engine processes' path alone, without any folder that holds vLLM.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import tempfile
from pathlib import Path

from dflash.config import expand_user
from dflash.errors import UserError
from dflash.eval import served as shared
from dflash.eval.served import base_request, log_result, serve_in_process, walk_served
from dflash.eval.served_report import summary_section as engine_section
from dflash.io import read_json, write_json

log = logging.getLogger(__name__)
ENGINE = "sglang"
HOW = (
    "its DFLASH worker, each prompt alone, acceptance length from each request's meta_info: "
    "answer tokens after the prefill's first over verify rounds"
)


def sglang_installed(site: str | None) -> bool:
    """SGLang importable by the engine processes: from `site` where given, else from here."""
    if site:
        return (expand_user(site) / "sglang" / "__init__.py").is_file()
    return importlib.util.find_spec("sglang") is not None


def engine_env(site: str | None, environ: dict | None = None) -> dict:
    """The engine processes' environment: `site` first on PYTHONPATH, and no folder there that
    holds vLLM (SGLang imports vLLM where it finds it, and vLLM's bundle pins other versions of
    the packages both use)."""
    env = dict(os.environ if environ is None else environ)
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    kept = [p for p in paths if not (expand_user(p) / "vllm" / "__init__.py").is_file()]
    first = [str(expand_user(site))] if site else []
    env["PYTHONPATH"] = os.pathsep.join(first + kept)
    return env


def compare(served: dict, target_alone: dict, acceptance: dict, stop, walked=None) -> dict:
    """SGLang's figures beside the evaluation's, and SGLang's own way of counting per prompt."""
    record = shared.compare(served, target_alone, acceptance, stop, walked, ENGINE)
    record["per_prompt"]["sglang_reported"] = [r["sglang_accept_length"] for r in served["prompts"]]
    record["server_args"] = served.get("server_args")
    return record


def compare_sampled(served: dict, ours: dict | None) -> list[dict]:
    """At each temperature, SGLang's acceptance length pooled over sets and seeds beside ours
    (the greedy draft rule); a caveat where SGLang verified greedily instead of sampling."""
    runs = shared.compare_sampled({"greedy": served.get("sampled", [])}, ours, ENGINE)
    if runs and served.get("sampling_verify") is False:
        for run in runs:
            run["caveat"] = (
                "SGLang verified these requests greedily (no DFlash sampling verification in "
                "its build): not a figure at temperature."
            )
    return runs


def run(args) -> None:
    config = args.config
    settings = config["eval"]["sglang"]
    if not sglang_installed(settings["site"]):
        where = f"in eval.sglang.site ({settings['site']})" if settings["site"] else "here"
        raise UserError(
            f"eval_sglang: SGLang is not installed {where} (`import sglang` fails). Install "
            "sglang==0.5.17 (docs/serving.md; tools/gpu-box/sglang-wheels.sh lists its wheels), "
            "or set eval.sglang.enabled: false"
        )
    request, specs = base_request(args, config)
    request |= {k: settings[k] for k in ("concurrency", "context_length", "mem_fraction_static")}
    greedy = specs if "greedy" in config["eval"]["sampling"]["draft_rules"] else []
    env = engine_env(settings["site"])
    with tempfile.TemporaryDirectory(prefix="eval-sglang-") as tmp:
        module, folder = "dflash.eval.sglang_serve", Path(tmp)
        alone = serve_in_process(module, {**request, "drafter": None}, folder, "target alone", env)
        with_drafter = {**request, "sampling": greedy}
        served = serve_in_process(module, with_drafter, folder, "target with the drafter", env)
    acceptance = read_json(args.acceptance)
    walked = walk_served(args, config, served["prompts"])
    record = compare(served, alone, acceptance, set(request["eos_ids"]), walked)
    if greedy:
        sampled = read_json(args.sampling) if args.sampling else None
        record["sampled"] = compare_sampled(served, sampled)
    record["sampling_verify"] = served.get("sampling_verify")
    record["dtype"], record["max_new_tokens"] = request["dtype"], request["max_new_tokens"]
    write_json(args.output, record)
    log_result(record, ENGINE, "SGLang")


def summary_section(record: dict) -> str:
    """The paragraph and table `results/summary.md` gives SGLang's figures."""
    return engine_section(record, ENGINE, "SGLang", HOW)
