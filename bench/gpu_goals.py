"""`bench/gpu.py`'s verdict: issue 17's goals, each met, not met or not measured, and the table
printed last."""

from __future__ import annotations

from gpu_drafter import PRODUCTION

PIPELINE_BEFORE = 13150  # tokens/s per GPU, 1 + 1 on two H200 (issue 7's run)
GOALS = {  # issue 17
    "mfu": ("drafter step at the first anchors: MFU vs 989 TFLOP/s", 0.62),
    "roofline": ("target features (production): fraction of the roofline", 0.80),
    "warm_start": ("warm start: seconds from process start to the first step", 10.0),
    "pipeline": ("pipeline 1 + 1: tokens/s per GPU (1.25x 13,150)", 1.25 * PIPELINE_BEFORE),
}


def goals(report: dict) -> dict:
    """Issue 17's goals, each with this run's value and whether it is met (None: not measured)."""
    s = report["sections"]
    values = {}
    steps = list(s.get("drafter_step", {}).values())
    if steps:
        values["mfu"] = steps[0]["rows"].get(PRODUCTION, {}).get("mfu")
    target = s.get("target_features", {}).get("rows", {})
    row = next((r for n, r in target.items() if "(production)" in n), {})
    values["roofline"] = row.get("roofline_frac")
    # a real `dflash train` (the pipeline's runs) when there is one, else the warm-start child
    runs = [r for r in s.get("pipeline", {}).get("runs", {}).values() if r.get("startup_s")]
    warm = s.get("warm_start", {})
    if runs:
        values["warm_start"] = max(r["startup_s"] for r in runs)
    elif "process_age_s" in warm:
        values["warm_start"] = warm["process_age_s"]["warm_shapes"]
    run = s.get("pipeline", {}).get("runs", {}).get("1+1", {})
    values["pipeline"] = run.get("tokens_per_s_per_gpu")
    out = {}
    for key, (what, goal) in GOALS.items():
        v = values.get(key)
        lower_is_better = key == "warm_start"
        met = None if v is None else (v <= goal if lower_is_better else v >= goal)
        out[key] = {"goal": what, "target": goal, "value": v, "met": met}
    return out


def table(report: dict) -> str:
    s = report["sections"]
    lines = [
        f"== bench/gpu.py: {report['gpu']} x{report['gpus']}, torch {report['torch']}, "
        f"whole command {report['wall_s']} s; rows {report['lengths']} =="
    ]
    c = s["ceilings"]
    lines.append(
        f"ceilings: bf16 matmul {c['matmul_bf16_tflops']} TFLOP/s, copy {c['copy_tb_s']} TB/s"
    )
    lines.append("")
    lines.append("drafter step (fwd + bwd + clip + AdamW); MFU vs 989 TFLOP/s")
    lines.append(
        f"{'shape':24} {'variant':52} {'step s':>7} {'ctx tok/s':>9} {'TFLOP/s':>7} "
        f"{'MFU':>6} {'peak GB':>7} {'x naive':>7}"
    )
    for key, d in s.get("drafter_step", {}).items():
        for name, r in d["rows"].items():
            if "error" in r:
                lines.append(f"{key:24} {name:52} {r['error']}")
                continue
            lines.append(
                f"{key:24} {name:52} {r['step_s']:7.4f} {r['context_tokens_per_s']:9d} "
                f"{r['tflops']:7.1f} {100 * r['mfu']:5.1f}% {r['peak_gb'] or 0:7.1f} "
                f"{r['speedup_vs_naive']:7.2f}"
            )
    lines.append("")
    ce = s.get("lm_head_ce", {})
    lines.append(
        f"LM-head CE alone, {ce.get('tokens')} tokens x vocab {ce.get('vocab')}, fwd + bwd"
    )
    lines.append(
        f"{'variant':28} {'ms':>8} {'peak GB':>8} {'/ full':>7} {'x full':>7} {'grad err':>9}"
    )
    for name, r in ce.get("rows", {}).items():
        if "error" in r:
            lines.append(f"{name:28} {r['error']}")
            continue
        lines.append(
            f"{name:28} {r['ms']:8.2f} {r['peak_gb'] or 0:8.2f} {r.get('peak_frac_of_full', 0):7.3f} "
            f"{r.get('speedup_vs_full', 0):7.2f} {r.get('grad_rel_err_vs_full', 0):9.1e}"
        )
    lines.append("")
    t = s.get("target_features", {})
    lines.append(f"target features, batch {t.get('batch')}, {t.get('tokens')} real tokens")
    lines.append(
        f"{'variant':62} {'s':>7} {'tok/s':>7} {'TFLOP/s':>8} {'roofline':>8} {'x naive':>7} "
        f"{'err':>8} {'err fp32':>8}"
    )
    for name, r in t.get("rows", {}).items():
        lines.append(
            f"{name:62} {r['s']:7.4f} {r['tokens_per_s']:7d} {r['padded_tflops']:8.1f} "
            f"{100 * r['roofline_frac']:7.1f}% {r['speedup_vs_naive']:7.2f} "
            f"{r.get('rel_err_vs_naive', 0):8.1e} {r.get('rel_err_row0_vs_fp32', 0):8.1e}"
        )
    w = s.get("warm_start")
    if w and "process_age_s" in w:
        lines.append("")
        lines.append(
            f"warm start (a fresh process, this run's cache): process age {w['process_age_s']}; "
            f"first calls {[(r['first_step_s'], r.get('target_layer_s')) for r in w['shapes']]}; "
            f"drafter host init {w['drafter_host_init_s']} s; cache {w['cache_counters']}"
        )
    for name, prof in report.get("profiles", {}).items():
        lines.append(f"profile {name}: device ms {prof['device_ms']}")
    p = s.get("pipeline")
    if p:
        lines.append("")
        est = p["estimate_from_components"]
        lines.append(
            "colocated estimate from the components above (tokens / (features + step)): naive "
            f"{est['naive_colocated_tokens_per_s']}, production "
            f"{est['production_colocated_tokens_per_s']} tok/s per GPU"
        )
        lines.append(
            f"{'topology':9} {'tok/s':>8} {'per GPU':>8} {'x naive':>7} {'x SpecForge':>11} "
            f"{'target cap':>10} {'drafter cap':>11} {'peak GB':>7}  verdict"
        )
        for spec, r in p["runs"].items():
            if "error" in r:
                lines.append(f"{spec:9} failed: {r['error'][-300:]}")
                continue
            lines.append(
                f"{spec:9} {r['tokens_per_s']:8.0f} {r['tokens_per_s_per_gpu']:8d} "
                f"{r.get('per_gpu_vs_naive_colocated', 0):7.2f} {r['per_gpu_vs_specforge']:11.2f} "
                f"{r.get('target_capacity_tokens_per_s', 0) or 0:10.0f} "
                f"{r['drafter_capacity_tokens_per_s']:11.0f} {r['peak_memory_gb']:7.1f}  "
                f"{r['verdict'][:90]}"
            )
            if r.get("startup_s") is not None:
                lines.append(
                    f"{'':9} first step {r['startup_s']} s after the process started: "
                    f"{r.get('startup_split_s')}"
                )
    lines.append("")
    lines.append("issue 17's goals")
    for g in s.get("goals", {}).values():
        verdict = {True: "met", False: "NOT met", None: "not measured"}[g["met"]]
        lines.append(f"{g['goal']:62} goal {g['target']:>8} this run {g['value']!s:>8}  {verdict}")
    return "\n".join(lines)
