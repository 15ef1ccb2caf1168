"""Which target layers the drafter reads: a default the drafter's config and the target's feature
extraction both use."""

from __future__ import annotations


def default_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """Evenly spaced from layer 1 to L-3 (DESIGN 4); layer i is `hidden_states[i + 1]`."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    return [
        round(start + i * (end - start) / (num_draft_layers - 1)) for i in range(num_draft_layers)
    ]
