"""`dflash-train compute-curve RUN...`: τ against the training a recipe spends, over several runs.

Each RUN is a finished run's results folder. From `train/metrics.jsonl` (or the live metrics of
a run still going, under `checkpoints/run-*/`) it reads every logged tau_sim and tau_sim_first
against the training tokens seen by then (the drafters' tokens of every step up to it); from
`eval/acceptance.json` the real τ (macro over prompts, all prompts and per set, beside prompt
lookup's); from `data/expanded/report.json` the training rows. The steps and the training
seconds (each step's wall time, its slowest drafter's) come from the metrics too. Several runs of one recipe on a quarter, a half and all of its
rows (`data.train_fraction`) give the curve a user reads before buying GPU hours (issue 57).

Writes `compute_curve.md` (a table of each run's end, then each run's curve), `compute_curve.png`
(tau_sim against training tokens, one line per run, its real τ as a marker at its end) and
`compute_curve.json` (everything both show).
"""

from __future__ import annotations

import json
from pathlib import Path

from dflash.errors import UserError
from dflash.io import atomic_path, read_json, write_json


def _metrics(run: Path) -> Path:
    found = [run / "train/metrics.jsonl", *sorted(run.glob("checkpoints/run-*/metrics.live.jsonl"))]
    for path in found:
        if path.exists():
            return path
    raise UserError(f"compute-curve: {run} has no train/metrics.jsonl (is it a results folder?)")


def curve(metrics: Path) -> list[dict]:
    """Every logged tau_sim point: step, training tokens seen by then, tau_sim(_first)."""
    points, seen = [], 0
    for line in metrics.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        m = json.loads(line)
        seen += sum(d["tokens"] for d in m["drafters"])
        if "tau_sim" in m:
            points.append(
                {
                    "step": m["step"],
                    "tokens": seen,
                    "tau_sim": m["tau_sim"],
                    "tau_sim_first": m.get("tau_sim_first"),
                }
            )
    return points


def _optional(path: Path) -> dict | None:
    return read_json(path) if path.exists() else None


def run_record(run: Path, name: str | None = None) -> dict:
    """One run's curve and end: what the table and the plot show."""
    metrics = _metrics(run)
    record = {"name": name or run.resolve().name, "folder": str(run), "curve": curve(metrics)}
    lines = [json.loads(x) for x in metrics.read_text(encoding="utf-8").splitlines() if x.strip()]
    record["steps"] = lines[-1]["step"] if lines else 0
    record["tokens"] = sum(d["tokens"] for m in lines for d in m["drafters"])
    report = _optional(run / "data/expanded/report.json")
    record["train_rows"] = report["train_rows"] if report else None
    # the steps' wall time (each step's slowest drafter): the compute, beside the tokens
    record["train_s"] = round(sum(max(d["wall_s"] for d in m["drafters"]) for m in lines), 1)
    acceptance = _optional(run / "eval/acceptance.json")
    if acceptance:
        record["tau"] = acceptance["tau_macro"]
        record["tau_sets"] = {k: v["tau_macro"] for k, v in acceptance["sets"].items()}
        lookup = acceptance.get("baselines", {}).get("lookup")
        record["lookup_tau"] = lookup["tau_macro"] if lookup else None
    return record


def _num(value, digits: int = 3) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def table(records: list[dict]) -> str:
    """Markdown: one row per run's end, then each run's tau_sim points."""
    sets = sorted({s for r in records for s in r.get("tau_sets", {})})
    head = ["run", "training rows", "steps", "tokens (M)", "train s", "tau_sim", "tau_sim_first"]
    head += ["real τ", *(f"τ {s}" for s in sets), "lookup τ"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in records:
        last = r["curve"][-1] if r["curve"] else {}
        cells = [
            r["name"],
            "–" if r["train_rows"] is None else f"{r['train_rows']:,}",
            f"{r['steps']:,}",
            f"{r['tokens'] / 1e6:.1f}",
            f"{r['train_s']:,.0f}",
            _num(last.get("tau_sim")),
            _num(last.get("tau_sim_first")),
            _num(r.get("tau")),
            *(_num(r.get("tau_sets", {}).get(s)) for s in sets),
            _num(r.get("lookup_tau")),
        ]
        rows.append("| " + " | ".join(cells) + " |")
    out = [
        "# τ against training tokens",
        "",
        "Each run's end: tau_sim and tau_sim_first (held-out rows, predicted) at its last logged "
        "step; real τ macro over prompts from its evaluation (all prompts, then per set), prompt "
        "lookup's beside it.",
        "",
        *rows,
    ]
    for r in records:
        out += ["", f"## {r['name']}", "", "| step | tokens (M) | tau_sim | tau_sim_first |"]
        out.append("|---|---|---|---|")
        for p in r["curve"]:
            out.append(
                f"| {p['step']:,} | {p['tokens'] / 1e6:.2f} | {_num(p['tau_sim'])} | "
                f"{_num(p['tau_sim_first'])} |"
            )
    return "\n".join(out) + "\n"


def plot(records: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for r in records:
        xs = [p["tokens"] / 1e6 for p in r["curve"]]
        (line,) = ax.plot(xs, [p["tau_sim"] for p in r["curve"]], marker=".", label=r["name"])
        if r.get("tau") is not None:
            ax.plot(
                [r["tokens"] / 1e6], [r["tau"]], marker="*", markersize=12,
                color=line.get_color(), linestyle="none",
            )  # fmt: skip
    ax.set(
        xlabel="training tokens (M)",
        ylabel="τ",
        title="tau_sim against training tokens (★ real τ at the run's end)",
    )
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=100, metadata={"Software": None})
    plt.close(fig)


def run(args) -> None:
    names = args.name or [None] * len(args.runs)
    if len(names) != len(args.runs):
        raise UserError("compute-curve: give --name once per run, or not at all")
    records = [run_record(Path(r), n) for r, n in zip(args.runs, names, strict=True)]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with atomic_path(out / "compute_curve.md") as tmp:
        tmp.write_text(table(records), encoding="utf-8")
    plot(records, out / "compute_curve.png")
    write_json(out / "compute_curve.json", {"runs": records})
    print(table(records).split("\n## ")[0])
