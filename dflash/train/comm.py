"""torch.distributed plumbing: the process group, the drafter sub-group, and feature links.

Features move with point-to-point `isend`/`irecv` (NCCL on GPU: device to device, no host copy;
gloo on CPU). Both backends complete a send only once the receiver has posted the matching
receive, so the unfinished sends a target holds per drafter ARE the queue: a target computes
ahead until `queue_depth` batches wait on a link, then blocks. Each feature tensor travels with a
small stats tensor (the target's compute and blocked time, the queue depth at send, the tokens),
which is how drafters learn about target throughput and queue depth without extra collectives.

Every wait is bounded: by `startup_timeout_s` until the first batch has crossed a link (model
loading and compilation happen then), by `timeout_s` afterwards. When the bound passes, the peer's
heartbeat decides: every rank bumps a counter in the rendezvous store once a second from a thread
of its own (`Heartbeat`), which runs while the main thread computes. A peer whose counter still
moves is alive and slow (a CPU without bf16 units, a slow filesystem, a long checkpoint): the
wait goes on, with a warning each time the bound passes again. A peer whose counter stopped
(frozen, stopped, its host gone) or that died becomes an error naming both ranks, the batch and
the cause, and torchrun then stops every other rank. The process group's own timeout (the
backstop for collectives, and NCCL's watchdog) is the startup one.
"""

from __future__ import annotations

import collections
import datetime
import logging
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from dflash.errors import UserError
from dflash.train.topology import Topology

log = logging.getLogger(__name__)
STATS = ("compute_s", "blocked_s", "queue_depth", "tokens")


class PeerError(UserError):
    """A peer rank died, went silent, or broke a link."""


@dataclass
class Dist:
    """This process's place in the run; a world of one needs no process group."""

    topology: Topology
    rank: int
    device: torch.device
    drafter_group: object | None = None
    target_group: object | None = None  # this rank's sharded-target group (target_shards > 1)
    timeout_s: float = 60.0
    startup_timeout_s: float = 900.0
    store: object | None = None  # the rendezvous store, where heartbeats are kept
    heartbeat: Heartbeat | None = None

    def close(self) -> None:
        """Stop the heartbeat, then leave the process group."""
        if self.heartbeat is not None:
            self.heartbeat.stop()
        if dist.is_initialized():
            dist.destroy_process_group()

    @property
    def role(self) -> tuple[str, int]:
        return self.topology.role(self.rank)

    @property
    def name(self) -> str:
        return self.topology.name(self.rank)

    @property
    def distributed(self) -> bool:
        return self.topology.world > 1

    def target_mesh(self):
        """The device mesh this rank's sharded target spans (None: a whole target)."""
        if self.target_group is None:
            return None
        from torch.distributed.device_mesh import DeviceMesh

        return DeviceMesh.from_group(self.target_group, self.device.type)

    def broadcast(self, obj):
        """Rank 0's `obj` on every rank (all ranks call this)."""
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def drafter_gather(self, obj) -> list:
        """`obj` of every drafter, in drafter order (drafters only)."""
        if self.drafter_group is None:
            return [obj]
        out = [None] * self.topology.drafters
        dist.all_gather_object(out, obj, group=self.drafter_group)
        return out


def die_with_parent() -> None:
    """Ask Linux to SIGKILL this worker when its torchrun agent dies.

    torchrun starts each worker in its own session, so a SIGKILL of torchrun (a scheduler's hard
    kill, `kill -9`) would otherwise leave workers training and writing checkpoints on their own,
    racing the rerun.
    """
    if sys.platform != "linux":
        return
    from dflash import forkserver

    if forkserver.served():  # the tests' fork server is this process's parent, not torchrun
        forkserver.client_dies_with_parent(signal.SIGKILL)  # its client is torchrun's child
        return
    if not forkserver.die_with_parent(signal.SIGKILL, os.getppid()):
        os._exit(1)


HEARTBEAT_S = 1.0
# A peer whose heartbeat did not move for this long is taken for frozen or gone.
SILENT_HEARTBEATS_S = 5 * HEARTBEAT_S


def _heartbeat_key(rank: int) -> str:
    return f"dflash/heartbeat/{rank}"


class Heartbeat:
    """Bumps this rank's counter in the store every HEARTBEAT_S, from a daemon thread: it keeps
    beating while the main thread computes (torch releases the GIL), and stops with the process
    (killed, stopped, or its host gone)."""

    def __init__(self, store, rank: int):
        self.store, self.key = store, _heartbeat_key(rank)
        store.add(self.key, 1)  # the key exists before any peer can look for it
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._beat, name="dflash-heartbeat", daemon=True)
        self.thread.start()

    def _beat(self) -> None:
        while not self.stopped.wait(HEARTBEAT_S):
            try:
                self.store.add(self.key, 1)
            except Exception:  # the store went away: the run is ending
                return

    def stop(self) -> None:
        """Before the process group is torn down: a store call still running in this thread
        while the store is destroyed (or the interpreter exits) can abort the process
        ("terminate called without an active exception", seen once on two nodes)."""
        self.stopped.set()
        self.thread.join(timeout=2 * HEARTBEAT_S)


def peer_alive(store, rank: int, window_s: float = SILENT_HEARTBEATS_S) -> bool:
    """Did `rank`'s heartbeat move within `window_s`? (counted here: no clocks are compared)"""
    key = _heartbeat_key(rank)
    first = store.add(key, 0)
    deadline = time.monotonic() + window_s
    while time.monotonic() < deadline:
        time.sleep(HEARTBEAT_S / 4)
        if store.add(key, 0) != first:
            return True
    return False


def init(topology: Topology, device_name: str, timeout_s: float, startup_timeout_s: float) -> Dist:
    """Join the torchrun world (or run alone when the topology is one colocated drafter)."""
    if "TORCHELASTIC_RUN_ID" in os.environ:
        die_with_parent()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != topology.world:
        raise UserError(
            f"train.topology needs {topology.world} processes "
            f"({topology.targets} targets + {topology.drafters} drafters), "
            f"but WORLD_SIZE is {world}: launch with torchrun --nproc-per-node {topology.world}"
        )
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if device_name == "auto":
        device_name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device_name)
    if device.type == "cuda":
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
    if world == 1:
        return Dist(topology, 0, device, timeout_s=timeout_s, startup_timeout_s=startup_timeout_s)
    dist.init_process_group(
        backend="nccl" if device.type == "cuda" else "gloo",
        timeout=datetime.timedelta(seconds=max(timeout_s, startup_timeout_s)),
        device_id=device if device.type == "cuda" else None,
    )
    # Every rank must create every group, in the same order.
    drafter_ranks = [topology.drafter_rank(d) for d in range(topology.drafters)]
    group = dist.new_group(drafter_ranks) if topology.drafters > 1 else None
    target_group = None
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if topology.target_shards > 1:
        for g in range(topology.target_groups):
            ranks = topology.group_ranks(g)
            made = dist.new_group(ranks)
            target_group = made if rank in ranks else target_group
            if rank == ranks[0] and ranks[0] // per_node != ranks[-1] // per_node:
                # two all-reduces per layer between nodes: far slower than NVLink
                log.warning("target group %d (ranks %s) spans two nodes", g, ranks)
    store = dist.distributed_c10d._get_default_store()
    heartbeat = Heartbeat(store, rank)
    return Dist(
        topology,
        rank,
        device,
        drafter_group=group if rank in drafter_ranks else None,
        target_group=target_group,
        timeout_s=timeout_s,
        startup_timeout_s=startup_timeout_s,
        store=store,
        heartbeat=heartbeat,
    )


def _waiter(work, device: torch.device):
    """`wait_for(seconds) -> bool`: whether `work` completed within `seconds`. NCCL's wait()
    only orders streams, so its completion is polled; gloo completes a p2p op only inside
    wait(), which a thread of its own runs (an error there is re-raised by `wait_for`)."""
    if device.type == "cuda":

        def poll(seconds: float) -> bool:
            deadline = time.monotonic() + seconds
            while not work.is_completed():
                if time.monotonic() > deadline:
                    return False
                time.sleep(0.0002)
            return True

        return poll
    outcome: dict = {}

    def run():
        try:
            work.wait()
        except RuntimeError as e:
            outcome["error"] = e

    thread = threading.Thread(target=run, name="dflash-p2p-wait", daemon=True)
    thread.start()

    def join(seconds: float) -> bool:
        thread.join(seconds)
        if "error" in outcome:
            raise outcome["error"]
        return not thread.is_alive()

    return join


def _wait(work, ctx: Dist, what: str, started: bool, peer: int) -> None:
    """Wait for a p2p op with `peer`; past the startup or steady timeout, on only while the peer's
    heartbeat moves. PeerError when the peer is frozen, gone, or the op fails."""
    limit, key = (ctx.timeout_s, "train.timeout_s")
    if not started:
        limit, key = (ctx.startup_timeout_s, "train.startup_timeout_s")
    peer_name = ctx.topology.name(peer)
    try:
        wait_for, waited = _waiter(work, ctx.device), 0.0
        while not wait_for(limit):
            waited += limit
            if ctx.store is None or not peer_alive(ctx.store, peer):
                raise PeerError(
                    f"{ctx.name}: {what}: nothing for {waited:g} s ({key}) and no heartbeat "
                    f"from {peer_name} for {SILENT_HEARTBEATS_S:g} s: the peer hangs or is gone"
                )
            log.warning(
                "%s: %s: nothing for %g s (%s), but %s is alive (its heartbeat moves): waiting",
                ctx.name,
                what,
                waited,
                key,
                peer_name,
            )
    except RuntimeError as e:
        raise PeerError(f"{ctx.name}: {what}: {str(e).splitlines()[0][:300]}") from None


def send(ctx: Dist, tensor: torch.Tensor, dst: int, what: str) -> None:
    """One blocking send outside the feature links, bounded like them (start-up timeout)."""
    _wait(dist.isend(tensor.contiguous(), dst), ctx, what, started=False, peer=dst)


def receive(ctx: Dist, shape, dtype: torch.dtype, src: int, what: str) -> torch.Tensor:
    """The matching receive."""
    tensor = torch.empty(shape, dtype=dtype, device=ctx.device)
    _wait(dist.irecv(tensor, src), ctx, what, started=False, peer=src)
    return tensor


class FeatureSender:
    """A target's outgoing links, at most `depth` unfinished sends on each."""

    def __init__(self, ctx: Dist, depth: int):
        self.ctx, self.depth = ctx, depth
        self.links: dict[int, collections.deque] = collections.defaultdict(collections.deque)
        self.started: set[int] = set()  # links a batch has crossed

    def send(self, batch: int, dst: int, features: torch.Tensor, compute_s: float, tokens: int):
        link = self.links[dst]
        while link and link[0][0].is_completed():  # NCCL only: gloo completes inside wait()
            self._finish(dst, link.popleft())
        t0 = time.perf_counter()
        while len(link) >= self.depth:
            self._finish(dst, link.popleft())
        blocked = time.perf_counter() - t0
        stats = torch.tensor(
            [compute_s, blocked, len(link) + 1, tokens], dtype=torch.float64, device=features.device
        )
        features = features.contiguous()
        stats_work = dist.isend(stats, dst)
        # The queue tracks the features' send; the handles keep both tensors alive until done.
        link.append((dist.isend(features, dst), stats_work, features, stats, batch))
        return {"blocked_s": blocked, "queue_depth": len(link)}

    def drain(self) -> None:
        for dst, link in self.links.items():
            while link:
                self._finish(dst, link.popleft())

    def _finish(self, dst: int, entry) -> None:
        work, _, _, _, batch = entry
        what = f"sending batch {batch} to {self.ctx.topology.name(dst)}"
        _wait(work, self.ctx, what, started=dst in self.started, peer=dst)
        self.started.add(dst)


class FeatureReceiver:
    """A drafter's incoming features, in batch order, with the next receive posted ahead."""

    def __init__(self, ctx: Dist, dtype: torch.dtype, ahead: int = 1):
        self.ctx, self.dtype, self.ahead = ctx, dtype, ahead

    def stream(self, batches):
        """`batches`: iterable of (batch, src, shape); yields (batch, features, stats, wait_s)."""
        pending = collections.deque()

        def post(item):
            batch, src, shape = item
            feats = torch.empty(shape, dtype=self.dtype, device=self.ctx.device)
            stats = torch.empty(len(STATS), dtype=torch.float64, device=self.ctx.device)
            works = (dist.irecv(stats, src), dist.irecv(feats, src))
            pending.append((batch, src, feats, stats, works))

        started = False
        items = iter(batches)
        for item in items:
            post(item)
            if len(pending) > self.ahead:
                break
        while pending:
            batch, src, feats, stats, works = pending.popleft()
            t0 = time.perf_counter()
            what = f"receiving batch {batch} from {self.ctx.topology.name(src)}"
            for work in works:
                _wait(work, self.ctx, what, started, peer=src)
            started = True
            if feats.is_cuda:
                torch.cuda.current_stream().synchronize()
            wait = time.perf_counter() - t0
            nxt = next(items, None)
            if nxt is not None:
                post(nxt)
            yield batch, feats, dict(zip(STATS, stats.tolist(), strict=True)), wait
