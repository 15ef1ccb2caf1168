"""Host sampling during training: NVML's GPU answers and the CPU use of other processes."""

import json
import os
import subprocess
import sys
import time
from types import SimpleNamespace

import pynvml

from dflash import host
from dflash.host import HostMonitor, OtherCpuUse, gpu_sample, gpu_state, summarize_host


def test_gpu_readings_become_clock_fractions_and_named_throttle_reasons():
    # a three-GPU host: one at full clock under the routine power cap, one hot, one whose driver
    # reports no values
    gpus = [
        gpu_state("GPU-5c1f0e3a-0001", 1980, 1980, 41, 0x4),
        gpu_state("GPU-5c1f0e3a-0002", 1395, 1980, 88, 0x60),
        gpu_state("GPU-5c1f0e3a-0003", None, 1980, None, None),
    ]
    assert gpus[0] == {
        "uuid": "5c1f0e3a-0001",  # as torch names it: without the GPU- prefix
        "sm_clock_fraction": 1.0,
        "temperature_c": 41,
        "throttle": [],  # the software power cap alone is routine under load
    }
    assert gpus[1]["sm_clock_fraction"] == 0.705
    assert gpus[1]["throttle"] == ["thermal (software)", "thermal (hardware)"]
    assert gpus[2]["sm_clock_fraction"] is None and gpus[2]["temperature_c"] is None
    assert gpus[2]["throttle"] == []
    summary = summarize_host([{"cpus": 8, "other_cpu_fraction": 0.01, "gpus": gpus}])
    assert summary["gpu_throttle"] == ["thermal (hardware)", "thermal (software)"]
    assert summary["gpu_temperature_c_max"] == 88


class FakeNVML:
    """pynvml's calls on a two-GPU node with an older driver: no clocks-event-reasons call (only
    the throttle-reasons one), and the second GPU reports no temperature."""

    NVML_CLOCK_SM = pynvml.NVML_CLOCK_SM
    NVML_TEMPERATURE_GPU = pynvml.NVML_TEMPERATURE_GPU

    def __init__(self, pids: dict[int, list[int]]):
        self.pids = pids

    def nvmlDeviceGetCount(self):
        return 2

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetUUID(self, i):
        return f"GPU-aaaa-000{i}"

    def nvmlDeviceGetCurrentClocksEventReasons(self, i):
        raise pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, i):
        return 0x40 if i == 1 else 0x1

    def nvmlDeviceGetClockInfo(self, i, clock):
        return 1500

    def nvmlDeviceGetMaxClockInfo(self, i, clock):
        return 1980

    def nvmlDeviceGetTemperature(self, i, sensor):
        if i == 1:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return 60

    def nvmlDeviceGetComputeRunningProcesses(self, i):
        return [SimpleNamespace(pid=p) for p in self.pids[i]]


def test_nvml_sample_of_the_run_gpus_counts_foreign_processes_only_where_ours_are_listed():
    nv = FakeNVML({0: [10, 11], 1: [12, 99]})
    sample = gpu_sample(nv, {"aaaa-0001"}, ours={10, 12})  # the run uses the second GPU only
    assert sample["gpus"] == [
        {
            "uuid": "aaaa-0001",
            "sm_clock_fraction": 0.758,
            "temperature_c": None,
            "throttle": ["thermal (hardware)"],
        }
    ]
    assert sample["foreign_processes"] == 1  # 99; not 11, on a GPU the run does not use
    # NVML shows other pids than ours (a container seeing the host's): no count rather than all
    assert gpu_sample(nv, {"aaaa-0001"}, ours={5})["foreign_processes"] is None
    assert gpu_sample(nv, {"bbbb"}, ours={10}) is None  # none of the run's GPUs


def test_without_nvml_the_monitor_samples_cpus_only(monkeypatch):
    def no_driver():
        raise pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)

    monkeypatch.setattr(pynvml, "nvmlInit", no_driver)
    assert host.nvml() is None
    monitor = HostMonitor(["GPU-aaaa-0001"])
    try:
        assert len(monitor._threads) == 1
        assert set(monitor.window()) == {"cpus", "other_cpu_fraction", "cpu_samples"}
    finally:
        monitor.close()


def burn(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def test_other_processes_cpu_use_is_counted_and_our_own_is_not():
    """Each reading is held against a reference taken over the same interval that counts our
    own process as other work: whatever else the machine runs (the other test worker, other
    users) is in both, so a busy machine does not fail the comparison."""
    other, reference = OtherCpuUse({os.getpid()}), OtherCpuUse(set())
    burn(2)  # our own work: not "other"
    quiet, quiet_reference = other(), reference()
    burners = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"])
        for _ in range(os.cpu_count() or 1)
    ]
    try:
        time.sleep(0.5)
        other()  # drop the interval in which they started
        time.sleep(2)
        busy = other()
    finally:
        for p in burners:
            p.kill()
            p.wait()
    assert quiet < quiet_reference - 0.1 and busy > 0.6, (quiet, quiet_reference, busy)


def test_a_rank_that_finishes_first_is_dropped_not_counted_as_negative_work():
    """Target ranks exit before drafter 0 writes the last checkpoint; their ticks vanish from
    /proc and must not turn into "other" work (the first version read 102 % of the CPUs). The
    reference counts the rank as other work over the same intervals."""
    rank = subprocess.Popen(
        [sys.executable, "-c", "import time\nt = time.time()\nwhile time.time() < t + 3: pass"]
    )
    other, reference = OtherCpuUse({rank.pid}), OtherCpuUse(set())
    time.sleep(2.5)
    during, during_reference = other(), reference()  # the rank's own work left out, and in
    rank.wait()
    time.sleep(1)
    after, after_reference = other(), reference()  # the rank gone: the two agree
    assert during < during_reference - 0.1, (during, during_reference)
    assert abs(after - after_reference) < 0.1, (after, after_reference)


def test_process_age_counts_from_this_process_start():
    """The seconds training records as `startup_s`: a fresh interpreter that sleeps 1.5 s reports
    about that much plus its own start-up, never less."""
    code = "import time; time.sleep(1.5); from dflash.host import process_age_s; print(process_age_s())"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert 1.5 <= float(done.stdout) < 30


def test_run_pids_are_the_siblings_running_the_same_command():
    """torchrun's ranks on a node: children of one parent with one command line. A sibling with
    another command line (here: a sleeper) is not a rank."""
    code = "import time; from dflash.host import run_pids; time.sleep(1.5); print(sorted(run_pids())); time.sleep(1.5)"
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(4)"])
    ranks = [
        subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    try:
        seen = [json.loads(r.communicate(timeout=60)[0]) for r in ranks]
    finally:
        other.kill()
        other.wait()
    assert seen == [sorted(r.pid for r in ranks)] * 2
