"""What the summary says about the evaluation's wall clock: whether the drafter's speedup on the
same prompts agrees between the two stages, whether a method decoded beside other work (its
`host` record), and whether the same fixed steps cost the same in both stages (the
`clock_probe` records of `dflash.eval.probe`). A caveat here means that tokens/s and speedups
differ between methods or stages for reasons other than the methods themselves.
"""

from __future__ import annotations

from dflash.host import describe_host

# Another process's share of the CPUs from which a decoding clock is called busy: the loop at
# batch size 1 waits on the host every round, so it feels a busy CPU long before a GPU would.
BUSY_CPU_FRACTION = 0.10


def busy_clocks(acceptance: dict, ddtree: dict) -> str:
    """A caveat naming each method whose clock ran beside other work (its `host` record), or ''."""
    hosts = {"drafter": acceptance.get("host")}
    hosts |= {k: m.get("host") for k, m in acceptance["baselines"].items()}
    hosts |= {f"DDTree {r['method']}": r.get("host") for r in ddtree["results"]}
    hosts["DDTree target"] = ddtree.get("target_host")
    busy: dict[str, list[str]] = {}  # what the machine did -> the methods it did it beside
    for name, host in hosts.items():
        if not host:
            continue
        other = host.get("other_cpu_fraction") or 0.0
        if (
            other >= BUSY_CPU_FRACTION
            or host.get("gpu_foreign_processes_max")
            or host.get("gpu_throttle")
        ):
            busy.setdefault(describe_host(host), []).append(name)
    if not busy:
        return ""
    # the methods of one stage take turns on each prompt and share one host record
    named = [f"{', '.join(names)} ({what})" for what, names in busy.items()]
    return (
        "**Clock caveat:** these methods decoded while the machine did other work, so their "
        "tokens/s and speedups are not a quiet machine's: " + "; ".join(named) + "."
    )


# How far apart one method's speedups on the same prompts may be in the two stages: the issue's
# "within noise" for a clock read over a few dozen prompts
SPEEDUP_TOLERANCE = 0.05
# The spread above which the same fixed step is said to cost differently in the two stages: the
# steps are timed in a few dozen calls, so a few per cent is noise
PROBE_TOLERANCE = 0.10


def same_prompt_speedups(acceptance: dict, ddtree: dict) -> str:
    """The drafter's speedup in the acceptance stage against the same drafter's (the chain's) in
    DDTree's, on the prompts both decoded to the same text: each stage's own target-alone clock
    on those prompts is the base. '' where the records lack per-prompt clocks."""
    a, d = acceptance.get("per_prompt"), ddtree.get("per_prompt")
    if not a or not d or "drafter" not in a["methods"] or "chain" not in d["methods"]:
        return ""
    at = {k: i for i, k in enumerate(zip(a["sets"], a["ids"], strict=True))}
    shared = [
        (at[k], j)
        for j, k in enumerate(zip(d["sets"], d["ids"], strict=True))
        if k in at
        and a["methods"]["drafter"]["text"][at[k]] == d["methods"]["chain"]["text"][j]
        and a["target"]["text"][at[k]] == d["target"]["text"][j]
    ]
    if not shared:
        return ""

    def speedup(record, method, side):
        target = sum(record["target"]["seconds"][ij[side]] for ij in shared)
        drafted = sum(record["methods"][method]["seconds"][ij[side]] for ij in shared)
        return target / drafted if drafted > 0 else None

    ours, theirs = speedup(a, "drafter", 0), speedup(d, "chain", 1)
    if ours is None or theirs is None:
        return ""
    if min(ours, theirs) > 0 and max(ours, theirs) / min(ours, theirs) - 1 <= SPEEDUP_TOLERANCE:
        verdict = f"they agree within {SPEEDUP_TOLERANCE:.0%}"
    else:
        verdict = (
            f"they differ by more than {SPEEDUP_TOLERANCE:.0%}: the two stages' clocks disagree"
        )
        machine = cpu_probe_spread(acceptance, ddtree)
        if machine:  # context, not an excuse: it need not point the way the speedups do
            verdict += f" (on this CPU the machine itself was not steady: the same {machine})"
    return (
        f"**Clock check:** on the {len(shared)} prompts both stages decoded to the same text, "
        f"the drafter's speedup over the target alone is {ours:.2f}x in the acceptance stage and "
        f"{theirs:.2f}x as DDTree's chain; {verdict}."
    )


def stage_probes(acceptance: dict, ddtree: dict) -> dict:
    """Each stage's `clock_probe` record (None where it has none), by the stage's name."""
    return {
        "the acceptance stage": acceptance.get("clock_probe"),
        "DDTree's stage": ddtree.get("clock_probe"),
    }


def live_steps(probes: dict, block: int):
    """(key, step, {stage: ms}) for each fixed step every stage's live sessions timed."""
    steps = {
        "verify_1_ms": "1-token step",
        f"verify_{block}_ms": f"{block}-token verify forward",
        "drafter_round_ms": "drafter round",
    }
    for key, step in steps.items():
        live = {stage: p["live"].get(key) for stage, p in probes.items()}
        if None not in live.values():
            yield key, step, live


def cpu_probe_spread(acceptance: dict, ddtree: dict) -> str:
    """On a CPU (probes without a fixed-cache part), the fixed step whose time differed most
    between the two stages, "<step> took <ms> in <stage> and <ms> in <stage>", where that is
    more than PROBE_TOLERANCE; else ''. Each stage is its own process, and a shared CPU's speed
    changes between them; `probe_spread` judges a GPU's probes instead."""
    probes = stage_probes(acceptance, ddtree)
    if not all(p and p.get("live") and "fixed" not in p for p in probes.values()):
        return ""
    widest, text = PROBE_TOLERANCE, ""
    for _, step, live in live_steps(probes, acceptance.get("block_size", 16)):
        if min(live.values()) <= 0:
            continue
        spread = max(live.values()) / min(live.values()) - 1
        if spread > widest:
            (sa, ta), (sb, tb) = live.items()
            widest, text = spread, f"{step} took {ta:.1f} ms in {sa} and {tb:.1f} ms in {sb}"
    return text


def probe_spread(acceptance: dict, ddtree: dict) -> str:
    """A caveat naming each fixed step whose time differed by more than PROBE_TOLERANCE between
    the two stages (on their live sessions, after every method), or ''. Only probes taken on a
    GPU (those with a `fixed` part) are judged: a CPU's few repetitions of a 50 ms step vary more
    than that."""
    probes = stage_probes(acceptance, ddtree)
    if not all(p and "fixed" in p for p in probes.values()):
        return ""
    found = []
    for key, step, live in live_steps(probes, acceptance.get("block_size", 16)):
        slow, fast = max(live, key=live.get), min(live, key=live.get)
        if live[slow] <= live[fast] * (1 + PROBE_TOLERANCE):
            continue
        fixed = [probes[stage]["fixed"].get(key) for stage in (slow, fast)]
        also = (
            f" (on sessions of a fixed small cache: {fixed[0]:.2f} and {fixed[1]:.2f} ms)"
            if None not in fixed
            else ""
        )
        found.append(
            f"the same {step} took {live[slow]:.2f} ms in {slow} but {live[fast]:.2f} ms in "
            f"{fast}{also}"
        )
    if not found:
        return ""
    return (
        "**Clock caveat:** " + "; ".join(found) + ". Tokens/s of the two stages differ by more "
        "than their methods do (`clock_probe` in eval/*.json, docs/evaluation.md)."
    )


def clock_caveats(acceptance: dict, ddtree: dict) -> list[str]:
    """The summary's paragraphs about its wall clock: the two stages' agreement on the same
    prompts, then any caveat (none on a clean run)."""
    checks = (
        same_prompt_speedups(acceptance, ddtree),
        busy_clocks(acceptance, ddtree),
        probe_spread(acceptance, ddtree),
    )
    return [c for c in checks if c]
