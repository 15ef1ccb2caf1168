"""`dflash report`: `results/summary.md` (read this first) and the plots of the Snakemake report.

Everything here is read from the other rules' JSON outputs; nothing is recomputed, so the summary
cannot disagree with the files it summarises.
"""

from __future__ import annotations

import itertools
import json
import statistics
from pathlib import Path

from dflash.eval import sglang_stage, vllm_stage
from dflash.eval.clock import clock_caveats
from dflash.eval.fastest import fastest_text
from dflash.eval.handover import handover
from dflash.eval.overlap import overlap_text
from dflash.eval.report_sampling import sampling_text, trained_on_text
from dflash.host import STARTUP_PHASES, describe_host
from dflash.io import atomic_path, read_json

PLOTS = ("acceptance", "rates", "ddtree", "training", "throughput", "lengths")


def _plots(folder: Path, stats, metrics, acceptance, ddtree) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    block = acceptance["block_size"]
    methods = {"drafter": acceptance, **acceptance["baselines"]}

    def save(fig, name):
        fig.tight_layout()
        with atomic_path(folder / f"{name}.png") as tmp:
            fig.savefig(tmp, format="png", dpi=100, metadata={"Software": None})
        plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 3.5))
    width = 0.8 / len(methods)
    for j, (name, m) in enumerate(methods.items()):
        counts = [m["histogram"][str(k)] for k in range(1, block + 1)]  # JSON keys are strings
        total = max(sum(counts), 1)
        ax.bar(
            [k + j * width for k in range(1, block + 1)],
            [c / total for c in counts],
            width,
            label=f"{name} (τ {m['tau_macro']:.2f})",
        )
    ax.set(
        xlabel="tokens accepted per target forward",
        ylabel="share of rounds",
        title="Acceptance length",
    )
    ax.legend()
    save(fig, "acceptance")

    fig, ax = plt.subplots(figsize=(7, 3.5))
    for name, m in methods.items():
        ks = [k for k in range(2, block + 1) if m["rates"][str(k)] is not None]
        ax.plot(ks, [m["rates"][str(k)] for k in ks], marker="o", label=name)
    ax.set(
        xlabel="draft position k",
        ylabel="P(accept ≥ k | accept ≥ k-1)",
        ylim=(0, 1),
        title="Per-position acceptance",
    )
    ax.legend()
    save(fig, "rates")

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for lookup in (False, True):
        rows = sorted(
            (r for r in ddtree["results"] if r.get("lookup", False) == lookup),
            key=lambda r: r["budget"],
        )
        if not rows:
            continue
        label = "drafter tree + lookup branch" if lookup else "drafter tree"
        ax.plot(
            [r["budget"] for r in rows], [r["tau_macro"] for r in rows], marker="o", label=label
        )
        for r in rows:
            ax.annotate(f"{r['speedup']:.2f}x", (r["budget"], r["tau_macro"]))
    ax.legend()
    ax.set(
        xscale="log",
        xlabel="draft nodes verified per forward",
        ylabel="τ (macro)",
        title="DDTree τ (labels: speedup)",
    )
    save(fig, "ddtree")

    fig, ax = plt.subplots(figsize=(7, 3.5))
    # against training tokens, not steps: whether more data would still pay reads off directly
    seen = list(itertools.accumulate(sum(d["tokens"] for d in m["drafters"]) for m in metrics))
    seen = [t / 1e6 for t in seen]
    ax.plot(seen, [m["loss"] for m in metrics], label="loss")
    ax.set(xlabel="training tokens (millions)", ylabel="loss", title="Learning curve")
    twin = ax.twinx()
    twin.plot(seen, [m["tau"] for m in metrics], color="C1", label="teacher-forced τ")
    for key, color, label in (
        ("tau_sim", "C2", "tau_sim, every turn (held-out)"),
        ("tau_sim_first", "C3", "tau_sim, first answers (held-out, as evaluated)"),
    ):
        simulated = [(t, m[key]) for t, m in zip(seen, metrics, strict=True) if key in m]
        if simulated:
            twin.plot(*zip(*simulated, strict=True), color=color, marker="o", label=label)
    if "tau_sim" in acceptance and acceptance["tau_sim"].get("tau_macro"):
        # real τ of the same rows' first answers: what tau_sim_first predicts
        twin.axhline(
            acceptance["tau_sim"]["tau_macro"], color="C3", ls="--", label="real τ (held-out)"
        )
    twin.set_ylabel("τ")
    lines = ax.get_legend_handles_labels()
    twin_lines = twin.get_legend_handles_labels()
    ax.legend(lines[0] + twin_lines[0], lines[1] + twin_lines[1], fontsize="small")
    save(fig, "training")

    fig, ax = plt.subplots(figsize=(7, 3.5))
    steps = [m["step"] for m in metrics]
    ax.plot(steps, [m["tokens_per_s"] for m in metrics], label="overall")
    for d in range(len(metrics[0]["drafters"]) if metrics else 0):
        ax.plot(
            steps,
            [m["drafters"][d]["tokens_per_s"] for m in metrics],
            label=f"drafter {d}",
            alpha=0.7,
        )
    if metrics and "targets" in metrics[-1]:
        for t in range(len(metrics[-1]["targets"])):
            ax.plot(
                steps,
                [
                    m["targets"][t]["tokens_per_s"] if t < len(m.get("targets", [])) else None
                    for m in metrics
                ],
                label=f"target {t} capacity",
                alpha=0.7,
            )
    ax.set(xlabel="optimizer step", ylabel="tokens/s", title="Training throughput per role")
    ax.legend()
    save(fig, "throughput")

    fig, ax = plt.subplots(figsize=(7, 3.5))
    hist = stats["histogram"]
    starts = sorted(hist["counts"], key=int)
    ax.bar(
        [int(s) for s in starts],
        [hist["counts"][s] for s in starts],
        width=hist["bin_width"],
        align="edge",
    )
    ax.set(xlabel="tokens per conversation", ylabel="rows", title="Training length distribution")
    save(fig, "lengths")


def _tau(m: dict) -> str:
    return f"{m['tau_macro']:.3f} | {m['tau_pooled']:.3f}"


def _precision(acceptance: dict) -> str:
    """The decoding dtype, and how many outputs parted from the target's at a near tie."""
    dtype = acceptance.get("dtype", "float32")
    ties = [t for ts in (acceptance.get("near_ties") or {}).values() for t in ts]
    if dtype == "float32":
        return " (float32: outputs equal token for token)"
    # a tie the run's own dtype measured past the margin, and float32 within it
    rechecked = sum(t.get("gap_float32") is not None for t in ties)
    by_float32 = f", {rechecked} of them by the target's float32 gap" if rechecked else ""
    return f" ({dtype}; {len(ties)} outputs part from the target's own at a near tie{by_float32}, rounding)"


def _turn(prompt_id: str) -> int:
    return int(prompt_id.split("#turn")[1]) if "#turn" in prompt_id else 1


def per_prompt_text(acceptance: dict) -> str | None:
    """Where prompt lookup beats the drafter, prompt by prompt: how often, by turn in each set with
    later turns (asked after the target's own answer, which the target may repeat and lookup then
    copies), and its largest leads."""
    record = acceptance.get("per_prompt") or {}
    methods = record.get("methods", {})
    if "lookup" not in methods or "drafter" not in methods:
        return None
    drafter, lookup = methods["drafter"], methods["lookup"]
    # (id, set, drafter τ, lookup τ, both decoded the target's own text)
    pairs = [
        (pid, set_name, d, lk, d_same and lk_same)
        for pid, set_name, d, lk, d_same, lk_same in zip(
            record["ids"],
            record["sets"],
            drafter["tau"],
            lookup["tau"],
            drafter["same"],
            lookup["same"],
            strict=True,
        )
        if d is not None and lk is not None
    ]
    ahead = sorted((p for p in pairs if p[3] > p[2]), key=lambda p: p[2] - p[3])
    text = (
        "**Per prompt** (`per_prompt` in `eval/acceptance.json`): prompt lookup is ahead on "
        f"{len(ahead)} of {len(pairs)} prompts (on {sum(p[4] for p in ahead)} of them both "
        "decoded the target's own text, so the same text was judged)"
    )
    for set_name in sorted({p[1] for p in pairs if _turn(p[0]) > 1}):
        first = [p for p in pairs if p[1] == set_name and _turn(p[0]) == 1]
        later = [p for p in pairs if p[1] == set_name and _turn(p[0]) > 1]
        text += f"; {set_name} τ macro drafter vs lookup, " + ", ".join(
            f"{name}: {statistics.fmean(p[2] for p in group):.2f} vs "
            f"{statistics.fmean(p[3] for p in group):.2f} ({len(group)})"
            for name, group in (("first turns", first), ("later turns", later))
            if group
        )
    if ahead:
        text += "; lookup's largest leads: " + ", ".join(
            f"{pid} ({lk:.2f} vs {d:.2f})" for pid, _, d, lk, _ in ahead[:5]
        )
    return text + "."


def _startup(train_summary: dict) -> str:
    """When drafter 0 began training, counted from its process's start."""
    startup, compiled = train_summary.get("startup_s"), train_summary.get("compile_s")
    if startup is None:
        return ""
    compiling = f", {compiled:.0f} s of it compiling" if compiled is not None else ""
    if split := train_summary.get("startup_split_s"):
        parts = [f"{k.replace('_', ' ')} {split[k]:.1f} s" for k in STARTUP_PHASES if k in split]
        compiling = " (" + ", ".join(parts) + ")"
    return f"; first step {startup:.0f} s after the process started{compiling}"


def summary_text(stats, train_summary, metrics, acceptance, ddtree, handover=()) -> str:
    """The summary; `handover` (`dflash.eval.handover`) opens it: where the drafter is, how to
    serve it, and a warning when the figures mean nothing."""
    b = acceptance["baselines"]
    best_tree = max(ddtree["results"], key=lambda r: r["speedup"])
    sim = acceptance.get("tau_sim") or {}
    lines = [
        "# DFlash drafter run summary",
        "",
        *(list(handover) + [""] if handover else []),
        f"**Acceptance (real speculative decoding, block {acceptance['block_size']}, "
        f"up to {acceptance['max_new_tokens']} new tokens):** τ = {acceptance['tau_macro']:.3f} "
        f"(macro: mean over prompts of each prompt's mean, as the DFlash benchmark reports it; "
        f"{acceptance['tau_pooled']:.3f} pooled) over {acceptance['n_prompts']} prompts; speedup "
        f"{acceptance['speedup']:.2f}x over the target alone; lossless {acceptance['lossless']:.2f}"
        f"{_precision(acceptance)}.",
    ]
    if sim.get("tau_sim") is not None:
        match = sim["matching_rows"]
        on_matching = (
            f" (on the other {match['rows']}: tau_sim {match['tau_sim']:.3f}, real "
            f"{match['tau_macro']:.3f})"
            if match["rows"]
            else ""
        )
        lines.append(
            f"Predicted from teacher forcing on {sim['rows']} held-out rows: tau_sim "
            f"{sim['tau_sim']:.3f} vs real {sim['tau_macro']:.3f} on the same prompts "
            f"({sim['gap_pct']:+.1f} %); {sim['diverged_rows']} of those rows' regenerated "
            f"responses differ from the eval's own greedy continuation{on_matching}. "
            "Acceptance averaged over random anchors (the training loss's τ): "
            f"{acceptance['teacher_forced_tau']:.3f}."
        )
    lines += [
        "",
        "| method | τ macro | τ pooled | tokens/s | speedup | lossless |",
        "|---|---|---|---|---|---|",
    ]
    names = {
        "drafter+lookup": "drafter + lookup branch",
        "untrained": "untrained drafter",
        "lookup": "prompt lookup",
        "target": "target only",
    }
    rows = [("trained drafter", acceptance)]
    rows += [(label, b[key]) for key, label in names.items() if key in b]
    for name, m in rows:
        lines.append(
            f"| {name} | {_tau(m)} | {m['tokens_per_s']:.1f} | {m['speedup']:.2f}x | {m['lossless']:.2f} |"
        )
    lines += [c for caveat in clock_caveats(acceptance, ddtree) for c in ("", caveat)]
    sets = acceptance["sets"]
    if len(sets) > 1:
        per_set = acceptance.get("baseline_sets", {})
        others = [k for k in ("lookup", "drafter+lookup") if k in per_set]
        lines += [
            "",
            "| eval set | prompts | drafter τ macro | pooled | "
            + " | ".join(f"{names[k]} τ macro | pooled" for k in others)
            + " |",
            "|---|---|---|---|" + "---|---|" * len(others),
        ]
        for name, m in sets.items():
            cells = [_tau(per_set[k][name]) if name in per_set[k] else "– | –" for k in others]
            lines.append(f"| {name} | {m['n_prompts']} | {_tau(m)} | {' | '.join(cells)} |")
    fastest = fastest_text(acceptance)
    if fastest:
        lines += ["", fastest]
    lk = b.get("lookup")
    for key, label in (
        ("drafter", "the trained drafter"),
        ("drafter+lookup", names["drafter+lookup"]),
    ):
        m = acceptance if key == "drafter" else b.get(key)
        behind = [k for k in ("tau_macro", "tau_pooled") if lk and m and m[k] <= lk[k]]
        if behind:
            lines += [
                "",
                f"**Finding:** {label} does not beat prompt lookup ("
                + ", ".join(f"{k.removeprefix('tau_')} τ {m[k]:.3f} vs {lk[k]:.3f}" for k in behind)
                + ").",
            ]
    wins = per_prompt_text(acceptance)
    if wins:
        lines += ["", wins]
    overlap = overlap_text(acceptance.get("train_overlap"))
    if overlap:
        lines += ["", overlap]
    sims = [m for m in metrics if "tau_sim" in m]
    curve = ""
    if sims:
        first, last = sims[0], sims[-1]
        curve = (
            f"tau_sim on held-out rows (every turn) {first['tau_sim']:.3f} at step "
            f"{first['step']}, {last['tau_sim']:.3f} at step {last['step']}"
        )
        if "tau_sim_first" in last:  # the evaluation's protocol: what predicts its real τ
            curve += f", on their first answers as evaluated {last['tau_sim_first']:.3f}"
        curve += " (report/training.png)"
    lines += [
        "",
        f"**DDTree** (top-{ddtree['topk']} per position): "
        + ", ".join(
            f"{'chain of ' if r['method'] == 'chain' else ''}{r['budget']} nodes"
            f"{' + lookup' if r.get('lookup') else ''} τ {r['tau_macro']:.2f} ({r['speedup']:.2f}x)"
            for r in ddtree["results"]
        )
        + f"; best speedup {best_tree['speedup']:.2f}x ({best_tree['method']}).",
        "",
        f"**Training:** {len(metrics)} optimizer steps, final loss {metrics[-1]['loss']:.3f}, teacher-forced τ "
        f"{metrics[-1]['tau']:.3f}{f'; {curve}' if curve else ''}; "
        f"{train_summary['tokens_per_s']:.0f} tokens/s with "
        f"{train_summary['topology']['targets']} target + {train_summary['topology']['drafters']} drafter ranks"
        f"{_startup(train_summary)}. "
        f"{train_summary.get('verdict', '')}. Host during training: "
        f"{describe_host(train_summary.get('host'))}.",
        "",
        f"**Data:** {stats['rows']} training rows, mean length {stats['length']['mean']:.0f} tokens "
        f"(p99 {stats['length']['p99']}){_domains(stats)}.",
        "",
        "Files: `eval/acceptance.json`, `eval/ddtree.json`, `train/metrics.jsonl`, `train/summary.json`, "
        "`data/stats/stats.json`; plots in `report/`.",
    ]
    return "\n".join(lines) + "\n"


def _domains(stats: dict) -> str:
    """ "; by domain: chat 6000 rows (52 % of trainable tokens), ..." (stats.json's `domains`)."""
    parts = [
        f"{name} {d['rows']} rows ({100 * d['trainable_share']:.0f} % of trainable tokens)"
        for name, d in stats.get("domains", {}).items()
    ]
    return f"; by domain: {', '.join(parts)}" if parts else ""


def run(args) -> None:
    stats = read_json(args.stats)
    train_summary = read_json(args.train_summary)
    metrics = [json.loads(x) for x in Path(args.metrics).read_text().splitlines()]
    acceptance = read_json(args.acceptance)
    ddtree = read_json(args.ddtree)
    _plots(Path(args.plots), stats, metrics, acceptance, ddtree)
    text = summary_text(
        stats, train_summary, metrics, acceptance, ddtree, handover(args, acceptance)
    )
    sampled = read_json(args.sampling) if getattr(args, "sampling", None) else None
    for extra in (trained_on_text(train_summary), sampling_text(sampled, acceptance, metrics)):
        if extra:
            text += "\n" + extra + "\n"
    for engine in (vllm_stage, sglang_stage):  # the serving engines' records, where they ran
        if path := getattr(args, engine.ENGINE, None):
            text += "\n" + engine.summary_section(read_json(path))
    with atomic_path(args.summary) as tmp:
        tmp.write_text(text)
