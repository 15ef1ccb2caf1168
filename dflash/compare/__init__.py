"""`dflash compare RUN_A RUN_B`: why is run B different from run A?

Lists the effects (training throughput and its per-role split, τ), then every recorded cause
(topology, environment, code, config, data), ranked by how likely each is to explain the largest
effect, and ends with the most likely cause and its evidence. A run is a MANIFEST.json or a
results folder; a folder without one (e.g. after `snakemake train`) is read from its stage
manifests, which record code and environment at the time each stage ran.
"""

from __future__ import annotations

import json
import sys

from dflash.compare.causes import causes
from dflash.compare.evidence import NOISE, describe_change, effects, load_run
from dflash.record import VOLATILE

__all__ = ["compare", "load_run", "render", "run"]


def recorded_files(record: dict) -> dict[str, str]:
    """The artefacts and each input's files (keyed NAME/path: the target's as target/hf/...)."""
    files = dict(record.get("artefacts") or {})
    for name, entry in (record.get("inputs") or {}).items():
        files.update({f"{name}/{rel}": digest for rel, digest in entry["sha256"].items()})
    return files


def compare(a: dict, b: dict) -> dict:
    effs = effects(a, b)
    real = [
        e
        for e in effs
        if e["metric"] in NOISE and abs(e["change_pct"] or 0) / 100 >= NOISE[e["metric"]]
    ]
    # Explain each real effect, largest first; rank the cause list for the largest one (with
    # none, for throughput: what people chase).
    real.sort(key=lambda e: -abs(e["change_pct"]) / 100 / NOISE[e["metric"]])
    explanations = []
    for effect in real:
        top = next(iter(causes(a, b, effect["metric"], effect["change_pct"])), None)
        explanations.append(
            {
                "effect": effect["metric"],
                "change_pct": effect["change_pct"],
                "cause": top["kind"] if top else None,
                "summary": top["summary"]
                if top
                else "no recorded cause: run-to-run noise, or something the record cannot see "
                "(a slower filesystem or network, another node's load)",
                "evidence": effect["evidence"],
            }
        )
    ranked = causes(
        a, b, *((real[0]["metric"], real[0]["change_pct"]) if real else ("throughput",))
    )
    fa, fb = recorded_files(a), recorded_files(b)
    if not (fa and fb):  # a partial record has none: nothing to compare file by file
        fa = fb = {}
    differ = sorted(k for k in set(fa) & set(fb) if fa[k] != fb[k])
    timed = {v.split(".", 1)[1] for v in VOLATILE if v.startswith("artefacts.")}
    return {
        "a": a.get("_name"),
        "b": b.get("_name"),
        "effects": effs,
        "causes": ranked,
        "most_likely": explanations,
        "artefacts": {
            "differ": [k for k in differ if k not in timed],
            "differ_timed": [k for k in differ if k in timed],
            "only_a": sorted(set(fa) - set(fb)),
            "only_b": sorted(set(fb) - set(fa)),
        },
    }


def render(result: dict) -> str:
    lines = [f"A: {result['a']}", f"B: {result['b']}", ""]
    lines.append("Effects")
    if not result["effects"]:
        lines.append("  (no throughput or τ recorded in both runs)")
    for e in result["effects"]:
        lines.append(f"  {e['label']}: {describe_change(e['a'], e['b'])}")
        lines += [f"    {x}" for x in e["evidence"]]
    lines += ["", "Causes, most likely first"]
    if not result["causes"]:
        lines.append("  none: same code, environment, config, topology and data")
    for i, c in enumerate(result["causes"], 1):
        lines.append(f"  {i}. {c['kind']:<11} {c['summary']}")
        if len(c["details"]) > 1:
            lines += [f"       - {d}" for d in c["details"][:20]]
    art = result["artefacts"]
    if any(art.values()):
        lines += [
            "",
            f"Artefacts: {len(art['differ'])} differ in content, {len(art['only_a'])} only in A,"
            f" {len(art['only_b'])} only in B; {len(art['differ_timed'])} differ in files that"
            " hold timings",
        ]
        lines += [f"  {p}" for p in art["differ"][:12]]
    lines.append("")
    for verdict in result["most_likely"]:
        name = {"tau": "τ"}.get(verdict["effect"], verdict["effect"])
        lines.append(
            f"Most likely cause of the {name} change ({verdict['change_pct']:+.1f} %):"
            f" {verdict['cause'] or 'unknown'}: {verdict['summary']}"
        )
        if verdict["evidence"]:
            lines.append("  Evidence: " + "; ".join(verdict["evidence"]))
    if not result["most_likely"]:
        lines.append("No throughput or τ change beyond run-to-run noise.")
    return "\n".join(lines) + "\n"


def run(args) -> None:
    result = compare(load_run(args.run_a), load_run(args.run_b))
    if args.json:
        json.dump(result, sys.stdout, indent=1, ensure_ascii=False)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(render(result))
