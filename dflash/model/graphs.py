"""CUDA graphs for fixed-shape decode steps, and a step's tokens on their way to the host."""

from __future__ import annotations

import logging
import os
import time

import torch

log = logging.getLogger(__name__)


class CudaGraphs:
    """Runs `fn(*inputs)` as one CUDA graph per `key` (the step's shape): the first call of a key
    runs it eagerly on a side stream (as capture requires), captures it and replays it; later
    calls copy their inputs into the captured ones and replay. Outputs are cloned, since the
    next replay reuses their memory. On other devices, with `DFLASH_CUDA_GRAPHS=0`, or once a
    capture has failed (logged), it simply calls `fn`.

    `fn` must be idempotent for equal inputs (it is replayed after the warm-up run) and must not
    synchronise with the host.
    """

    def __init__(self, device: torch.device):
        self.enabled = device.type == "cuda" and os.environ.get("DFLASH_CUDA_GRAPHS", "1") != "0"
        self.graphs: dict = {}
        self.pool = torch.cuda.graph_pool_handle() if self.enabled else None
        # seconds spent capturing, the eager run before each capture included (where
        # torch.compile compiles): one-off costs a decoding clock leaves out
        self.setup_s = 0.0

    def __call__(self, key, fn, *inputs):
        if not self.enabled:
            return fn(*inputs)
        if key not in self.graphs:
            torch.cuda.synchronize()
            started = time.perf_counter()
            try:
                self.graphs[key] = self._capture(fn, inputs)
            except RuntimeError as e:  # decode eagerly rather than fail an evaluation
                log.warning("CUDA graph capture failed (%s); decoding eagerly", e)
                self.enabled = False
                return fn(*inputs)
            finally:
                torch.cuda.synchronize()
                self.setup_s += time.perf_counter() - started
        graph, static, outputs = self.graphs[key]
        for buffer, x in zip(static, inputs, strict=True):
            buffer.copy_(x)
        graph.replay()
        return tuple(o.clone() for o in outputs)

    def _capture(self, fn, inputs):
        static = [x.clone() for x in inputs]
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn(*static)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            outputs = fn(*static)
        return graph, static, outputs

    def clear(self) -> None:
        """Drop every graph (their buffers are about to be replaced). Later captures use a new
        memory pool: capturing into a pool whose graphs were all freed trips an internal assert
        of PyTorch's caching allocator (`use_count > 0`, seen with torch 2.11 on an H200)."""
        self.graphs.clear()
        if self.enabled:
            self.pool = torch.cuda.graph_pool_handle()


class PendingTokens:
    """A decode step's tokens on their way to the host; `get()` waits for them."""

    def __init__(self, host: torch.Tensor, device: torch.device):
        self.host = host
        self.event = None
        if device.type == "cuda":
            self.event = torch.cuda.Event()
            self.event.record()

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()

    def get(self) -> list[int]:
        self.wait()
        return self.host.tolist()


def capture_seconds(*owners) -> float:
    """Seconds the `graphs` (CudaGraphs) of these sessions, or of their `session`, spent on
    captures so far: what a shape's first use costs a decoding clock once (graph-less: 0)."""
    sessions = [getattr(o, "session", o) for o in owners]
    return sum(g.setup_s for o in sessions if (g := getattr(o, "graphs", None)) is not None)
