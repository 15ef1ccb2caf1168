"""The recorded causes of a difference between two runs (topology, environment, code, config,
data, host), each weighted by how strongly it can move the effect in question."""

from __future__ import annotations

from dflash.compare.evidence import describe_change, dig, fmt, is_number, pct_change
from dflash.config import flatten
from dflash.stages import TRAINING_CONFIG

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
# One-second CPU samples the busier run needs before its share of other work counts as a busier
# host: a run of a few steps has one to three, which catch whatever else happened to start in
# them (two 3-step test runs read 0 % and 43 % on one machine). A quiet reading needs no such
# length: a test's 2-sample quiet run against 11 samples at 81 % beside busy loops is a busier host.
MIN_CPU_SAMPLES = 5

# Code and config that cannot touch training (evaluation, reporting, file locations).
EVAL_ONLY_CODE = ("dflash/eval/", "dflash/record.py", "dflash/compare/", "dflash/verify.py")
INERT_CONFIG = ("results", "resources", "cache_dir", "compile.cache_dir", "data.previous_stats")


def topology_cause(a, b) -> dict | None:
    ta, tb = a.get("topology") or {}, b.get("topology") or {}
    if not ta or not tb:
        return None  # not recorded on one side: unknown, not changed
    # records from before target sharding had one rank per target
    ta, tb = {"target_shards": 1} | ta, {"target_shards": 1} | tb
    keys = ("drafters", "targets", "target_shards", "nnodes", "device")
    changed = [k for k in keys if ta.get(k) != tb.get(k)]
    if not changed:
        return None
    details = [f"{k}: {fmt(ta.get(k))} → {fmt(tb.get(k))}" for k in changed]
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
            details.append(f"GPU {name} {fmt(ga.get(name))} → {fmt(gb.get(name))}")
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
    fa, fb = _shared_keys(a, b, dig(a, "code.files") or {}, dig(b, "code.files") or {})
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
    ca, cb = flatten(a.get("config") or {}), flatten(b.get("config") or {})
    ca, cb = _shared_keys(a, b, ca, cb, within=TRAINING_CONFIG)
    keys = [
        k
        for k in sorted(set(ca) | set(cb))
        if ca.get(k) != cb.get(k) and not k.startswith("train.topology")
    ]
    if not keys:
        return None
    details = [f"{k}: {fmt(ca.get(k))} → {fmt(cb.get(k))}" for k in keys]
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
            details.append(f"{label} {describe_change(da.get(key), db.get(key))}")
    for key in ("mean", "p50", "p90", "p99", "max"):
        va, vb = dig(da, f"length.{key}"), dig(db, f"length.{key}")
        if va != vb:
            details.append(f"{key} length {describe_change(va, vb)}")
    sa, sb = da.get("bucket_shares") or {}, db.get("bucket_shares") or {}
    for bucket in sorted(set(sa) | set(sb), key=lambda s: int(s.split("-")[0])):
        if sa.get(bucket) != sb.get(bucket):
            details.append(
                f"bucket {bucket} share {sa.get(bucket, 0):.1%} → {sb.get(bucket, 0):.1%}"
            )
    mean_pct = abs(pct_change(dig(da, "length.mean"), dig(db, "length.mean")) or 0)
    # A longer mean length costs throughput superlinearly (attention); 20 % or more is decisive.
    weight = min(1.0, 0.3 + mean_pct / 20)
    return {"kind": "data", "summary": "; ".join(details[:3]), "details": details, "w": weight}


def host_cause(a, b) -> dict | None:
    """Only differences beyond run-to-run noise. `worse` says which way the host moved: +1 if B's
    was busier or slower, -1 if A's was, 0 if both ways; a host that got better cannot explain a
    slowdown."""
    ha, hb = dig(a, "train.throughput.host"), dig(b, "train.throughput.host")
    if not ha or not hb:
        return None  # not recorded on one side: unknown
    details, signs = [], set()
    oa, ob = ha.get("other_cpu_fraction"), hb.get("other_cpu_fraction")
    busier = hb if is_number(oa) and is_number(ob) and ob > oa else ha
    # records from before the count was kept: taken as sampled long enough
    sampled = busier.get("other_cpu_samples", MIN_CPU_SAMPLES) >= MIN_CPU_SAMPLES
    if sampled and is_number(oa) and is_number(ob) and abs(ob - oa) >= BUSIER_HOST:
        details.append(f"CPU time used by other processes {oa:.0%} → {ob:.0%}")
        signs.add(1 if ob > oa else -1)
    ca, cb = ha.get("gpu_sm_clock_fraction"), hb.get("gpu_sm_clock_fraction")
    if is_number(ca) and is_number(cb) and abs(cb - ca) >= SLOWER_CLOCK:
        details.append(f"GPU SM clock {ca:.0%} → {cb:.0%} of its maximum (median)")
        signs.add(1 if cb < ca else -1)
    ta, tb = set(ha.get("gpu_throttle") or []), set(hb.get("gpu_throttle") or [])
    if ta != tb:
        details.append(
            f"GPU throttling {', '.join(sorted(ta)) or 'none'} → {', '.join(sorted(tb)) or 'none'}"
        )
        signs.update(([1] if tb - ta else []) + ([-1] if ta - tb else []))
    fa, fb = ha.get("gpu_foreign_processes_max"), hb.get("gpu_foreign_processes_max")
    if is_number(fa) and is_number(fb) and fa != fb:
        details.append(f"other processes on the GPUs {fa} → {fb}")
        signs.add(1 if fb > fa else -1)
    if ha.get("cpus") != hb.get("cpus"):
        details.append(f"CPUs {fmt(ha.get('cpus'))} → {fmt(hb.get('cpus'))}")
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
