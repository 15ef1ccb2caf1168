"""Two finished runs' evaluations, prompt by prompt: a lever against the recipe on the same
prompts (issue 57). Reads each results folder's `eval/acceptance.json` (its `per_prompt`),
pairs the prompts by id, and prints per set (MT-Bench by turn) and over all prompts each run's
τ macro and the paired difference B - A (mean ± standard error over prompts, and how many
prompts B wins), for the drafter and for drafter+lookup.

    python bench/paired.py results-recipe results-dpace
    python bench/paired.py A B --same --json paired.json

Both runs must have evaluated the same prompts (the same config's eval sets and seed: held-out
rows drawn per source are the same rows). In bf16 a method can part from the target's own text
at a near tie, and the two runs' τ of that prompt are then measured on different text: `--same`
keeps only the prompts both runs decoded as the target did (the count left is printed). Each
prompt counts once: a question's two MT-Bench turns are not independent, so the error is a
lower bound there. Where both folders also hold `eval/sampling.json` (evaluation at temperature),
each temperature's methods are paired the same way, a prompt's τ the mean over its seeds (the
seeds are the same streams in both runs). A folder may be given as the JSON file itself
(`acceptance.json` or `sampling.json`, as kept under bench/results/). No GPU needed: it reads JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

METHODS = ("drafter", "drafter+lookup")


def group(set_name: str, prompt_id: str) -> str:
    if set_name == "mt_bench":
        return "mt_bench second turns" if "#turn" in prompt_id else "mt_bench first turns"
    return set_name


def record_path(results: Path, name: str) -> Path:
    """`eval/NAME` of a results folder, or the file itself where one was given."""
    return results if results.is_file() else results / "eval" / name


def prompts(results: Path, method: str) -> dict:
    """{prompt id: (group, τ, decoded the target's text)} of one method in one run."""
    path = record_path(results, "acceptance.json")
    if not path.exists():
        sys.exit(f"{path}: no such file (a finished run's results folder?)")
    record = json.loads(path.read_text()).get("per_prompt")
    if record is None or "methods" not in record:
        return {}
    m = record["methods"].get(method)
    if m is None:
        return {}
    return {
        pid: (group(s, pid), tau, same)
        for pid, s, tau, same in zip(
            record["ids"], record["sets"], m["tau"], m["same"], strict=True
        )
        if tau is not None
    }


def sampled_prompts(results: Path) -> dict:
    """{(temperature label, method): {prompt id: (group, τ mean over seeds, True)}}."""
    path = record_path(results, "sampling.json")
    if not path.exists():
        return {}
    out = {}
    for run in json.loads(path.read_text()).get("runs", []):
        record = run["per_prompt"]
        for method, taus in record.items():
            if method in ("ids", "sets"):
                continue
            out[run["label"], method] = {
                pid: (group(s, pid), statistics.fmean(seeds), True)
                for pid, s, seeds in zip(record["ids"], record["sets"], taus, strict=True)
                if seeds
            }
    return out


def paired(a: dict, b: dict, same: bool = False) -> dict:
    """Per group and "all": n, τ macro of A and B, mean B - A, its standard error, B's wins."""
    ids = [i for i in a if i in b and a[i][0] == b[i][0] and (not same or (a[i][2] and b[i][2]))]
    groups: dict[str, list[str]] = {}
    for i in ids:
        groups.setdefault(a[i][0], []).append(i)
    out = {}
    for name, members in [*sorted(groups.items()), ("all", ids)]:
        diffs = [b[i][1] - a[i][1] for i in members]
        if not diffs:
            continue
        se = statistics.stdev(diffs) / len(diffs) ** 0.5 if len(diffs) > 1 else None
        out[name] = {
            "n": len(diffs),
            "a": round(statistics.fmean(a[i][1] for i in members), 4),
            "b": round(statistics.fmean(b[i][1] for i in members), 4),
            "diff": round(statistics.fmean(diffs), 4),
            "se": None if se is None else round(se, 4),
            "wins": sum(d > 0 for d in diffs),
            "losses": sum(d < 0 for d in diffs),
        }
    return out


def table(method: str, rows: dict, names: tuple[str, str]) -> str:
    a, b = names
    lines = [
        f"{method}: {b} - {a}, paired by prompt",
        f"| set | n | {a} | {b} | {b} - {a} | s.e. | {b} better / worse |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in rows.items():
        se = "–" if r["se"] is None else f"{r['se']:.3f}"
        lines.append(
            f"| {name} | {r['n']} | {r['a']:.3f} | {r['b']:.3f} | {r['diff']:+.3f} | {se} | "
            f"{r['wins']} / {r['losses']} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("a", type=Path, help="results folder of the reference run (the recipe)")
    p.add_argument("b", type=Path, help="results folder of the run with the lever")
    p.add_argument("--same", action="store_true", help="only prompts both decoded as the target")
    p.add_argument("--json", type=Path, help="write the numbers here too")
    args = p.parse_args(argv)
    names = (args.a.name, args.b.name) if args.a.name != args.b.name else ("A", "B")
    record = {}
    for method in METHODS:
        rows = paired(prompts(args.a, method), prompts(args.b, method), args.same)
        if rows:
            record[method] = rows
            print(table(method, rows, names), end="\n\n")
    sampled_a, sampled_b = sampled_prompts(args.a), sampled_prompts(args.b)
    for key in sorted(sampled_a.keys() & sampled_b.keys()):
        rows = paired(sampled_a[key], sampled_b[key])
        if rows:
            label = f"{key[1]} at {key[0]}"
            record[label] = rows
            print(table(label, rows, names), end="\n\n")
    if args.json:
        args.json.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
