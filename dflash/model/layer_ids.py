"""Which target layers the drafter reads: a default the drafter's config and the target's feature
extraction both use, and the check that configured ids exist in the target."""

from __future__ import annotations

from dflash.errors import UserError


def default_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """Evenly spaced from layer 1 to L-3 (DESIGN 4); layer i is `hidden_states[i + 1]`.

    A target too shallow for that range degrades inside its own depth: the range is clamped to
    [min(1, L-1), max(that, L-3)] and ids that fall together are kept once, so a 2-layer target
    gives [1] for any drafter depth (the formula alone gave [1, -1]), a 4-layer one [1], a
    5-layer one [1, 2]. A 1-layer drafter reads the middle layer, L // 2.
    """
    if num_target_layers < 1:
        raise UserError(f"the target has {num_target_layers} layers: it needs at least one")
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start = min(1, num_target_layers - 1)
    end = max(start, num_target_layers - 3)
    ids = [
        round(start + i * (end - start) / (num_draft_layers - 1)) for i in range(num_draft_layers)
    ]
    return sorted(set(ids))


def check_layer_ids(
    layer_ids: list[int] | None, num_target_layers: int, num_draft_layers: int, where: str
) -> None:
    """Refuse configured `drafter.target_layer_ids` outside the target's depth, naming the valid
    range: found when training starts, it cost every stage before it."""
    wrong = [i for i in layer_ids or () if not 0 <= i < num_target_layers]
    if wrong:
        raise UserError(
            f"drafter.target_layer_ids: {wrong} outside the {num_target_layers} layers of target"
            f" {where}: valid ids are 0..{num_target_layers - 1} (null takes the default,"
            f" {default_layer_ids(num_target_layers, num_draft_layers)})"
        )
