"""What else the machine was doing while training or an evaluation ran: the record's evidence for
"was it the host?".

Drafter 0 runs a `HostMonitor`, and so does each evaluation stage (a window per decoding method: was
its wall clock taken beside other work?). Every `CPU_EVERY_S` seconds it reads (psutil) how much of
all CPUs' time went to processes other than this run's ranks (the machine's CPU times less the
ranks' own; a virtual machine's steal time counts as other work). On a GPU run, a second thread asks
NVML (nvidia-ml-py) every `GPU_EVERY_S` seconds about the GPUs this node's ranks use: SM clock
against its maximum, temperature, thermal or hardware throttling, and compute processes that are not
ranks of this run. Each metrics line carries the window since the previous line; `summarize_host`
condenses the steady lines for the run summary, and `dflash compare` weighs a change in them as a
cause.

What it cannot see: other nodes of a multi-node run (it samples drafter 0's node), a cgroup CPU
limit (the CPU times are the whole machine's), and processes that NVML cannot show from inside a
container. Without NVML (no NVIDIA driver, or no nvidia-ml-py) there is no GPU sample.
"""

from __future__ import annotations

import logging
import os
import statistics
import threading
import time
from pathlib import Path

import psutil

log = logging.getLogger("dflash.train")

CPU_EVERY_S = 1.0
GPU_FIRST_S = 5.0  # after the first steps, not while the GPUs still idle
GPU_EVERY_S = 30.0

# NVML's clocks event (throttle) reason bits that mean something is wrong with the GPU or its
# cooling (nvmlClocksEventReasonHwSlowdown, ...SwThermalSlowdown, ...HwThermalSlowdown,
# ...HwPowerBrakeSlowdown). Left out: idle and application-clock bits, and the software power cap,
# which a busy GPU hits routinely (its effect shows in the SM clock).
THROTTLE_BITS = {
    0x8: "hardware slowdown",
    0x20: "thermal (software)",
    0x40: "thermal (hardware)",
    0x80: "power brake",
}


# ---------------------------------------------------------------------------------- CPUs

# The machine's CPU time that is work (idle and iowait are not). On Linux these are /proc/stat's
# fields; other systems report fewer (a missing one counts 0).
BUSY_FIELDS = ("user", "nice", "system", "irq", "softirq", "steal")
IDLE_FIELDS = ("idle", "iowait")


def cpu_seconds() -> tuple[float, float]:
    """(busy, total) seconds of all CPUs since boot."""
    times = psutil.cpu_times()
    busy = sum(getattr(times, f, 0.0) for f in BUSY_FIELDS)
    return busy, busy + sum(getattr(times, f, 0.0) for f in IDLE_FIELDS)


def process_seconds(process: psutil.Process) -> float | None:
    """User + system CPU seconds of a process, all threads and reaped children included; None
    once it has exited."""
    try:
        t = process.cpu_times()
    except psutil.Error:
        return None
    return t.user + t.system + t.children_user + t.children_system


# What a training process does before its first step, in order (`startup_split_s` in its
# summary: seconds of each, by `process_age_s` at their ends)
STARTUP_PHASES = ("imports", "setup", "resume_and_live_view", "compile")


def process_age_s() -> float | None:
    """Seconds since this process started, to 0.1 s: its interpreter's start, so imports count
    (a torchrun worker's own start: the launcher's seconds before it are not; a resumed run's
    process counts from its own start). None where /proc is missing.

    Read from /proc, not psutil: psutil's create_time adds the boot time, which /proc/stat gives
    in whole seconds, so its age would be off by up to a second."""
    try:
        # after "pid (comm)", whose comm may hold spaces or parentheses: field 22, starttime,
        # clock ticks after boot
        stat = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        start_ticks = int(stat[19])
    except (OSError, ValueError, IndexError):
        return None
    # starttime counts on the boot clock (suspend included), so read the same clock
    return round(
        time.clock_gettime(time.CLOCK_BOOTTIME) - start_ticks / os.sysconf("SC_CLK_TCK"), 1
    )


def run_pids() -> set[int]:
    """This process and the other ranks torchrun started on this node: siblings running the same
    command line (not everything the parent started, e.g. a test's other processes)."""
    me = psutil.Process()
    pids = {me.pid}
    try:
        command = me.cmdline()
        siblings = psutil.Process(me.ppid()).children()
    except psutil.Error:
        return pids
    for p in siblings:
        try:
            if p.pid != me.pid and p.cmdline() == command:
                pids.add(p.pid)
        except psutil.Error:  # exited meanwhile, or not ours to read
            continue
    return pids


class OtherCpuUse:
    """Fraction of all CPU time spent outside the given processes since the previous call."""

    def __init__(self, pids: set[int]):
        self.seconds: dict[psutil.Process, float] = {}
        for pid in pids:
            try:
                process = psutil.Process(pid)
            except psutil.Error:
                continue
            if (t := process_seconds(process)) is not None:
                self.seconds[process] = t
        self.busy, self.total = cpu_seconds()

    def __call__(self) -> float | None:
        busy, total = cpu_seconds()
        ours = 0.0
        for process, last in list(self.seconds.items()):
            now = process_seconds(process)
            if now is None:  # a rank that finished (targets stop before drafter 0): drop it
                del self.seconds[process]
            else:
                ours += now - last
                self.seconds[process] = now
        d_busy, d_total = busy - self.busy, total - self.total
        self.busy, self.total = busy, total
        if d_total <= 0:
            return None
        return min(max(d_busy - ours, 0.0) / d_total, 1.0)


# ---------------------------------------------------------------------------------- GPUs


def _uuid(s: str | bytes) -> str:
    if isinstance(s, bytes):
        s = s.decode()
    return s.strip().lower().removeprefix("gpu-")


def gpu_state(
    uuid: str, sm: int | None, sm_max: int | None, temp: int | None, reasons: int | None
) -> dict:
    """One GPU's sample from what NVML reported; a value it did not report is None."""
    return {
        "uuid": _uuid(uuid),
        "sm_clock_fraction": round(sm / sm_max, 3) if sm and sm_max else None,
        "temperature_c": temp,
        "throttle": [name for bit, name in THROTTLE_BITS.items() if reasons and reasons & bit],
    }


def nvml():
    """The initialised `pynvml` module, or None without nvidia-ml-py or an NVIDIA driver."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # ImportError, or NVMLError: no libnvidia-ml, no driver, no GPU
        return None
    return pynvml


def _ask(call, *args):
    """An NVML query's answer, None where the GPU or driver does not support it."""
    try:
        return call(*args)
    except Exception:  # NVMLError_NotSupported, _FunctionNotFound (an older driver), ...
        return None


def gpu_sample(nv, uuids: set[str], ours: set[int]) -> dict | None:
    """Clocks, temperatures and throttling of the run's GPUs (`nv`: the initialised pynvml), and
    how many compute processes on the node are not ranks of this run; None when NVML shows none
    of the run's GPUs."""
    gpus, pids, listed = [], set(), True
    for i in range(nv.nvmlDeviceGetCount()):
        handle = nv.nvmlDeviceGetHandleByIndex(i)
        uuid = _uuid(nv.nvmlDeviceGetUUID(handle))
        if uuid not in uuids:
            continue
        # the throttle call was renamed in driver 535 (clocks event reasons); older drivers know
        # only the old name
        reasons = _ask(getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None), handle)
        if reasons is None:
            reasons = _ask(nv.nvmlDeviceGetCurrentClocksThrottleReasons, handle)
        gpus.append(
            gpu_state(
                uuid,
                _ask(nv.nvmlDeviceGetClockInfo, handle, nv.NVML_CLOCK_SM),
                _ask(nv.nvmlDeviceGetMaxClockInfo, handle, nv.NVML_CLOCK_SM),
                _ask(nv.nvmlDeviceGetTemperature, handle, nv.NVML_TEMPERATURE_GPU),
                reasons,
            )
        )
        apps = _ask(nv.nvmlDeviceGetComputeRunningProcesses, handle)
        if apps is None:
            listed = False
        else:
            pids |= {p.pid for p in apps}
    if not gpus:
        return None
    # None unless a rank of ours is listed: inside a container NVML may show the host's pids, and
    # then every process, ours too, would look foreign
    foreign = len(pids - ours) if listed and pids & ours else None
    return {"gpus": gpus, "foreign_processes": foreign}


# ---------------------------------------------------------------------------------- monitor


class HostMonitor:
    """Background sampling on drafter 0; `window()` returns and resets what it saw.

    `gpu_uuids` are the GPUs this node's ranks use (none on CPU). Sampling never stops training:
    an error is logged once and that kind of sample is dropped."""

    def __init__(self, gpu_uuids: list[str] = (), gpu_every_s: float = GPU_EVERY_S):
        self.gpu_every_s = gpu_every_s
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._other: list[float] = []
        self._gpu: dict | None = None
        self.cpus = os.cpu_count() or 1
        self._pids = run_pids()
        self._threads = [threading.Thread(target=self._cpu_loop, daemon=True)]
        self._nvml = nvml() if gpu_uuids else None
        if self._nvml is not None:
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
        wait = min(GPU_FIRST_S, self.gpu_every_s)
        while not self._stop.wait(wait):
            wait = self.gpu_every_s
            try:
                sample = gpu_sample(self._nvml, uuids, self._pids)
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
            "cpu_samples": len(other),
        }
        return host | gpu if gpu else host

    def close(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=1)
        if self._nvml is not None and not any(t.is_alive() for t in self._threads):
            _ask(self._nvml.nvmlShutdown)


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
        # seconds sampled: a few say little (whatever else started in them), `compare` needs more
        "other_cpu_samples": sum(w.get("cpu_samples", 0) for w in windows),
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
