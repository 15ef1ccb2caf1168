"""`dflash plan`: the time to a drafter, stage by stage, before anything runs.

    dflash plan --target qwen3-8b --samples 800000 --epochs 6 --gpus 8

Regeneration, tokenization, compile warmup, training and evaluation, each from a rate measured
on these machines (`dflash.plan.rates`, every entry with its source) or from a finished run's
own files (`--from-run`), and each labelled: "measured" at these shapes on this GPU kind, or
"projected" from a measurement, saying from which and how (`dflash.plan.stages`; the formulas in
docs/plan.md). Imports no torch: it answers in a blink.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

from dflash.errors import UserError
from dflash.plan.basis import Plan
from dflash.plan.from_run import run_rates, run_settings, target_config
from dflash.plan.rates import PRESETS, RATES
from dflash.plan.shapes import (
    Data,
    Drafter,
    Shape,
    assumed_shape,
    data_from_stats,
    preset_name,
    resolve_target,
)
from dflash.plan.stages import summarize

# What a plan assumes of the data when nothing says otherwise (the public recipe's size; its
# mean lengths are not published with it: these are assumptions, printed as such).
SAMPLES, PROMPT_TOKENS, NEW_TOKENS = 800_000, 256, 1024
# The schema's defaults (workflow/schemas/config.schema.yaml) for what a plan depends on.
DEFAULTS = {
    "epochs": 1,
    "anchors": 512,
    "drafter_layers": 5,
    "block_size": 16,
    "max_length": 2048,
    "buckets": 3,  # data.buckets [512, 1024, 2048]
}


def target_of(args) -> tuple[str, Shape, str, dict | None]:
    """(name, shape, source) of the plan's target, and the run's target config for --from-run."""
    run_cfg = None
    if args.from_run:
        path = target_config(Path(args.from_run))
        if path.is_file():
            run_cfg = json.loads(path.read_text())
        elif not (args.target or args.params):
            raise UserError(f"--from-run: no {path}; name the run's target with --target")
    if args.params:
        if args.params < 1e7:
            raise UserError(f"--params: expected a parameter count such as 70e9, got {args.params}")
        label = "an assumed Qwen3-like shape (--params; dflash.plan.shapes.assumed_shape)"
        return f"{args.params / 1e9:g}B parameters", assumed_shape(args.params), label, run_cfg
    if args.target:
        return (*resolve_target(args.target), run_cfg)
    if not args.from_run:
        raise UserError("--target: name a target (a preset, a HF folder, or --params N)")
    where = str(target_config(Path(args.from_run)))
    shape = Shape.from_config(run_cfg, where)
    return preset_name(shape) or "the run's target", shape, where, run_cfg


def data_of(args) -> Data:
    if args.stats:
        data = data_from_stats(Path(args.stats))
    elif args.from_run and args.prompt_tokens is None and args.new_tokens is None:
        data = data_from_stats(Path(args.from_run) / "data/stats/stats.json", "--from-run")
    else:
        assumed = args.prompt_tokens is None and args.new_tokens is None
        data = Data(
            SAMPLES,
            PROMPT_TOKENS if args.prompt_tokens is None else args.prompt_tokens,
            NEW_TOKENS if args.new_tokens is None else args.new_tokens,
            "assumed means: set --prompt-tokens, --new-tokens" if assumed else "given",
        )
    if args.samples is not None:
        data = Data(args.samples, data.prompt_tokens, data.new_tokens, data.source)
    if data.samples < 1 or data.new_tokens <= 0 or data.prompt_tokens < 0:
        raise UserError(
            f"--samples, --prompt-tokens, --new-tokens: need at least one sample and new token, "
            f"got {data.samples} samples of {data.prompt_tokens} + {data.new_tokens} tokens"
        )
    return data


def topology_of(value: str | None, gpus: int) -> tuple[int, int]:
    """(targets, drafters): --topology T+D, or colocated 0 + --gpus."""
    if value is None:
        if gpus < 1:
            raise UserError(f"--gpus: need at least 1, got {gpus}")
        return 0, gpus
    match = re.fullmatch(r"(\d+)\+(\d+)", value.replace(" ", ""))
    if not match or int(match.group(2)) < 1:
        raise UserError(f"--topology: expected TARGETS+DRAFTERS such as 0+8 or 4+4, got {value!r}")
    return int(match.group(1)), int(match.group(2))


def settings_of(args) -> dict:
    """Each setting: its flag, else the run's (--from-run), else the default."""
    run = run_settings(Path(args.from_run)) if args.from_run else {}
    out = {}
    for key, default in DEFAULTS.items():
        given = getattr(args, key)
        out[key] = given if given is not None else run.get(key, default)
        if out[key] < 1:
            raise UserError(f"--{key.replace('_', '-')}: need at least 1, got {out[key]}")
    if "max_new_tokens" in run:  # the run's regeneration cap, unless --max-new-tokens
        out["max_new_tokens"] = run["max_new_tokens"]
    return out


def build(args) -> Plan:
    name, shape, source, run_cfg = target_of(args)
    rates = list(RATES)
    if args.from_run:  # the run's own measurements come first
        run_target = run_cfg or (PRESETS.get(name) or shape.config())
        rates = run_rates(Path(args.from_run), run_target) + rates
    data = data_of(args)
    targets, drafters = topology_of(args.topology, args.gpus)
    s = settings_of(args)
    return Plan(
        name=name,
        shape=shape,
        target_source=source,
        data=data,
        epochs=s["epochs"],
        gpus=targets + drafters,
        gpu=args.gpu,
        targets=targets,
        drafter=Drafter(s["drafter_layers"], s["block_size"], s["anchors"]),
        max_length=s["max_length"],
        buckets=s["buckets"],
        regen_batch=args.regen_batch,
        max_new_tokens=args.max_new_tokens
        or s.get("max_new_tokens")
        or 2 * 128 * math.ceil(data.new_tokens / 128),
        eval_prompts=args.eval_prompts,
        eval_new_tokens=args.eval_new_tokens,
        checkpoints=args.checkpoints,
        rates=rates,
    )


def duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 2 * 3600:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def count(n: float) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def render(s: dict) -> str:
    t, d, g, dr = s["target"], s["data"], s["gpus"], s["drafter"]
    kind = g["kind"].upper() + ("" if g["kind"] == "h200" else " (datasheet ratios to an H200)")
    lines = [
        f"target   {t['name']} ({t['source']}): {t['params'] / 1e9:.2f}B parameters, "
        f"{t['forward_flops_per_token'] / 1e9:.1f} GFLOP a token forward",
        f"data     {d['samples']:,} samples x ({d['prompt_tokens']:,.0f} prompt + "
        f"{d['new_tokens']:,.0f} new tokens; {d['source']}), {s['epochs']} epoch"
        f"{'s' * (s['epochs'] > 1)}: {count(d['training_tokens'])} training tokens",
        f"drafter  {dr['layers']} layers, block {dr['block_size']}, {dr['anchors']} anchors",
        f"GPUs     {g['count']} x {kind}, topology {g['topology']}",
        "",
        f"{'stage':<16}{'time':>10}  {'basis':<10} rate",
    ]
    for f in s["stages"]:
        lines.append(f"{f['stage']:<16}{duration(f['seconds']):>10}  {f['basis']:<10} {f['rate']}")
    lines += [f"{'total':<16}{duration(s['total_s']):>10}  ({s['total_note']})", ""]
    for f in s["stages"]:
        lines += [f"{f['stage']} ({f['basis']}): {f['how']}", f"    source: {f['source']}"]
    return "\n".join(lines)


def run(args) -> None:
    summary = summarize(build(args))
    print(json.dumps(summary, indent=2) if args.json else render(summary))
