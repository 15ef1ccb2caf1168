"""What two run records hold: a run loaded from its record (or, without one, from its stage
manifests), and the effects that differ between two runs (training throughput and its per-role
split, τ, the final loss), each with the evidence beside it."""

from __future__ import annotations

import json
from pathlib import Path

from dflash.custody import read_stage_manifest
from dflash.errors import UserError
from dflash.record import read_record, result_summaries, topology_summary
from dflash.verify import manifest_path

# Below this relative change a throughput or τ difference is reported but not explained.
NOISE = {"throughput": 0.05, "tau": 0.01}


def load_run(run: str | Path) -> dict:
    path = manifest_path(run)
    if path.is_file():
        record = read_record(path, "compare")
        record["_name"] = str(path)
        return record
    folder = Path(run)
    if not (folder / "manifests").is_dir():
        raise UserError(f"compare: {run} is neither a MANIFEST.json nor a results folder")
    return record_from_stages(folder)


def record_from_stages(results: Path) -> dict:
    """A partial record from a results folder that has no MANIFEST.json yet."""
    manifests = sorted((results / "manifests").glob("*.json"))
    stages = {p.stem: read_stage_manifest(p) for p in manifests}
    files, config, env = {}, {}, {}
    for m in stages.values():
        files.update(m.get("code_files") or {})
        env = m.get("environment") or env
    train = stages.get("train")
    if train:
        env = train.get("environment") or env  # the stage whose speed is being compared
        config = train["params"]
    record = {"_name": f"{results} (no MANIFEST.json: from stage manifests)", "partial": True}
    record.update({"code": {"files": files}, "environment": env, "config": config})
    record["stages"] = {
        n: {"code_files": sorted(m.get("code_files") or {})} for n, m in stages.items()
    }
    if "train" in config:
        record["topology"] = topology_summary(config["train"])
    record.update(result_summaries(results))
    return record


def dig(record: dict, dotted: str):
    for key in dotted.split("."):
        if not isinstance(record, dict) or key not in record:
            return None
        record = record[key]
    return record


def is_number(v) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def pct_change(a, b) -> float | None:
    if not is_number(a) or not is_number(b) or a == 0:
        return None
    return round(100 * (b - a) / abs(a), 1)


def fmt(v) -> str:
    if isinstance(v, bool) or v is None:
        return str(v)
    if isinstance(v, float):
        return f"{v:,.4g}" if abs(v) < 1000 else f"{v:,.0f}"
    if isinstance(v, int):
        return f"{v:,}"
    return json.dumps(v) if isinstance(v, dict | list) else str(v)


def describe_change(a, b) -> str:
    pct = pct_change(a, b)
    return f"{fmt(a)} → {fmt(b)}" + (f" ({pct:+.1f} %)" if pct is not None else "")


def effects(a: dict, b: dict) -> list[dict]:
    out = []
    ta, tb = dig(a, "train.throughput") or {}, dig(b, "train.throughput") or {}
    if ta.get("tokens_per_s") and tb.get("tokens_per_s"):
        evidence = []
        for key, label in (
            ("tokens_per_s_per_process", "tokens/s per process"),
            ("drafter_capacity_tokens_per_s", "drafter capacity (tokens/s not waiting)"),
            ("target_capacity_tokens_per_s", "target capacity (tokens/s computing)"),
            ("drafter_wait_fraction", "drafters waiting for features"),
            ("target_blocked_fraction", "targets blocked on a full queue"),
            ("mean_queue_depth", "mean queue depth"),
            ("peak_memory_gb", "drafter peak memory GB"),
            ("bottleneck", "bottleneck"),
        ):
            va, vb = ta.get(key), tb.get(key)
            if va == vb:
                continue
            if key.endswith("_fraction") and va is not None and vb is not None:
                evidence.append(f"{label}: {va:.0%} → {vb:.0%}")
            else:
                evidence.append(f"{label}: {describe_change(va, vb)}")
        split_a, split_b = ta.get("time_split") or {}, tb.get("time_split") or {}
        if split_a and split_b:
            share = lambda s, k: round(s.get(k, 0) / max(sum(s.values()), 1e-9), 3)  # noqa: E731
            parts = [
                f"{k} {share(split_a, k):.0%} → {share(split_b, k):.0%}"
                for k in sorted(set(split_a) | set(split_b))
                if abs(share(split_a, k) - share(split_b, k)) >= 0.02
            ]
            if parts:
                evidence.append("drafter time split: " + ", ".join(parts))
        out.append(
            {
                "metric": "throughput",
                "label": "training throughput (tokens/s)",
                "a": ta["tokens_per_s"],
                "b": tb["tokens_per_s"],
                "change_pct": pct_change(ta["tokens_per_s"], tb["tokens_per_s"]),
                "evidence": evidence,
            }
        )
    qa, qb = dig(a, "eval.quality.tau_macro.drafter"), dig(b, "eval.quality.tau_macro.drafter")
    if qa is not None and qb is not None:
        evidence = []
        for key in ("tau_pooled.drafter", "tau_sim", "teacher_forced_tau", "lossless"):
            va, vb = dig(a, f"eval.quality.{key}"), dig(b, f"eval.quality.{key}")
            if va != vb:
                evidence.append(f"{key.split('.')[0]}: {describe_change(va, vb)}")
        ra, rb = dig(a, "eval.quality.reference_sha256"), dig(b, "eval.quality.reference_sha256")
        if ra and rb and ra != rb:
            evidence.append(
                "the target's own greedy output differs (reference_sha256): τ was measured on "
                f"other text (eval dtype {dig(a, 'eval.quality.dtype')} → "
                f"{dig(b, 'eval.quality.dtype')})"
            )
        out.append(
            {
                "metric": "tau",
                "label": "τ (acceptance length, macro mean over prompts)",
                "a": qa,
                "b": qb,
                "change_pct": pct_change(qa, qb),
                "evidence": evidence,
            }
        )
    ca, cb = ta.get("compile_s"), tb.get("compile_s")
    if ca is not None and cb is not None and abs(cb - ca) >= max(10.0, 0.2 * min(ca, cb)):
        out.append(
            {
                "metric": "compile",
                "label": "training's compile pass before its first step (s)",
                "a": ca,
                "b": cb,
                "change_pct": pct_change(ca, cb),
                "evidence": [
                    f"compiled for {max(ca, cb):.0f} s against {min(ca, cb):.0f} s: the slower "
                    "one found the compile cache cold or missed it (results/compile-cache, "
                    "filled by the warmup_compile rule; with it a start takes seconds)"
                ]
                + (
                    [f"first step {sa:.0f} s → {sb:.0f} s after the process started"]
                    if (sa := ta.get("startup_s")) is not None
                    and (sb := tb.get("startup_s")) is not None
                    else []
                ),
            }
        )
    la, lb = dig(a, "train.result.loss"), dig(b, "train.result.loss")
    if la is not None and lb is not None and la != lb:
        out.append(
            {
                "metric": "loss",
                "label": "final training loss",
                "a": la,
                "b": lb,
                "change_pct": pct_change(la, lb),
                "evidence": [],
            }
        )
    return out
