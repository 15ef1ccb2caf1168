"""Parallel GPU jobs on one host each take a GPU of their own, and a killed job frees its GPU."""

import subprocess
import sys
import textwrap

# A process that sees two (faked) GPUs, claims one, prints it and holds it until stdin closes.
CLAIMER = textwrap.dedent(
    """
    import sys, types, torch
    torch.cuda.device_count = lambda: 2
    torch.cuda.get_device_properties = lambda i: types.SimpleNamespace(uuid=f"GPU-fake-{i}")
    from dflash.errors import UserError
    from dflash.gpus import claim_gpu
    try:
        print(claim_gpu(), flush=True)
    except UserError as e:
        print("refused:", e, flush=True)
    sys.stdin.read()
    """
)


def start(tmp_path):
    env = {"DFLASH_GPU_LOCKS": str(tmp_path), "PATH": ""}
    proc = subprocess.Popen(
        [sys.executable, "-c", CLAIMER],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=env,
        text=True,
    )
    return proc, proc.stdout.readline().strip()


def test_each_job_gets_its_own_gpu_and_a_killed_one_frees_it(tmp_path):
    first, got_first = start(tmp_path)
    second, got_second = start(tmp_path)
    assert {got_first, got_second} == {"cuda:0", "cuda:1"}
    third, got_third = start(tmp_path)
    assert got_third.startswith("refused: all 2 visible GPUs are held")
    third.communicate("")
    first.kill()  # no clean-up runs: the kernel drops the lock
    first.wait()
    fourth, got_fourth = start(tmp_path)
    assert got_fourth == got_first
    for proc in (second, fourth):
        proc.communicate("")
