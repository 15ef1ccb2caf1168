"""Host sampling during training: nvidia-smi parsing and the CPU use of other processes."""

import os
import subprocess
import sys
import time

from dflash.host import OtherCpuUse, parse_gpus, summarize_host

# `nvidia-smi --query-gpu=GPU_QUERIES[0] --format=csv,noheader,nounits` on a three-GPU host: one
# at full clock under the routine power cap, one hot, one whose driver reports no values
SMI = """GPU-5c1f0e3a-0001, 1980, 1980, 41, 0x0000000000000004
GPU-5c1f0e3a-0002, 1395, 1980, 88, 0x0000000000000060
GPU-5c1f0e3a-0003, [N/A], 1980, [N/A], [N/A]
"""


def test_nvidia_smi_fields_become_clock_fractions_and_named_throttle_reasons():
    gpus = parse_gpus(SMI)
    assert gpus[0] == {
        "uuid": "5c1f0e3a-0001",  # as torch names it: without the GPU- prefix
        "sm_clock_fraction": 1.0,
        "temperature_c": 41,
        "throttle": [],  # the software power cap alone is routine under load
    }
    assert gpus[1]["sm_clock_fraction"] == 0.705
    assert gpus[1]["throttle"] == ["thermal (software)", "thermal (hardware)"]
    assert gpus[2]["sm_clock_fraction"] is None and gpus[2]["temperature_c"] is None
    old_driver = parse_gpus("GPU-a, 1500, 1980, 60\n")  # the last query: no throttle field
    assert old_driver[0]["sm_clock_fraction"] == 0.758 and old_driver[0]["throttle"] == []
    summary = summarize_host([{"cpus": 8, "other_cpu_fraction": 0.01, "gpus": gpus}])
    assert summary["gpu_throttle"] == ["thermal (hardware)", "thermal (software)"]
    assert summary["gpu_temperature_c_max"] == 88


def burn(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def test_other_processes_cpu_use_is_counted_and_our_own_is_not():
    other = OtherCpuUse({os.getpid()})
    burn(2)  # our own work: not "other"
    quiet = other()
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
    assert quiet < 0.2 and busy > 0.6, (quiet, busy)


def test_a_rank_that_finishes_first_is_dropped_not_counted_as_negative_work():
    """Target ranks exit before drafter 0 writes the last checkpoint; their ticks vanish from
    /proc and must not turn into "other" work (the first version read 102 % of the CPUs)."""
    rank = subprocess.Popen(
        [sys.executable, "-c", "import time\nt = time.time()\nwhile time.time() < t + 3: pass"]
    )
    other = OtherCpuUse({rank.pid})
    time.sleep(2.5)
    during = other()  # the rank's own work
    rank.wait()
    time.sleep(1)
    after = other()
    assert during < 0.3 and after < 0.6, (during, after)


def test_process_age_counts_from_this_process_start():
    """The seconds training records as `startup_s`: a fresh interpreter that sleeps 1.5 s reports
    about that much plus its own start-up, never less."""
    code = "import time; time.sleep(1.5); from dflash.host import process_age_s; print(process_age_s())"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert 1.5 <= float(done.stdout) < 30
