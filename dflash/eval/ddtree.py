"""DDTree: tree drafting from one DFlash drafter pass, verified by the target in one forward.

The drafter gives one distribution per draft position (depth 1..B-1). Treating positions as
independent, a path's score is the sum of its tokens' per-depth log-probabilities, so a child
never outscores its parent and the best prefix-closed set of N nodes is exactly the top-N nodes by
score; `build_tree` finds it best-first. The target verifies every node at once: node i sits at
position prefix_len + depth(i) and sees the committed prefix plus its own ancestors only, so its
output equals what the target would give after that root-to-node sequence. `walk` then follows the
target's greedy tokens down the tree, which keeps the result identical to plain greedy decoding.

Using the mask with Hugging Face transformers 5.x (checked against 5.24):
* A 4D `attention_mask` of shape (batch, 1, q_len, kv_len) is passed through untouched
  (`masking_utils._preprocess_mask_arguments` returns early), so it must already be final.
* Give it as an *additive float* mask in the model's dtype (`hf_tree_mask`): the eager kernel
  computes `scores + mask`, so a bool mask would silently add 0/1 instead of masking; SDPA takes
  either form. Flash-attention kernels cannot take a tree mask; use "eager" or "sdpa".
* kv_len must equal the cache length after the forward: the cache must hold exactly prefix_len
  tokens (crop stale tree rows first), and the root (last committed token) is fed as node 0.
* Pass `position_ids=tree_positions(...)[None]` explicitly; the default would number the nodes
  consecutively. RoPE is applied to keys before caching, so an accepted node's cached KV is
  already at its final position: keep cache rows `kept_cache_rows(...)`, drop the rest.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class DraftTree:
    """Nodes in topological order (parents before children); node 0 is the root."""

    tokens: Tensor  # (n+1,) long
    parents: Tensor  # (n+1,) long, root -1
    depths: Tensor  # (n+1,) long, root 0
    scores: Tensor  # (n+1,) float, summed log-probabilities along the path

    @property
    def size(self) -> int:
        """Number of draft nodes, excluding the root."""
        return self.tokens.numel() - 1

    def to(self, device: torch.device | str) -> DraftTree:
        return DraftTree(
            *(t.to(device) for t in (self.tokens, self.parents, self.depths, self.scores))
        )


def _tree(tokens: list[int], parents: list[int], depths: list[int], scores: list[float]):
    long = torch.long
    return DraftTree(
        torch.tensor(tokens, dtype=long),
        torch.tensor(parents, dtype=long),
        torch.tensor(depths, dtype=long),
        torch.tensor(scores, dtype=torch.float32),
    )


def build_tree(root_token: int, logits: Tensor, budget: int, topk: int = 8) -> DraftTree:
    """Best-first tree of at most `budget` nodes from drafter logits (B-1, V)."""
    logp = torch.log_softmax(logits.detach().float(), dim=-1)
    k = min(topk, logp.shape[-1])
    # Stable descending sort (topk's tie order is unspecified): equal log-probs rank by token id,
    # so ties are deterministic. Sort on the logits' device; only the top-k move to the host.
    vals, toks = torch.sort(logp, dim=-1, descending=True, stable=True)
    vals, toks = vals[:, :k].tolist(), toks[:, :k].tolist()
    n_depth = len(vals)
    tokens, parents, depths, scores = [root_token], [-1], [0], [0.0]
    # Heap entry: (-score, depth, parent node, rank among siblings). Lazy siblings: a popped node
    # pushes only its best child and its next sibling; both score no higher than it, and every
    # candidate is reachable through them, so pops come out in exact best-first order while the
    # heap stays O(budget) instead of O(budget * topk).
    heap = [(-vals[0][0], 1, 0, 0)] if n_depth and budget > 0 else []
    while heap and len(tokens) <= budget:
        neg, depth, parent, rank = heapq.heappop(heap)
        node = len(tokens)
        tokens.append(toks[depth - 1][rank])
        parents.append(parent)
        depths.append(depth)
        scores.append(-neg)
        if rank + 1 < k:
            # Scores are always parent score + own logprob, the same sum order as a path walk.
            sib = scores[parent] + vals[depth - 1][rank + 1]
            heapq.heappush(heap, (-sib, depth, parent, rank + 1))
        if depth < n_depth:
            heapq.heappush(heap, (-(scores[node] + vals[depth][0]), depth + 1, node, 0))
    return _tree(tokens, parents, depths, scores)


def chain_tree(root_token: int, draft_tokens: list[int] | Tensor) -> DraftTree:
    """A single chain (plain speculative decoding as a special case of the tree)."""
    draft = [int(t) for t in draft_tokens]
    n = len(draft)
    return _tree([root_token, *draft], list(range(-1, n)), list(range(n + 1)), [0.0] * (n + 1))


def with_path(tree: DraftTree, path_tokens: list[int]) -> DraftTree:
    """`tree` with the chain `path_tokens` below its root added as one more branch (prompt
    lookup's continuation beside the drafter's): nodes the tree already has along it are reused,
    the rest go after them, so parents still come before children and siblings stay distinct."""
    tokens, parents, depths, scores = (
        t.tolist() for t in (tree.tokens, tree.parents, tree.depths, tree.scores)
    )
    children = {(parents[i], tokens[i]): i for i in range(1, len(tokens))}
    node = 0
    for token in map(int, path_tokens):
        child = children.get((node, token))
        if child is None:
            child = len(tokens)
            tokens.append(token)
            parents.append(node)
            depths.append(depths[node] + 1)
            scores.append(scores[node])  # no drafter score of its own; best-first is done
            children[(node, token)] = child
        node = child
    return _tree(tokens, parents, depths, scores)


def tree_attention_mask(tree: DraftTree, prefix_len: int) -> Tensor:
    """Bool (n+1, prefix_len+n+1): True where node i may attend key j."""
    m, dev = tree.tokens.numel(), tree.parents.device
    anc = torch.eye(m, dtype=torch.bool, device=dev)
    rows = torch.arange(m, device=dev)
    cur = rows.clone()
    # Climb one level per step for all nodes at once; the root's parent (-1) maps to itself.
    for _ in range(int(tree.depths.max())):
        cur = torch.where(cur > 0, tree.parents[cur], cur)
        anc[rows, cur] = True
    prefix = torch.ones(m, prefix_len, dtype=torch.bool, device=dev)
    return torch.cat([prefix, anc], dim=1)


def hf_tree_mask(tree: DraftTree, prefix_len: int, dtype: torch.dtype) -> Tensor:
    """Additive (1, 1, n+1, prefix_len+n+1) mask for HF eager/SDPA attention (see module doc)."""
    allowed = tree_attention_mask(tree, prefix_len)
    # dtype min rather than -inf: HF's convention, and never NaN even if a row were fully masked.
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return mask.masked_fill(~allowed, torch.finfo(dtype).min)[None, None]


def tree_positions(tree: DraftTree, prefix_len: int) -> Tensor:
    """Position id of each node: where its token would sit in the plain sequence."""
    return prefix_len + tree.depths


def walk(tree: DraftTree, target_next: Tensor) -> tuple[list[int], int]:
    """Follow the target's greedy tokens from the root; return (accepted node ids, bonus token)."""
    nxt, toks, parents = (t.tolist() for t in (target_next, tree.tokens, tree.parents))
    children: dict[int, dict[int, int]] = {}
    for i in range(1, len(toks)):
        # Siblings hold distinct tokens (top-k of one position), so the lookup is unambiguous.
        children.setdefault(parents[i], {})[toks[i]] = i
    path, node = [], 0
    while (child := children.get(node, {}).get(nxt[node])) is not None:
        path.append(child)
        node = child
    return path, nxt[node]


def accepted_tokens(tree: DraftTree, path: list[int], bonus: int) -> list[int]:
    """Tokens emitted this step: the accepted drafts, then the bonus token."""
    return [int(tree.tokens[i]) for i in path] + [int(bonus)]


def kept_cache_rows(path: list[int], prefix_len: int) -> Tensor:
    """KV-cache rows to keep after the tree forward: the prefix, the root, the accepted nodes."""
    return torch.cat(
        [torch.arange(prefix_len + 1), prefix_len + torch.tensor(path, dtype=torch.long)]
    )
