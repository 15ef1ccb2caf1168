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
from pathlib import Path

from dflash.errors import UserError
from dflash.io import read_json
from dflash.record import VOLATILE, result_summaries, topology_summary
from dflash.stages import TRAINING_CONFIG
from dflash.verify import manifest_path

# Below this relative change a throughput or τ difference is reported but not explained.
NOISE = {"throughput": 0.05, "tau": 0.01}

# Packages whose version moves GPU kernels or numerics; any other package is a weak suspect.
KEY_PACKAGES = ("torch", "triton", "transformers", "flash-attn", "nvidia-")

# How strongly each kind of change can move throughput or τ (a prior, then scaled below).
RELEVANCE = {
    "topology": {"throughput": 0.95, "tau": 0.5},
    "environment": {"throughput": 0.85, "tau": 0.4},
    "code": {"throughput": 0.8, "tau": 0.8},
    "config": {"throughput": 0.75, "tau": 0.85},
    "data": {"throughput": 0.7, "tau": 0.7},
    # other work on the machine, throttled GPUs: time, not what is computed
    "host": {"throughput": 0.9, "tau": 0.05},
}

# Host differences beyond noise: other processes taking this much more of all CPU time, an SM
# clock this much lower, a new throttle reason or another process on the GPUs.
BUSIER_HOST = 0.25
SLOWER_CLOCK = 0.1

# Code and config that cannot touch training (evaluation, reporting, file locations).
EVAL_ONLY_CODE = ("dflash/eval/", "dflash/record.py", "dflash/compare.py", "dflash/verify.py")
INERT_CONFIG = ("results", "cache_dir", "compile.cache_dir", "data.previous_stats")


# ---------------------------------------------------------------------------------- loading


def load_run(run: str | Path) -> dict:
    path = manifest_path(run)
    if path.is_file():
        try:
            record = read_json(path)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise UserError(f"compare: {path} is not a run record: {e}") from None
        record["_name"] = str(path)
        return record
    folder = Path(run)
    if not (folder / "manifests").is_dir():
        raise UserError(f"compare: {run} is neither a MANIFEST.json nor a results folder")
    return record_from_stages(folder)


def record_from_stages(results: Path) -> dict:
    """A partial record from a results folder that has no MANIFEST.json yet."""
    stages = {p.stem: read_json(p) for p in sorted((results / "manifests").glob("*.json"))}
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


# ---------------------------------------------------------------------------------- helpers


def _get(record: dict, dotted: str):
    for key in dotted.split("."):
        if not isinstance(record, dict) or key not in record:
            return None
        record = record[key]
    return record


def _flatten(obj, prefix="") -> dict:
    if isinstance(obj, dict) and obj:
        out = {}
        for k, v in obj.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: obj}


def _number(v) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _pct(a, b) -> float | None:
    if not _number(a) or not _number(b) or a == 0:
        return None
    return round(100 * (b - a) / abs(a), 1)


def _fmt(v) -> str:
    if isinstance(v, bool) or v is None:
        return str(v)
    if isinstance(v, float):
        return f"{v:,.4g}" if abs(v) < 1000 else f"{v:,.0f}"
    if isinstance(v, int):
        return f"{v:,}"
    return json.dumps(v) if isinstance(v, dict | list) else str(v)


def _change(a, b) -> str:
    pct = _pct(a, b)
    return f"{_fmt(a)} → {_fmt(b)}" + (f" ({pct:+.1f} %)" if pct is not None else "")


# ---------------------------------------------------------------------------------- effects


def effects(a: dict, b: dict) -> list[dict]:
    out = []
    ta, tb = _get(a, "train.throughput") or {}, _get(b, "train.throughput") or {}
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
                evidence.append(f"{label}: {_change(va, vb)}")
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
                "change_pct": _pct(ta["tokens_per_s"], tb["tokens_per_s"]),
                "evidence": evidence,
            }
        )
    qa, qb = _get(a, "eval.quality.tau_macro.drafter"), _get(b, "eval.quality.tau_macro.drafter")
    if qa is not None and qb is not None:
        evidence = []
        for key in ("tau_pooled.drafter", "tau_sim", "teacher_forced_tau", "lossless"):
            va, vb = _get(a, f"eval.quality.{key}"), _get(b, f"eval.quality.{key}")
            if va != vb:
                evidence.append(f"{key.split('.')[0]}: {_change(va, vb)}")
        out.append(
            {
                "metric": "tau",
                "label": "τ (acceptance length, macro mean over prompts)",
                "a": qa,
                "b": qb,
                "change_pct": _pct(qa, qb),
                "evidence": evidence,
            }
        )
    la, lb = _get(a, "train.result.loss"), _get(b, "train.result.loss")
    if la is not None and lb is not None and la != lb:
        out.append(
            {
                "metric": "loss",
                "label": "final training loss",
                "a": la,
                "b": lb,
                "change_pct": _pct(la, lb),
                "evidence": [],
            }
        )
    return out


# ---------------------------------------------------------------------------------- causes


def topology_cause(a, b) -> dict | None:
    ta, tb = a.get("topology") or {}, b.get("topology") or {}
    if not ta or not tb:
        return None  # not recorded on one side: unknown, not changed
    changed = [k for k in ("drafters", "targets", "nnodes", "device") if ta.get(k) != tb.get(k)]
    if not changed:
        return None
    details = [f"{k}: {_fmt(ta.get(k))} → {_fmt(tb.get(k))}" for k in changed]
    weight = 1.0 if "drafters" in changed or "targets" in changed else 0.8
    return {"kind": "topology", "summary": ", ".join(details), "details": details, "w": weight}


def environment_cause(a, b) -> dict | None:
    ea, eb = a.get("environment") or {}, b.get("environment") or {}
    if not ea or not eb:
        return None  # not recorded on one side (an older results folder): unknown
    details, key = [], False
    for name in ("python", "torch", "cuda", "cudnn", "transformers", "snakemake"):
        if ea.get(name) != eb.get(name):
            details.append(f"{name} {ea.get(name)} → {eb.get(name)}")
            key = key or name != "snakemake"
    ga, gb = ea.get("gpus") or {}, eb.get("gpus") or {}
    for name in ("count", "models", "driver"):
        if ga.get(name) != gb.get(name):
            details.append(f"GPU {name} {_fmt(ga.get(name))} → {_fmt(gb.get(name))}")
            key = True
    pa, pb = ea.get("packages") or {}, eb.get("packages") or {}
    if not pa or not pb:
        pa = pb = {}
    shown = {"torch", "transformers", "snakemake"}
    for name in sorted(set(pa) | set(pb)):
        if name in shown or pa.get(name) == pb.get(name):
            continue
        details.append(f"{name} {pa.get(name, '(absent)')} → {pb.get(name, '(absent)')}")
        key = key or name.startswith(KEY_PACKAGES)
    if not details:
        return None
    summary = "; ".join(details[:4]) + (
        f"; and {len(details) - 4} more" if len(details) > 4 else ""
    )
    return {"kind": "environment", "summary": summary, "details": details, "w": 1 if key else 0.3}


def _shared_keys(a: dict, b: dict, fa: dict, fb: dict, within=()) -> tuple[dict, dict]:
    """A partial record (from stage manifests) knows only part of the code and config: compare
    what both know (for config, only the keys the train stage reads)."""
    if not (a.get("partial") or b.get("partial")):
        return fa, fb
    keys = {
        k
        for k in set(fa) & set(fb)
        if not within or any(k == w or k.startswith(w + ".") for w in within)
    }
    return {k: fa[k] for k in keys}, {k: fb[k] for k in keys}


def code_cause(a, b) -> dict | None:
    fa, fb = _shared_keys(a, b, _get(a, "code.files") or {}, _get(b, "code.files") or {})
    changed = sorted(f for f in set(fa) & set(fb) if fa[f] != fb[f])
    added, removed = sorted(set(fb) - set(fa)), sorted(set(fa) - set(fb))
    if not (changed or added or removed):
        return None
    details = (
        [f"changed {f}" for f in changed]
        + [f"only in B {f}" for f in added]
        + [f"only in A {f}" for f in removed]
    )
    touched = changed + added + removed
    ran = _stage_files(a) | _stage_files(b)
    if ran["train"] or ran["any"]:
        training = [f for f in touched if f in ran["train"]]
        measured = [f for f in touched if f in ran["any"]]
    else:  # records without per-stage module lists: judge by path
        training = [f for f in touched if not f.startswith(EVAL_ONLY_CODE)]
        measured = [f for f in touched if not f.startswith(EVAL_ONLY_CODE[1:])]
    summary = f"{len(touched)} file(s): " + ", ".join(touched[:5])
    if len(touched) > 5:
        summary += f", and {len(touched) - 5} more"
    return {
        "kind": "code",
        "summary": summary,
        "details": details,
        # throughput: only modules the train stage ran; τ: modules any stage ran (data, training
        # or evaluation); the rest (record, compare, CLI wiring, workflow files) barely count
        "w": 1.0 if training else 0.2,
        "w_tau": 1.0 if measured else 0.2,
    }


def _stage_files(record: dict) -> dict[str, set]:
    """Modules the train stage ran, and modules any stage that shapes the numbers ran."""
    out = {"train": set(), "any": set()}
    for name, stage in (record.get("stages") or {}).items():
        files = set(stage.get("code_files") or [])
        if name == "train":
            out["train"] |= files
        if name not in ("record", "report"):
            out["any"] |= files
    return out


def config_cause(a, b) -> dict | None:
    ca, cb = _flatten(a.get("config") or {}), _flatten(b.get("config") or {})
    ca, cb = _shared_keys(a, b, ca, cb, within=TRAINING_CONFIG)
    keys = [
        k
        for k in sorted(set(ca) | set(cb))
        if ca.get(k) != cb.get(k) and not k.startswith("train.topology")
    ]
    if not keys:
        return None
    details = [f"{k}: {_fmt(ca.get(k))} → {_fmt(cb.get(k))}" for k in keys]
    inert = all(k.startswith(INERT_CONFIG) for k in keys)
    eval_only = all(k.startswith((*INERT_CONFIG, "eval.")) for k in keys)
    return {
        "kind": "config",
        "summary": "; ".join(details[:4])
        + (f"; and {len(details) - 4} more" if len(keys) > 4 else ""),
        "details": details,
        # eval.* defines what τ is measured on, but cannot move training throughput
        "w": 0.1 if eval_only else 1.0,
        "w_tau": 0.1 if inert else 1.0,
    }


def data_cause(a, b) -> dict | None:
    da, db = a.get("data") or {}, b.get("data") or {}
    if not da or not db or da == db:
        return None
    details = []
    for key, label in (("rows", "rows"), ("tokens", "tokens"), ("trainable_tokens", "loss tokens")):
        if da.get(key) != db.get(key):
            details.append(f"{label} {_change(da.get(key), db.get(key))}")
    for key in ("mean", "p50", "p90", "p99", "max"):
        va, vb = _get(da, f"length.{key}"), _get(db, f"length.{key}")
        if va != vb:
            details.append(f"{key} length {_change(va, vb)}")
    sa, sb = da.get("bucket_shares") or {}, db.get("bucket_shares") or {}
    for bucket in sorted(set(sa) | set(sb), key=lambda s: int(s.split("-")[0])):
        if sa.get(bucket) != sb.get(bucket):
            details.append(
                f"bucket {bucket} share {sa.get(bucket, 0):.1%} → {sb.get(bucket, 0):.1%}"
            )
    mean_pct = abs(_pct(_get(da, "length.mean"), _get(db, "length.mean")) or 0)
    # A longer mean length costs throughput superlinearly (attention); 20 % or more is decisive.
    weight = min(1.0, 0.3 + mean_pct / 20)
    return {"kind": "data", "summary": "; ".join(details[:3]), "details": details, "w": weight}


def host_cause(a, b) -> dict | None:
    """Only differences beyond run-to-run noise. `worse` says which way the host moved: +1 if B's
    was busier or slower, -1 if A's was, 0 if both ways; a host that got better cannot explain a
    slowdown."""
    ha, hb = _get(a, "train.throughput.host"), _get(b, "train.throughput.host")
    if not ha or not hb:
        return None  # not recorded on one side: unknown
    details, signs = [], set()
    oa, ob = ha.get("other_cpu_fraction"), hb.get("other_cpu_fraction")
    if _number(oa) and _number(ob) and abs(ob - oa) >= BUSIER_HOST:
        details.append(f"CPU time used by other processes {oa:.0%} → {ob:.0%}")
        signs.add(1 if ob > oa else -1)
    ca, cb = ha.get("gpu_sm_clock_fraction"), hb.get("gpu_sm_clock_fraction")
    if _number(ca) and _number(cb) and abs(cb - ca) >= SLOWER_CLOCK:
        details.append(f"GPU SM clock {ca:.0%} → {cb:.0%} of its maximum (median)")
        signs.add(1 if cb < ca else -1)
    ta, tb = set(ha.get("gpu_throttle") or []), set(hb.get("gpu_throttle") or [])
    if ta != tb:
        details.append(
            f"GPU throttling {', '.join(sorted(ta)) or 'none'} → {', '.join(sorted(tb)) or 'none'}"
        )
        signs.update(([1] if tb - ta else []) + ([-1] if ta - tb else []))
    fa, fb = ha.get("gpu_foreign_processes_max"), hb.get("gpu_foreign_processes_max")
    if _number(fa) and _number(fb) and fa != fb:
        details.append(f"other processes on the GPUs {fa} → {fb}")
        signs.add(1 if fb > fa else -1)
    if ha.get("cpus") != hb.get("cpus"):
        details.append(f"CPUs {_fmt(ha.get('cpus'))} → {_fmt(hb.get('cpus'))}")
    if not details:
        return None
    summary = "; ".join(details)
    worse = (sum(signs) if len(signs) == 1 else 0) if signs else None
    weight = 1.0 if signs else 0.3  # only the CPU count differs: another machine type
    return {"kind": "host", "summary": summary, "details": details, "w": weight, "worse": worse}


def causes(a: dict, b: dict, effect: str, change_pct: float | None = None) -> list[dict]:
    """Recorded causes ranked for one effect; `change_pct` (its sign) lets a host change count
    only in the direction that explains it."""
    found = [
        c
        for c in (
            topology_cause(a, b),
            environment_cause(a, b),
            code_cause(a, b),
            config_cause(a, b),
            data_cause(a, b),
            host_cause(a, b),
        )
        if c
    ]
    for c in found:
        weight = c.pop("w_tau", c["w"]) if effect == "tau" else c["w"]
        c.pop("w", None)
        c.pop("w_tau", None)
        worse = c.pop("worse", None)
        if worse is not None and effect == "throughput" and change_pct:
            if worse == 0:
                weight *= 0.5  # the host moved both ways
            elif (worse > 0) != (change_pct < 0):
                weight *= 0.1  # e.g. a quieter host beside a slowdown
        c["score"] = round(RELEVANCE[c["kind"]][effect] * weight, 3)
    return sorted(found, key=lambda c: -c["score"])


# ---------------------------------------------------------------------------------- compare


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
    fa, fb = a.get("artefacts") or {}, b.get("artefacts") or {}
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
        lines.append(f"  {e['label']}: {_change(e['a'], e['b'])}")
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
