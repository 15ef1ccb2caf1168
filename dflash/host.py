"""What else the machine was doing while training ran: the record's evidence for "was it the host?".

Drafter 0 runs a `HostMonitor`. Every `CPU_EVERY_S` seconds it reads how much of all CPUs' time
went to processes other than this run's ranks (/proc/stat less the ranks' own ticks; a virtual
machine's steal time counts as other work). On a GPU run, a second thread asks nvidia-smi every
`GPU_EVERY_S` seconds about the GPUs this node's ranks use: SM clock against its maximum,
temperature, thermal or hardware throttling, and compute processes that are not ranks of this run.
Each metrics line carries the window since the previous line; `summarize_host` condenses the
steady lines for the run summary, and `dflash compare` weighs a change in them as a cause.

What it cannot see: other nodes of a multi-node run (it samples drafter 0's node), a cgroup CPU
limit (/proc/stat is the whole machine's), and processes that nvidia-smi cannot show from inside
a container.
"""

from __future__ import annotations

import logging
import os
import shutil
import statistics
import subprocess
import threading
import time
from pathlib import Path

log = logging.getLogger("dflash.train")

CPU_EVERY_S = 1.0
GPU_FIRST_S = 5.0  # after the first steps, not while the GPUs still idle
GPU_EVERY_S = 30.0

# nvidia-smi's clocks_event_reasons.active bits that mean something is wrong with the GPU or its
# cooling. Left out: idle and application-clock bits, and the software power cap, which a busy
# GPU hits routinely (its effect shows in the SM clock).
THROTTLE_BITS = {
    0x8: "hardware slowdown",
    0x20: "thermal (software)",
    0x40: "thermal (hardware)",
    0x80: "power brake",
}
# The throttle field was renamed in driver 535 (clocks_event_reasons); older drivers know only the
# old name, and newer ones may drop it: try both, then go without it.
GPU_QUERIES = [
    f"uuid,clocks.sm,clocks.max.sm,temperature.gpu,{reasons}"
    for reasons in ("clocks_event_reasons.active", "clocks_throttle_reasons.active")
] + ["uuid,clocks.sm,clocks.max.sm,temperature.gpu"]


# ---------------------------------------------------------------------------------- CPUs


def cpu_ticks() -> tuple[int, int]:
    """(busy, total) clock ticks of all CPUs since boot, from /proc/stat's first line."""
    user, nice, system, idle, iowait, irq, softirq, steal = map(
        int, Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]
    )
    busy = user + nice + system + irq + softirq + steal
    return busy, busy + idle + iowait


def _stat_fields(pid: int | str) -> list[str]:
    """/proc/<pid>/stat from the state field on (after "pid (comm)", whose comm may hold spaces
    or parentheses); OSError once the process has exited."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def process_ticks(pid: int) -> int | None:
    """User + system clock ticks of a process, all threads and reaped children included; None
    once it has exited."""
    try:
        fields = _stat_fields(pid)
    except OSError:
        return None
    return sum(int(f) for f in fields[11:15])  # utime, stime, cutime, cstime


# What a training process does before its first step, in order (`startup_split_s` in its
# summary: seconds of each, by `process_age_s` at their ends)
STARTUP_PHASES = ("imports", "setup", "resume_and_live_view", "compile")


def process_age_s() -> float | None:
    """Seconds since this process started, to 0.1 s: its interpreter's start, so imports count
    (a torchrun worker's own start: the launcher's seconds before it are not; a resumed run's
    process counts from its own start). None where /proc is missing."""
    try:
        start_ticks = int(_stat_fields("self")[19])  # field 22, starttime: ticks after boot
    except (OSError, ValueError, IndexError):
        return None
    # starttime counts on the boot clock (suspend included), so read the same clock
    return round(
        time.clock_gettime(time.CLOCK_BOOTTIME) - start_ticks / os.sysconf("SC_CLK_TCK"), 1
    )


def run_pids() -> set[int]:
    """This process and the other ranks torchrun started on this node: siblings running the same
    command line (not everything the parent started, e.g. a test's other processes)."""
    me, parent = os.getpid(), os.getppid()
    command = Path(f"/proc/{me}/cmdline").read_bytes()
    pids = {me}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        try:
            ppid = int(_stat_fields(entry.name)[1])
            if ppid == parent and (entry / "cmdline").read_bytes() == command:
                pids.add(int(entry.name))
        except (OSError, ValueError, IndexError):
            continue
    return pids


class OtherCpuUse:
    """Fraction of all CPU time spent outside the given processes since the previous call."""

    def __init__(self, pids: set[int]):
        self.ticks = {pid: t for pid in pids if (t := process_ticks(pid)) is not None}
        self.busy, self.total = cpu_ticks()

    def __call__(self) -> float | None:
        busy, total = cpu_ticks()
        ours = 0
        for pid, last in list(self.ticks.items()):
            now = process_ticks(pid)
            if now is None:  # a rank that finished (targets stop before drafter 0): drop it
                del self.ticks[pid]
            else:
                ours += now - last
                self.ticks[pid] = now
        d_busy, d_total = busy - self.busy, total - self.total
        self.busy, self.total = busy, total
        if d_total <= 0:
            return None
        return min(max(d_busy - ours, 0) / d_total, 1.0)


# ---------------------------------------------------------------------------------- GPUs


def _uuid(s: str) -> str:
    return s.strip().lower().removeprefix("gpu-")


def parse_gpus(text: str) -> list[dict]:
    """`nvidia-smi --query-gpu=<one of GPU_QUERIES> --format=csv,noheader,nounits` output, one
    dict per GPU; a field the driver reports as unsupported is None."""

    def number(s: str, base: int = 10) -> int | None:
        try:
            return int(float(s)) if base == 10 else int(s, base)
        except ValueError:
            return None

    gpus = []
    for line in text.strip().splitlines():
        uuid, sm, sm_max, temp, *reasons = (f.strip() for f in line.split(","))
        sm, sm_max = number(sm), number(sm_max)
        bits = number(reasons[0], 16) if reasons else None
        gpus.append(
            {
                "uuid": _uuid(uuid),
                "sm_clock_fraction": round(sm / sm_max, 3) if sm and sm_max else None,
                "temperature_c": number(temp),
                "throttle": [name for bit, name in THROTTLE_BITS.items() if bits and bits & bit],
            }
        )
    return gpus


def _nvidia_smi(*args: str) -> str | None:
    try:
        done = subprocess.run(
            ["nvidia-smi", *args], capture_output=True, text=True, timeout=20, check=True
        )
    except (OSError, ValueError, subprocess.SubprocessError):
        return None
    return done.stdout


def gpu_sample(uuids: set[str], ours: set[int]) -> dict | None:
    """Clocks, temperatures and throttling of the run's GPUs, and how many compute processes on
    the node are not ranks of this run; None without a usable answer from nvidia-smi."""
    for query in GPU_QUERIES:
        status = _nvidia_smi(f"--query-gpu={query}", "--format=csv,noheader,nounits")
        if status is not None:
            break
    else:
        return None
    gpus = [g for g in parse_gpus(status) if g["uuid"] in uuids]
    if not gpus:
        return None
    apps = _nvidia_smi("--query-compute-apps=pid,gpu_uuid", "--format=csv,noheader") or ""
    pids = {
        int(pid)
        for pid, gpu in (line.split(",") for line in apps.strip().splitlines() if "," in line)
        if pid.strip().isdigit() and _uuid(gpu) in uuids
    }
    # None unless a rank of ours is listed: inside a container nvidia-smi may show the host's
    # pids, and then every process, ours too, would look foreign
    foreign = len(pids - ours) if pids & ours else None
    return {"gpus": gpus, "foreign_processes": foreign}


# ---------------------------------------------------------------------------------- monitor


class HostMonitor:
    """Background sampling on drafter 0; `window()` returns and resets what it saw.

    `gpu_uuids` are the GPUs this node's ranks use (none on CPU). Sampling never stops training:
    an error is logged once and that kind of sample is dropped."""

    def __init__(self, gpu_uuids: list[str] = ()):
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._other: list[float] = []
        self._gpu: dict | None = None
        self.cpus = os.cpu_count() or 1
        self._pids = run_pids()
        self._threads = [threading.Thread(target=self._cpu_loop, daemon=True)]
        if gpu_uuids and shutil.which("nvidia-smi"):
            uuids = {_uuid(u) for u in gpu_uuids}
            self._threads.append(
                threading.Thread(target=self._gpu_loop, args=(uuids,), daemon=True)
            )
        for t in self._threads:
            t.start()

    def _cpu_loop(self) -> None:
        try:
            other = OtherCpuUse(self._pids)
            while not self._stop.wait(CPU_EVERY_S):
                fraction = other()
                if fraction is not None:
                    with self._lock:
                        self._other.append(fraction)
        except Exception as e:  # e.g. no /proc: train without host evidence
            log.warning("host monitor: CPU sampling stopped: %s", e)

    def _gpu_loop(self, uuids: set[str]) -> None:
        wait = GPU_FIRST_S
        while not self._stop.wait(wait):
            wait = GPU_EVERY_S
            try:
                sample = gpu_sample(uuids, self._pids)
            except Exception as e:
                log.warning("host monitor: GPU sampling stopped: %s", e)
                with self._lock:
                    self._gpu = None  # no stale evidence
                return
            with self._lock:
                self._gpu = sample  # None without a usable answer: no stale evidence either

    def window(self) -> dict:
        with self._lock:
            other, self._other = self._other, []
            gpu = self._gpu
        host = {
            "cpus": self.cpus,
            "other_cpu_fraction": round(statistics.fmean(other), 3) if other else None,
        }
        return host | gpu if gpu else host

    def close(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=1)


def summarize_host(windows: list[dict]) -> dict | None:
    """The run's host conditions from the steady metrics lines' windows."""
    windows = [w for w in windows if w]
    if not windows:
        return None
    other = [w["other_cpu_fraction"] for w in windows if w.get("other_cpu_fraction") is not None]
    gpus = [g for w in windows for g in w.get("gpus") or []]
    clocks = [g["sm_clock_fraction"] for g in gpus if g["sm_clock_fraction"] is not None]
    temps = [g["temperature_c"] for g in gpus if g["temperature_c"] is not None]
    foreign = [w["foreign_processes"] for w in windows if w.get("foreign_processes") is not None]
    return {
        "cpus": windows[-1].get("cpus"),
        "other_cpu_fraction": round(statistics.fmean(other), 3) if other else None,
        "other_cpu_fraction_max": max(other, default=None),
        # the median: a sample taken while the GPUs wait (a checkpoint write) reads idle clocks
        "gpu_sm_clock_fraction": statistics.median(clocks) if clocks else None,
        "gpu_temperature_c_max": max(temps, default=None),
        "gpu_throttle": sorted({r for g in gpus for r in g["throttle"]}),
        "gpu_foreign_processes_max": max(foreign, default=None),
    }


def describe_host(host: dict | None) -> str:
    """One sentence for the run summary, e.g. "other processes used 3% of the 2 CPUs"."""
    if not host or host.get("other_cpu_fraction") is None:
        return "not sampled (the run was shorter than a sample interval)"
    parts = [f"other processes used {host['other_cpu_fraction']:.0%} of the {host['cpus']} CPUs"]
    if host.get("gpu_sm_clock_fraction") is not None:
        parts.append(f"GPU SM clock {host['gpu_sm_clock_fraction']:.0%} of its maximum (median)")
    if host.get("gpu_throttle"):
        parts.append("GPU throttling: " + ", ".join(host["gpu_throttle"]))
    if host.get("gpu_foreign_processes_max"):
        parts.append(f"{host['gpu_foreign_processes_max']} other processes on the GPUs")
    return "; ".join(parts)
