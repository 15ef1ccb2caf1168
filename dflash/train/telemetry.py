"""Per-step throughput records and the end-of-run bottleneck summary.

Each drafter keeps a `Window` (one optimizer step): its own time split and tokens, plus what its
feature links reported (the target's compute and blocked time, the queue depth at each send).
Drafter 0 gathers the windows into one JSON line per step. `summarize` reads only those lines, so
the same verdict can be recomputed from any run's `metrics.jsonl`.

Verdict: a target's capacity is tokens / compute time, a drafter's is tokens / (time not spent
waiting for features). The role with less total capacity limits the run, by the ratio of the two.
A full queue (targets blocked) points at drafters; an empty one (drafters waiting) at targets.

Queue depth = a link's sends not yet confirmed when a batch is sent. NCCL confirms a send once the
receiver has taken it, so the depth is the real backlog; gloo confirms only when the sender waits
on it, so on CPU it reads as full and the verdict relies on capacities and waiting times instead.
"""

from __future__ import annotations

import contextlib
import os
import resource
import statistics
import time
from collections import defaultdict

import torch

from dflash.host import summarize_host

PHASES = ("wait", "features", "forward", "backward", "optimizer")


def sync(device: torch.device) -> None:
    """Wait for the compute stream's queued work, so a host clock measures it. Not the whole
    device: that would also wait for a posted NCCL receive, forever if its peer froze, before
    the receive's own timeout could fire."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def peak_memory_gb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB


class Window:
    """One drafter's accounting for one optimizer step.

    The step's work is queued without waiting for the device: phases on CUDA are timed by
    events on the compute stream, read in `close()` once the device has run them (a host clock
    around queued work would measure only the queueing). `seal()` ends the window's wall time
    when the step is queued; the next window starts where this one's accounting ended, so the
    windows tile the run and tokens / wall_s is the throughput actually reached.

    `launch_bound` (CUDA only): whether, when the step was queued, the device had already run
    all of its work but the optimizer's. A device that keeps up with the host's launches waits
    for them (the step is launch-bound: a faster host CPU, CUDA graphs or larger batches raise
    the rate, a faster GPU does not); one with a backlog is still busy with the step then.
    `host_s` (CUDA only): the host's seconds inside each phase, queueing its kernels or waiting
    on the device within it. Beside the phase's device span (`time_s`), a share well below 1
    says the GPU was the bound there; near 1, the phase's span followed the host, which queued
    slowly (launch-bound), synced inside it, or was held by a full launch queue (a GPU-bound
    phase far behind). The flag and the share are one sample and one mean: evidence to read
    beside each other, not a profile. Misread by the flag: a step after a full sync (tau_sim, a
    checkpoint) starts with an empty queue, and a host that is slow early in a step only (a
    forward of tiny kernels before a heavy backward) is not seen.
    """

    def __init__(self, device: torch.device, start: float | None = None):
        self.device = device
        self.start = time.perf_counter() if start is None else start
        self.time = dict.fromkeys(PHASES, 0.0)
        self.events: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []
        self.host = dict.fromkeys(PHASES, 0.0)
        self.tokens = 0
        self.wall_s: float | None = None
        self.launch_bound: bool | None = None
        self.links = defaultdict(
            lambda: {"tokens": 0, "compute_s": 0.0, "blocked_s": 0.0, "depth": []}
        )

    @contextlib.contextmanager
    def phase(self, name: str):
        """Time the work queued inside the block as phase `name`."""
        if self.device.type != "cuda":  # CPU work runs as it is issued
            started = time.perf_counter()
            yield
            self.time[name] += time.perf_counter() - started
            return
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        started = time.perf_counter()
        begin.record()
        yield
        end.record()
        self.host[name] += time.perf_counter() - started
        self.events.append((name, begin, end))

    def link(self, src: int, stats: dict) -> None:
        entry = self.links[src]
        entry["tokens"] += int(stats["tokens"])
        entry["compute_s"] += stats["compute_s"]
        entry["blocked_s"] += stats["blocked_s"]
        entry["depth"].append(stats["queue_depth"])

    def seal(self) -> None:
        """The step is queued: its wall time ends here, and whether the device waited for it."""
        self.wall_s = time.perf_counter() - self.start
        before_optimizer = [end for name, _, end in self.events if name != "optimizer"]
        if before_optimizer:  # Event.query does not wait
            self.launch_bound = all(end.query() for end in before_optimizer)

    def close(self) -> dict:
        """The window's numbers; waits for the device to finish the window's work."""
        if self.wall_s is None:
            self.wall_s = time.perf_counter() - self.start
        for name, begin, end in self.events:
            end.synchronize()
            self.time[name] += begin.elapsed_time(end) / 1000
        self.events.clear()
        window = {
            "tokens": self.tokens,
            "wall_s": self.wall_s,
            "time_s": dict(self.time),
            "peak_memory_gb": round(peak_memory_gb(self.device), 3),
            "links": {src: dict(v) for src, v in self.links.items()},
        }
        if self.launch_bound is not None:
            window["launch_bound"] = self.launch_bound
            window["host_s"] = dict(self.host)
        return window


def _rate(tokens: float, seconds: float) -> float:
    return round(tokens / seconds, 1) if seconds > 0 else 0.0


def step_record(windows: list[dict], topology, metrics: list[dict]) -> dict:
    """The throughput part of a step's JSON line, from every drafter's window."""
    wall = max(w["wall_s"] for w in windows)
    record = {
        "loss": round(statistics.fmean(m["loss"] for m in metrics), 5),
        "tau": round(statistics.fmean(m["tau"] for m in metrics), 4),
        "acc": [
            round(statistics.fmean(a), 4) for a in zip(*(m["acc"] for m in metrics), strict=True)
        ],
        "tokens_per_s": _rate(sum(w["tokens"] for w in windows), wall),
        "time_s": {p: round(statistics.fmean(w["time_s"][p] for w in windows), 4) for p in PHASES},
        "drafters": [
            {
                "tokens": w["tokens"],
                "wall_s": round(w["wall_s"], 4),
                "tokens_per_s": _rate(w["tokens"], w["wall_s"]),
                "time_s": {p: round(t, 4) for p, t in w["time_s"].items()},
                "peak_memory_gb": w["peak_memory_gb"],
            }
            for w in windows
        ],
    }
    if all("launch_bound" in w for w in windows):  # every drafter's device waited on its host
        record["launch_bound"] = all(w["launch_bound"] for w in windows)
        record["host_s"] = {
            p: round(statistics.fmean(w["host_s"][p] for w in windows), 4) for p in PHASES
        }
    if not topology.colocated:
        targets, queue = {}, {}
        for d, w in enumerate(windows):
            for src, link in w["links"].items():
                _, t = topology.role(int(src))
                agg = targets.setdefault(t, {"tokens": 0, "compute_s": 0.0, "blocked_s": 0.0})
                for k in agg:
                    agg[k] += link[k]
                queue[f"t{t}->d{d}"] = round(statistics.fmean(link["depth"]), 2)
        record["targets"] = [
            {
                "tokens": targets[t]["tokens"],
                "compute_s": round(targets[t]["compute_s"], 4),
                "blocked_s": round(targets[t]["blocked_s"], 4),
                "tokens_per_s": _rate(targets[t]["tokens"], targets[t]["compute_s"]),
            }
            for t in sorted(targets)
        ]
        record["queue_depth"] = dict(sorted(queue.items()))
    return record


def summarize(records: list[dict], topology: dict, queue_depth: int) -> dict:
    """Which role limited the run and by how much, from the per-step records.

    The rates leave the run's first step out when there are others: it carries start-up and
    compilation (a resumed run's first step after the resume is counted). `steps` is the run's
    last optimizer step (a resumed run's count from its start), `rate_steps` how many steps the
    rates average.
    """
    steady = records[1:] if len(records) > 1 else records
    if not steady:
        return {"steps": 0, "topology": topology}
    n_drafters = len(steady[0]["drafters"])
    tokens, walls, waited = [0.0] * n_drafters, [0.0] * n_drafters, [0.0] * n_drafters
    for r in steady:
        for d, dr in enumerate(r["drafters"]):
            tokens[d] += dr["tokens"]
            walls[d] += dr["wall_s"]
            waited[d] += dr["time_s"]["wait"]
    drafter_capacity = sum(
        _rate(tok, wall - wait) for tok, wall, wait in zip(tokens, walls, waited, strict=True)
    )
    summary = {
        "steps": records[-1].get("step", len(records)),
        "rate_steps": len(steady),
        "topology": topology,
        "tokens_per_s": round(statistics.fmean(r["tokens_per_s"] for r in steady), 1),
        "drafter_capacity_tokens_per_s": round(drafter_capacity, 1),
        "drafter_wait_fraction": round(sum(waited) / max(sum(walls), 1e-9), 4),
        "time_split": {
            p: round(statistics.fmean(r["time_s"][p] for r in steady), 4) for p in PHASES
        },
        "host": summarize_host([r.get("host") for r in steady]),
    }
    launch = launch_bound_note(steady, summary)
    if topology["targets"] == 0:
        t = summary["time_split"]
        share = t["features"] / max(sum(t.values()), 1e-9)
        summary["bottleneck"] = "colocated"
        summary["verdict"] = (
            f"colocated: target features take {share:.0%} of each drafter's time; "
            "a separate target rank would overlap them with training" + launch
        )
        return summary
    t_tokens = defaultdict(float)
    t_compute = defaultdict(float)
    t_blocked = defaultdict(float)
    depths = []
    for r in steady:
        for t, tr in enumerate(r["targets"]):
            t_tokens[t] += tr["tokens"]
            t_compute[t] += tr["compute_s"]
            t_blocked[t] += tr["blocked_s"]
        depths += list(r["queue_depth"].values())
    target_capacity = sum(_rate(t_tokens[t], t_compute[t]) for t in t_tokens)
    blocked_fraction = sum(t_blocked.values()) / max(
        sum(t_blocked.values()) + sum(t_compute.values()), 1e-9
    )
    mean_depth = statistics.fmean(depths) if depths else 0.0
    slow, fast = (
        ("drafters", "targets") if drafter_capacity < target_capacity else ("targets", "drafters")
    )
    ratio = max(drafter_capacity, target_capacity) / max(
        min(drafter_capacity, target_capacity), 1e-9
    )
    summary |= {
        "target_capacity_tokens_per_s": round(target_capacity, 1),
        "target_blocked_fraction": round(blocked_fraction, 4),
        "mean_queue_depth": round(mean_depth, 2),
        "queue_depth_limit": queue_depth,
        "bottleneck": slow,
        "bottleneck_factor": round(ratio, 2),
        "verdict": (
            f"{slow} are the bottleneck: {fast} could process {ratio:.2f}x more "
            f"({fast} {max(drafter_capacity, target_capacity):.0f} vs "
            f"{slow} {min(drafter_capacity, target_capacity):.0f} tokens/s); targets blocked on "
            f"a full queue {blocked_fraction:.0%} of their time, drafters waiting for features "
            f"{summary['drafter_wait_fraction']:.0%}" + launch
        ),
    }
    return summary


def launch_bound_note(steady: list[dict], summary: dict) -> str:
    """Sets the share of steady steps whose drafters' devices waited for their hosts' launches
    (CUDA runs), and returns the verdict's words for it when it is most of them."""
    timed = [r for r in steady if "launch_bound" in r]
    if not timed:
        return ""
    share = summary["launch_bound_fraction"] = round(
        statistics.fmean(r["launch_bound"] for r in timed), 4
    )
    # both means over the same steps (a resumed run's older lines carry no host time)
    host = {p: statistics.fmean(r["host_s"][p] for r in timed) for p in PHASES}
    device = {p: statistics.fmean(r["time_s"][p] for r in timed) for p in PHASES}
    summary["host_share"] = {  # `wait` is the host's own clock, not a span of queued work
        p: round(host[p] / device[p], 3) for p in PHASES if p != "wait" and device[p] > 0
    }
    paced = [p for p, v in summary["host_share"].items() if v >= 0.9]
    words = ""
    if share >= 0.5:
        words += (
            f"; launch-bound in {share:.0%} of steps (the GPU had run the step's forward and "
            "backward before the host had queued its optimizer): the host CPU sets the rate, so "
            "a faster host or a larger data.token_budget raises it, a faster GPU does not"
        )
    if paced:
        words += "; paced by the host (slow launches or a sync inside): " + ", ".join(
            f"{p} (host {summary['host_share'][p]:.0%} of its GPU time)" for p in paced
        )
    return words


@contextlib.contextmanager
def watch_syncs(device: torch.device):
    """With DFLASH_SYNC_DEBUG=1 on CUDA, torch warns (once per source line) at each host sync:
    a step is queued without one, so any warning outside `log_step`, `simulated_tau` and
    `checkpoint` (the intended waits) is a stall to remove."""
    if device.type != "cuda" or os.environ.get("DFLASH_SYNC_DEBUG") != "1":
        yield
        return
    torch.cuda.set_sync_debug_mode("warn")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def node_gpu_uuids(device: torch.device) -> list[str]:
    """The GPUs this node's ranks use: rank r takes cuda:LOCAL_RANK (comm.init)."""
    if device.type != "cuda":
        return []
    ranks = min(int(os.environ.get("LOCAL_WORLD_SIZE", "1")), torch.cuda.device_count())
    return [str(torch.cuda.get_device_properties(i).uuid) for i in range(ranks)]
