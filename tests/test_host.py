"""Host sampling during training: nvidia-smi parsing and the CPU contention it measures."""

import subprocess
import sys
import time

from dflash.train.host import HostMonitor, parse_gpus, summarize_host

# `nvidia-smi --query-gpu=GPU_QUERIES[0] --format=csv,noheader,nounits` on a three-GPU host: one
# at full clock under the routine power cap, one hot, one whose driver reports no values
SMI = """0, 1980, 1980, 41, 0x0000000000000004
1, 1395, 1980, 88, 0x0000000000000060
2, [N/A], 1980, [N/A], [N/A]
"""


def test_nvidia_smi_fields_become_clock_fractions_and_named_throttle_reasons():
    gpus = parse_gpus(SMI)
    assert gpus[0] == {
        "index": 0,
        "sm_clock_fraction": 1.0,
        "temperature_c": 41,
        "throttle": [],  # the software power cap alone is routine under load
    }
    assert gpus[1]["sm_clock_fraction"] == 0.705
    assert gpus[1]["throttle"] == ["thermal (software)", "thermal (hardware)"]
    assert gpus[2] == {"index": 2, "sm_clock_fraction": None, "temperature_c": None, "throttle": []}
    without_reasons = parse_gpus("0, 1500, 1980, 60\n")  # the last query, for old drivers
    assert without_reasons[0]["sm_clock_fraction"] == 0.758 and without_reasons[0]["throttle"] == []
    summary = summarize_host([{"cpus": 8, "runnable_per_cpu": 0.5, "gpus": gpus}])
    assert summary["gpu_throttle"] == ["thermal (hardware)", "thermal (software)"]
    assert summary["gpu_temperature_c_max"] == 88


def test_the_monitor_sees_other_processes_competing_for_the_cpus():
    monitor = HostMonitor()
    try:
        time.sleep(3)
        quiet = monitor.window()["runnable_per_cpu"]
        burners = [
            subprocess.Popen([sys.executable, "-c", "while True: pass"])
            for _ in range(monitor.cpus * 2)
        ]
        try:
            time.sleep(1.5)
            monitor.window()  # drop the samples taken while they started
            time.sleep(3)
            busy = monitor.window()["runnable_per_cpu"]
        finally:
            for p in burners:
                p.kill()
    finally:
        monitor.close()
    assert busy - quiet >= 1.5, (quiet, busy)
