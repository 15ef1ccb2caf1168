"""Who does what: ranks, roles and the routing of global batches.

Ranks `0..D-1` are drafters (drafter 0 is rank 0, the one that writes checkpoints and outputs),
ranks `D..D+T-1` are targets. `targets == 0` means colocated: each drafter runs its own target.
Global batch i of an epoch is computed by target `i % T` and trained on by drafter `i % D`
(`dflash.data.batching.route`), so the same config and topology give the same batches, on the
same ranks, in the same order on every rerun. An epoch uses the largest multiple of D batches
so that every drafter takes the same number of optimizer steps (DDP needs that); the dropped
tail (< D batches) is different every epoch because the plan is reshuffled.
"""

from __future__ import annotations

from dataclasses import dataclass

from dflash.data.batching import route


@dataclass(frozen=True)
class Topology:
    targets: int
    drafters: int

    def __post_init__(self):
        if self.drafters < 1 or self.targets < 0:
            raise ValueError(f"need drafters >= 1 and targets >= 0, got {self}")

    @property
    def world(self) -> int:
        return self.targets + self.drafters

    @property
    def colocated(self) -> bool:
        return self.targets == 0

    def as_dict(self) -> dict:
        return {"targets": self.targets, "drafters": self.drafters}

    def role(self, rank: int) -> tuple[str, int]:
        """("drafter", d) or ("target", t) for a global rank."""
        if not 0 <= rank < self.world:
            raise ValueError(f"rank {rank} outside a world of {self.world}")
        return ("drafter", rank) if rank < self.drafters else ("target", rank - self.drafters)

    def drafter_rank(self, d: int) -> int:
        return d

    def target_rank(self, t: int) -> int:
        return self.drafters + t

    def name(self, rank: int) -> str:
        role, index = self.role(rank)
        return f"rank {rank} ({role} {index})"

    def usable(self, n_batches: int) -> int:
        """Batches of an epoch that are trained on: a multiple of the drafter count."""
        return n_batches - n_batches % self.drafters

    def source_rank(self, batch: int) -> int:
        """The rank that computes features for global batch `batch` (a target, or the drafter)."""
        t, d = route(batch, self.targets, self.drafters)
        return self.drafter_rank(d) if self.colocated else self.target_rank(t)

    def dest_rank(self, batch: int) -> int:
        return self.drafter_rank(route(batch, self.targets, self.drafters)[1])

    def batches(self, rank: int, n_batches: int, start: int = 0) -> list[int]:
        """Global batches of an epoch (from position `start`) that `rank` handles, in order."""
        role, _ = self.role(rank)
        owner = self.dest_rank if role == "drafter" else self.source_rank
        return [i for i in range(start, self.usable(n_batches)) if owner(i) == rank]
