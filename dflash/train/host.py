"""What else the machine was doing while training ran: the record's evidence for "was it the host?".

Drafter 0 runs a `HostMonitor` thread that samples, every `CPU_EVERY_S` seconds, the runnable
threads on the machine (the running count in /proc/loadavg, less the sampler) and, on a host with
nvidia-smi, every `GPU_EVERY_S` seconds, each GPU's SM clock against its maximum, its temperature,
its active throttle reasons and the compute processes on it that are not ranks of this run. Each
metrics line carries the window since the previous line; `summarize_host` condenses the steady
lines for the run summary, and `dflash compare` weighs a change in them as a cause.

What it cannot see: other nodes of a multi-node run (it samples drafter 0's node), and a process
of another job that nvidia-smi cannot show from inside a container.
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import threading
from pathlib import Path

CPU_EVERY_S = 1.0
GPU_EVERY_S = 30.0

# nvidia-smi's clocks_throttle_reasons.active bits that mean something is wrong with the GPU or its
# cooling. Left out: idle and application-clock bits, and the software power cap, which a busy
# GPU hits routinely (its effect shows in the SM clock).
THROTTLE_BITS = {
    0x8: "hardware slowdown",
    0x20: "thermal (software)",
    0x40: "thermal (hardware)",
    0x80: "power brake",
}
# The throttle field was renamed in driver 535 (clocks_event_reasons); older drivers know only the
# old name, and some newer ones may drop it: try both, then go without it.
GPU_QUERIES = [
    f"index,clocks.sm,clocks.max.sm,temperature.gpu,{reasons}"
    for reasons in ("clocks_event_reasons.active", "clocks_throttle_reasons.active")
] + ["index,clocks.sm,clocks.max.sm,temperature.gpu"]


def runnable_threads() -> int:
    """Threads runnable right now on the whole machine, not counting the caller."""
    fields = Path("/proc/loadavg").read_text().split()
    return max(int(fields[3].split("/")[0]) - 1, 0)


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
        index, sm, sm_max, temp, *reasons = (f.strip() for f in line.split(","))
        sm, sm_max = number(sm), number(sm_max)
        bits = number(reasons[0], 16) if reasons else None
        gpus.append(
            {
                "index": int(index),
                "sm_clock_fraction": round(sm / sm_max, 3) if sm and sm_max else None,
                "temperature_c": number(temp),
                "throttle": [name for bit, name in THROTTLE_BITS.items() if bits and bits & bit],
            }
        )
    return gpus


def our_pids() -> set[int]:
    """This process and its siblings: the other ranks torchrun started on this node."""
    parent = os.getppid()
    pids = {os.getpid()}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                status = (entry / "status").read_text()
            except OSError:
                continue
            ppid = next(line for line in status.splitlines() if line.startswith("PPid:"))
            if int(ppid.split()[1]) == parent:
                pids.add(int(entry.name))
    return pids


def _nvidia_smi(*args: str) -> str | None:
    try:
        done = subprocess.run(
            ["nvidia-smi", *args], capture_output=True, text=True, timeout=20, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout


def gpu_sample(ours: set[int]) -> dict | None:
    """Clocks, temperatures and throttling of every GPU, and how many compute processes on them
    are not ours; None without nvidia-smi or when it fails."""
    for query in GPU_QUERIES:
        status = _nvidia_smi(f"--query-gpu={query}", "--format=csv,noheader,nounits")
        if status is not None:
            break
    else:
        return None
    try:
        gpus = parse_gpus(status)
    except ValueError:
        return None
    apps = _nvidia_smi("--query-compute-apps=pid", "--format=csv,noheader") or ""
    pids = {int(p) for p in apps.split() if p.strip().isdigit()}
    # None unless our own process is listed: in a container nvidia-smi may show the host's pids,
    # and then every process, ours too, would look foreign
    return {"gpus": gpus, "foreign_processes": len(pids - ours) if pids & ours else None}


class HostMonitor:
    """Background sampling on drafter 0; `window()` returns and resets what it saw."""

    def __init__(self):
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._runnable: list[int] = []
        self._gpu: dict | None = None
        self.cpus = os.cpu_count() or 1
        self._gpus = shutil.which("nvidia-smi") is not None
        self._thread = threading.Thread(target=self._loop, name="host-monitor", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        ours = our_pids() if self._gpus else set()
        waited = GPU_EVERY_S
        while not self._stop.is_set():
            if self._gpus and waited >= GPU_EVERY_S:
                sample, waited = gpu_sample(ours), 0.0
                with self._lock:
                    self._gpu = sample
            with self._lock:
                self._runnable.append(runnable_threads())
            self._stop.wait(CPU_EVERY_S)
            waited += CPU_EVERY_S

    def window(self) -> dict:
        with self._lock:
            runnable, self._runnable = self._runnable, []
            gpu = self._gpu
        host = {
            "cpus": self.cpus,
            "runnable_per_cpu": round(statistics.fmean(runnable) / self.cpus, 3)
            if runnable
            else None,
        }
        if gpu is not None:
            host |= gpu
        return host

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def summarize_host(windows: list[dict]) -> dict | None:
    """The run's host conditions from the steady metrics lines' windows."""
    windows = [w for w in windows if w]
    if not windows:
        return None
    runnable = [w["runnable_per_cpu"] for w in windows if w.get("runnable_per_cpu") is not None]
    gpus = [g for w in windows for g in w.get("gpus") or []]
    clocks = [g["sm_clock_fraction"] for g in gpus if g["sm_clock_fraction"] is not None]
    # the median: a sample taken while the GPU waits (a checkpoint write) reads idle clocks
    temps = [g["temperature_c"] for g in gpus if g["temperature_c"] is not None]
    foreign = [w["foreign_processes"] for w in windows if w.get("foreign_processes") is not None]
    return {
        "cpus": windows[-1].get("cpus"),
        "runnable_per_cpu": round(statistics.fmean(runnable), 3) if runnable else None,
        "runnable_per_cpu_max": max(runnable, default=None),
        "gpu_sm_clock_fraction": statistics.median(clocks) if clocks else None,
        "gpu_temperature_c_max": max(temps, default=None),
        "gpu_throttle": sorted({r for g in gpus for r in g["throttle"]}),
        "gpu_foreign_processes_max": max(foreign, default=None),
    }


def describe_host(host: dict | None) -> str:
    """One sentence for the run summary, e.g. "0.52 runnable threads per CPU (2 CPUs)"."""
    if not host or host.get("runnable_per_cpu") is None:
        return "not sampled (the run was shorter than a sample interval)"
    parts = [f"{host['runnable_per_cpu']:.2f} runnable threads per CPU ({host['cpus']} CPUs)"]
    if host.get("gpu_sm_clock_fraction") is not None:
        parts.append(f"GPU SM clock {host['gpu_sm_clock_fraction']:.0%} of its maximum (median)")
    if host.get("gpu_throttle"):
        parts.append("GPU throttling: " + ", ".join(host["gpu_throttle"]))
    if host.get("gpu_foreign_processes_max"):
        parts.append(f"{host['gpu_foreign_processes_max']} other processes on the GPUs")
    return "; ".join(parts)
