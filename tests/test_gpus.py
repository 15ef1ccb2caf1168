"""Parallel GPU jobs on one host each take a GPU of their own, one that finds none free waits, and a
killed job frees its GPU."""

import select
import subprocess
import sys
import textwrap
import time

# A process that sees two (faked) GPUs, claims one, prints it and holds it until stdin closes.
CLAIMER = textwrap.dedent(
    """
    import sys, types, torch
    torch.cuda.device_count = lambda: 2
    torch.cuda.get_device_properties = lambda i: types.SimpleNamespace(uuid=f"GPU-fake-{i}")
    from dflash.gpus import claim_gpu
    print(claim_gpu(poll_s=0.05), flush=True)
    sys.stdin.read()
    """
)


def start(tmp_path, wait=True):
    env = {"DFLASH_GPU_LOCKS": str(tmp_path), "PATH": ""}
    proc = subprocess.Popen(
        [sys.executable, "-c", CLAIMER],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=env,
        text=True,
    )
    return proc, proc.stdout.readline().strip() if wait else None


def test_each_job_gets_its_own_gpu_and_a_killed_one_frees_it(tmp_path):
    first, got_first = start(tmp_path)
    second, got_second = start(tmp_path)
    assert {got_first, got_second} == {"cuda:0", "cuda:1"}
    third, _ = start(tmp_path, wait=False)  # every GPU is held: it waits
    time.sleep(2)
    assert third.poll() is None and not select.select([third.stdout], [], [], 0)[0]
    first.kill()  # no clean-up runs: the kernel drops the lock
    first.wait()
    assert third.stdout.readline().strip() == got_first
    for proc in (second, third):
        proc.communicate("")
