"""The paragraph and table `results/summary.md` gives a serving engine's figures (eval/vllm.json,
eval/sglang.json: `dflash.eval.served.compare`'s record)."""

from __future__ import annotations


def _pct(x) -> str:
    return "–" if x is None else f"{x:+.1f} %"


def summary_section(record: dict, engine: str, label: str, how: str) -> str:
    """`label` names the engine in prose ("vLLM"), `how` says how its acceptance length was read."""
    if "acceptance_length" not in record:  # served at temperature only (eval.vllm.greedy false)
        lines = [f"**Served by {label} {record[engine]}** (`eval/{engine}.json`) at temperature "
                 "only, beside eval_sampling's figures: no greedy pass, no target alone."]  # fmt: skip
        return "\n".join(lines + sampled_lines(record, engine, label)) + "\n"
    a, speed = record["acceptance_length"], record["tokens_per_s"]
    walked = record.get(f"on_{engine}_text")  # absent from records before the walk
    lines = [
        f"**Served by {label} {record[engine]}** (`eval/{engine}.json`; {how}): "
        f"{a[f'{engine}_macro']} macro / {a[f'{engine}_pooled']} pooled against this "
        f"evaluation's τ {a['ours_macro']:.3f} / {a['ours_pooled']:.3f} "
        f"({_pct(a['diff_pct_macro'])} / {_pct(a['diff_pct_pooled'])}); outputs identical to "
        f"{label}'s target alone on {100 * record['identical_to_target_alone']:.0f} % of "
        f"prompts; tokens/s over {label}'s target alone: "
        + ", ".join(
            f"{'batch 1' if c == '1' else f'concurrency {c}'} {s['speedup']:.2f}x "
            f"({s['dflash']:.0f} against {s['target']:.0f})"
            # JSON sorts the keys as text (1, 32, 8): order them as numbers
            for c, s in sorted(speed.items(), key=lambda item: int(item[0]))
        )
        + ".",
        "",
        f"| eval set | prompts | {label} macro | ours | diff | {label} pooled | ours | diff |"
        + (f" ours on {label}'s tokens | diff |" if walked else ""),
        "|---|---|---|---|---|---|---|---|" + ("---|---|" if walked else ""),
    ]
    for name, s in record["sets"].items():
        lines.append(
            f"| {name} | {s['prompts']} | {s[f'{engine}_macro']} | {s['ours_macro']} | "
            f"{_pct(s['diff_pct_macro'])} | {s[f'{engine}_pooled']} | {s['ours_pooled']} | "
            f"{_pct(s['diff_pct_pooled'])} |"
            + (
                f" {s[f'ours_on_{engine}_text']} | {_pct(s['diff_pct_same_tokens'])} |"
                if walked
                else ""
            )
        )
    if walked:
        lines += [
            "",
            f"Our drafter's τ on exactly the tokens {label} emitted (the decoding walk, "
            f"{walked['walked_prompts']} prompts): {walked[f'ours_on_{engine}_text']} macro "
            f"against {label}'s {walked[f'{engine}_on_its_text']} "
            f"({_pct(walked['diff_pct_same_tokens'])}): the engines' arithmetic alone. The "
            "columns before compare τ on each engine's own text.",
        ]
    if same := record.get("same_text"):
        lines += [
            "",
            f"On the {same['prompts']} of {same['of']} prompts where {label} decoded exactly our "
            f"drafter's text, acceptance length {same[f'{engine}_macro']} ({label}) against "
            f"{same['ours_macro']} (ours), macro; elsewhere the texts parted at a near tie and τ "
            f"was judged on other tokens. {label}'s target alone decoded our target's text on "
            f"{same['target_alone_same']} of {same['of']} prompts.",
        ]
    return "\n".join(lines + sampled_lines(record, engine, label)) + "\n"


def sampled_lines(record: dict, engine: str, label: str) -> list[str]:
    """A paragraph per temperature and draft rule the engine served."""
    lines = []
    for run in record.get("sampled", []):
        lines += [
            "",
            f"At temperature {run['temperature']} (top-p {run['top_p']}, top-k "
            f"{run['top_k'] or 'all'}), {label}'s `{run['draft_rule']}` draft rule, each set's "
            f"prompts together over {run['seeds']} seeds: acceptance length "
            f"{run[f'{engine}_pooled']} pooled against ours {run['ours_pooled']} "
            f"({_pct(run['diff_pct_pooled'])}); "
            + ", ".join(
                f"{n} {s[f'{engine}_pooled']} / {s['ours_pooled']} ({_pct(s['diff_pct_pooled'])})"
                for n, s in run["sets"].items()
            )
            + "."
            + (f" {run['caveat']}" if run.get("caveat") else ""),
        ]
    return lines
