"""What the summary says about the evaluation's wall clock: whether a method decoded beside other
work (its `host` record), and whether the same fixed steps cost the same in every stage (the
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
    busy = []
    for name, host in hosts.items():
        if not host:
            continue
        other = host.get("other_cpu_fraction") or 0.0
        if (
            other >= BUSY_CPU_FRACTION
            or host.get("gpu_foreign_processes_max")
            or host.get("gpu_throttle")
        ):
            busy.append(f"{name} ({describe_host(host)})")
    if not busy:
        return ""
    return (
        "**Clock caveat:** these methods decoded while the machine did other work, so their "
        "tokens/s and speedups are not a quiet machine's: " + "; ".join(busy) + "."
    )


# The spread above which the same fixed step is said to cost differently across the stages: the
# steps are timed in a few dozen calls, so a few per cent is noise
PROBE_TOLERANCE = 0.10
STAGES = {"acceptance": "the acceptance stage", "ddtree": "DDTree's stage"}


def probe_spread(acceptance: dict, ddtree: dict) -> str:
    """A caveat naming each fixed step whose time differed by more than PROBE_TOLERANCE between
    methods or stages (on the live sessions), or ''. Only probes taken on a GPU (those with a
    `fixed` part) are judged: a CPU's few repetitions of a 50 ms step vary more than that."""
    block = acceptance.get("block_size", 16)
    timed = {}  # (stage, method) -> its probe
    for stage, record in (("acceptance", acceptance), ("ddtree", ddtree)):
        for method, probe in (record.get("clock_probe") or {}).items():
            if "fixed" in probe:
                timed[stage, method] = probe
    found = []
    steps = {
        f"verify_{block}_ms": f"{block}-token verify forward",
        "drafter_round_ms": "drafter round",
    }
    for key, step in steps.items():
        live = {where: p["live"][key] for where, p in timed.items() if p.get("live", {}).get(key)}
        if len(live) < 2:
            continue
        slow, fast = max(live, key=live.get), min(live, key=live.get)
        if live[slow] <= live[fast] * (1 + PROBE_TOLERANCE):
            continue
        fixed = [timed[w].get("fixed", {}).get(key) for w in (slow, fast)]
        also = (
            f" (on sessions of a fixed small cache: {fixed[0]:.2f} and {fixed[1]:.2f} ms)"
            if None not in fixed
            else ""
        )
        found.append(
            f"the same {step} took {live[slow]:.2f} ms after {slow[1]} in {STAGES[slow[0]]} but "
            f"{live[fast]:.2f} ms after {fast[1]} in {STAGES[fast[0]]}{also}"
        )
    if not found:
        return ""
    return (
        "**Clock check:** " + "; ".join(found) + ". Tokens/s of methods timed in those places "
        "differ by more than their methods do (`clock_probe` in eval/*.json, docs/evaluation.md)."
    )


def clock_caveats(acceptance: dict, ddtree: dict) -> list[str]:
    """The summary's caveats about its wall clock, each one paragraph; none on a clean run."""
    return [c for c in (busy_clocks(acceptance, ddtree), probe_spread(acceptance, ddtree)) if c]
