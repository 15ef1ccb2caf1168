"""A training step's telemetry says when the step is launch-bound: the GPU had run the step's work
before the host had queued all of it, so the host CPU sets the rate."""

from __future__ import annotations

import pytest
import torch

from dflash.train.progress import describe
from dflash.train.telemetry import PHASES, Window, step_record, summarize


class Colocated:
    colocated = True


def window(launch_bound: bool | None) -> dict:
    w = {
        "tokens": 1000,
        "wall_s": 0.01,
        "time_s": dict.fromkeys(PHASES, 0.002),
        "peak_memory_gb": 1.0,
        "links": {},
    }
    if launch_bound is None:
        return w
    host = dict.fromkeys(PHASES, 0.0) | {"forward": 0.0019, "backward": 0.0004}
    return w | {"launch_bound": launch_bound, "host_s": host}


def record(*flags) -> dict:
    metrics = [{"loss": 1.0, "tau": 2.0, "acc": [0.5]}] * len(flags)
    return step_record([window(f) for f in flags], Colocated(), metrics)


def test_a_step_is_launch_bound_when_every_drafters_device_waited_and_the_verdict_says_so():
    assert record(True, True)["launch_bound"] is True
    assert record(True, False)["launch_bound"] is False  # one drafter's GPU had a backlog
    assert "launch_bound" not in record(None)  # CPU: nothing is launched ahead
    topology = {"targets": 0, "drafters": 1}
    first = record(False)  # the first step (compilation) is left out of the rates
    bound = summarize([first] + [record(True)] * 3 + [record(False)], topology, 2)
    assert bound["launch_bound_fraction"] == 0.75
    assert "launch-bound in 75% of steps" in bound["verdict"]
    # the host's time in each phase beside the GPU's: the forward was paced by the host
    assert bound["host_share"] == {"features": 0.0, "forward": 0.95, "backward": 0.2,
                                   "optimizer": 0.0}  # fmt: skip
    assert "forward (host 95% of its GPU time)" in bound["verdict"]
    # a resumed run's older lines (no host time) do not dilute the share
    older = {**record(None), "time_s": dict.fromkeys(PHASES, 0.01)}
    resumed = summarize([first, older, older] + [record(True)] * 2, topology, 2)
    assert resumed["host_share"]["forward"] == 0.95
    busy = summarize([first] + [record(False)] * 3 + [record(True)], topology, 2)
    assert busy["launch_bound_fraction"] == 0.25 and "launch-bound" not in busy["verdict"]
    cpu = summarize([record(None)] * 3, topology, 2)
    assert "launch_bound_fraction" not in cpu and "launch-bound" not in cpu["verdict"]


def test_the_live_line_names_a_launch_bound_step():
    line = {**record(True), "step": 3, "lr": 1e-3}
    assert "tok/s launch-bound" in describe(line)
    assert "launch-bound" not in describe({**record(False), "step": 3, "lr": 1e-3})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="launches are a GPU's")
def test_many_tiny_kernels_are_launch_bound_and_a_few_large_ones_are_not():
    device = torch.device("cuda")

    def step(work) -> bool:
        w = Window(device)
        for phase in ("forward", "backward"):
            with w.phase(phase):
                work()
        with w.phase("optimizer"):
            torch.ones(8, device=device).add_(1)
        w.seal()
        window = w.close()
        assert window["host_s"]["forward"] > 0 and window["host_s"]["wait"] == 0
        return window["launch_bound"]

    tiny = torch.ones(8, device=device)
    big = torch.randn(8192, 8192, device=device)

    def tiny_kernels():  # each add is a launch of ~microseconds of work
        for _ in range(2000):
            tiny.add_(1e-6)

    def large_kernels():  # seconds of matmuls queued in microseconds
        for _ in range(20):
            big @ big

    for work in (tiny_kernels, large_kernels):  # warm: allocator, cuBLAS handles
        step(work)
    assert sum(step(tiny_kernels) for _ in range(5)) >= 4
    assert not any(step(large_kernels) for _ in range(5))
