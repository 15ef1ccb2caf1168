"""Who does what: ranks, roles and the routing of global batches.

Ranks `0..D-1` are drafters (drafter 0 is rank 0, the one that writes checkpoints and outputs),
ranks `D..D+T-1` are targets. `targets == 0` means colocated: each drafter runs its own target.
Global batch i of an epoch is computed by target `i % T` and trained on by drafter `i % D`
(`dflash.data.batching.route`), so the same config and topology give the same batches, on the
same ranks, in the same order on every rerun. An epoch uses the largest multiple of D batches
so that every drafter takes the same number of optimizer steps (DDP needs that); the dropped
tail (< D batches) is different every epoch because the plan is reshuffled.

With `target_shards` S > 1 the target ranks form T / S groups of S consecutive ranks, each group
holding one copy of the target sharded across its ranks (`dflash.train.shard`): global batch i is
computed by group `i % (T / S)`, all of its ranks together, and sent by the group's first rank
(its leader) to drafter `i % D`.
"""

from __future__ import annotations

from dataclasses import dataclass

from dflash.data.batching import route
from dflash.errors import UserError


@dataclass(frozen=True)
class Topology:
    targets: int
    drafters: int
    target_shards: int = 1

    def __post_init__(self):
        if self.drafters < 1 or self.targets < 0:
            raise ValueError(f"need drafters >= 1 and targets >= 0, got {self}")
        key = "train.topology.target_shards"
        if self.target_shards < 1:
            raise UserError(f"{key} must be at least 1, got {self.target_shards}")
        if self.target_shards > 1 and self.colocated:
            # A colocated drafter runs its own target on its own batches: sharing one sharded
            # copy would make every drafter wait on the others' forwards.
            raise UserError(
                f"{key}={self.target_shards} needs separate target ranks "
                "(train.topology.targets > 0); a colocated drafter (targets: 0) runs a whole target"
            )
        if self.targets % self.target_shards:
            raise UserError(
                f"train.topology.targets ({self.targets}) must be a multiple of "
                f"{key} ({self.target_shards}): each group of {self.target_shards} target ranks "
                "holds one sharded copy of the target"
            )

    @property
    def world(self) -> int:
        return self.targets + self.drafters

    @property
    def colocated(self) -> bool:
        return self.targets == 0

    @property
    def target_groups(self) -> int:
        """Copies of the target: groups of `target_shards` target ranks (0 when colocated)."""
        return self.targets // self.target_shards

    def as_dict(self) -> dict:
        return {
            "targets": self.targets,
            "drafters": self.drafters,
            "target_shards": self.target_shards,
        }

    def role(self, rank: int) -> tuple[str, int]:
        """("drafter", d) or ("target", t) for a global rank."""
        if not 0 <= rank < self.world:
            raise ValueError(f"rank {rank} outside a world of {self.world}")
        return ("drafter", rank) if rank < self.drafters else ("target", rank - self.drafters)

    def drafter_rank(self, d: int) -> int:
        return d

    def target_rank(self, t: int) -> int:
        return self.drafters + t

    def group_ranks(self, group: int) -> list[int]:
        """The global ranks of target group `group`, its leader (the sender) first."""
        first = group * self.target_shards
        return [self.target_rank(first + s) for s in range(self.target_shards)]

    def leader(self, rank: int) -> int:
        """The rank that sends the features `rank` helps compute (itself unless sharded)."""
        role, index = self.role(rank)
        if role == "drafter":
            return rank
        return self.group_ranks(index // self.target_shards)[0]

    def name(self, rank: int) -> str:
        role, index = self.role(rank)
        return f"rank {rank} ({role} {index})"

    def usable(self, n_batches: int) -> int:
        """Batches of an epoch that are trained on: a multiple of the drafter count."""
        return n_batches - n_batches % self.drafters

    def source_rank(self, batch: int) -> int:
        """The rank that computes features for global batch `batch` (a target, or the drafter)."""
        g, d = route(batch, self.target_groups, self.drafters)
        return self.drafter_rank(d) if self.colocated else self.group_ranks(g)[0]

    def dest_rank(self, batch: int) -> int:
        return self.drafter_rank(route(batch, self.target_groups, self.drafters)[1])

    def batches(self, rank: int, n_batches: int, start: int = 0) -> list[int]:
        """Global batches of an epoch (from position `start`) that `rank` handles, in order: a
        sharded target rank computes its group's (`leader` sends them)."""
        role, _ = self.role(rank)
        owner = self.dest_rank if role == "drafter" else self.source_rank
        mine = self.leader(rank)
        return [i for i in range(start, self.usable(n_batches)) if owner(i) == mine]
