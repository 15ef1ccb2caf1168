"""What a decoding round commits from the target's verify forward: greedy, or sampled as the
serving engines sample.

`Greedy`: the drafts up to the first that differs from the target's argmax, then the argmax
(the bonus token); a tree follows the argmax down its branches (`ddtree.walk`).

`Sampled` (temperature > 0), lossless in distribution, as vLLM's rejection sampler decides:
- a drafted token d (the drafter's argmax, or prompt lookup's copy: a one-hot proposal) is
  accepted with the target's probability p(d); on rejection the next token is drawn from p with d
  removed; after the last accepted draft the bonus token is drawn from p;
- a node of a tree with several children (DDTree, or the drafter's block beside prompt lookup's)
  tries them in order: child c is accepted with p(c) / (1 - the mass of the children already
  rejected), and if all are rejected the token is drawn from p without them (recursive rejection
  sampling: each child, and each other token, comes out with exactly its probability under p);
- with `draft="probabilistic"` the drafter's tokens are drawn from its own distribution q
  (`SampledDrafts`) and accepted with min(1, p(d) / q(d)), the residual being max(p - q, 0):
  vLLM's `draft_sample_method: probabilistic`.
The target-side draws come from one torch.Generator per decoded prompt (the evaluation seeds it
from the run's seed, the method and the prompt), all on the target's device: a round moves only
a few numbers to the host. At temperature 0 `Sampled` is never used: the greedy rule is the same
arithmetic as before sampling existed.
"""

from __future__ import annotations

import torch

from dflash.eval import ddtree
from dflash.model.sampling import Sampling, probabilities, sample_rows


class Greedy:
    """The target's argmax decides (temperature 0)."""

    logits = False  # the target's forwards return argmax tokens
    sampling = Sampling()

    def reseed(self, key: int) -> None:
        pass

    def first(self, next_tokens: torch.Tensor) -> int:
        return int(next_tokens[-1])

    def chain(self, drafts: list[int], verified: torch.Tensor, q=None) -> list[int]:
        """The tokens a round commits: accepted drafts, then the bonus token."""
        target = verified.tolist()
        n = 0
        while n < len(drafts) and drafts[n] == target[n]:
            n += 1
        return [*drafts[:n], target[n]]

    def tree(self, tree: ddtree.DraftTree, verified: torch.Tensor) -> tuple[list[int], int]:
        return ddtree.walk(tree, verified.cpu())


class Sampled:
    """Speculative sampling at `sampling` (temperature > 0); see the module's docstring."""

    logits = True  # the target's forwards return logits

    def __init__(self, sampling: Sampling, device: torch.device, seed: int = 0):
        if sampling.greedy:
            raise ValueError("Sampled needs a temperature above 0 (Greedy decodes at 0)")
        self.sampling, self.device = sampling, torch.device(device)
        self.generator = torch.Generator(device=self.device)
        self.reseed(seed)

    def reseed(self, key: int) -> None:
        """Start the stream of one decoding (a prompt, a method, a seed)."""
        self.generator.manual_seed(key)

    def accept_probability(self, p: float, rejected_mass: float) -> float:
        """The chance a one-hot proposal of target probability `p` is taken, after siblings of
        `rejected_mass` were rejected (0 for a chain)."""
        left = 1.0 - rejected_mass
        return 1.0 if left <= 0 else min(1.0, p / left)

    def first(self, logits: torch.Tensor) -> int:
        probs = probabilities(logits[-1:], self.sampling)
        return int(sample_rows(probs, self.generator)[0])

    def chain(self, drafts: list[int], logits: torch.Tensor, q: torch.Tensor | None = None):
        """The tokens a round commits. `q` (k, V): the drafter's distributions its k drafts were
        drawn from (the probabilistic rule); None: one-hot proposals."""
        children = [[(i + 1, t)] for i, t in enumerate(drafts)] + [[]]
        path, token = self._walk(children, logits, q)
        return [*drafts[: len(path)], token]

    def tree(self, tree: ddtree.DraftTree, logits: torch.Tensor) -> tuple[list[int], int]:
        """(accepted node ids, the token after them), as `ddtree.walk` returns them."""
        tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
        children: list[list[tuple[int, int]]] = [[] for _ in tokens]
        for node in range(1, len(tokens)):
            children[parents[node]].append((node, tokens[node]))
        return self._walk(children, logits, None)

    def _walk(self, children, logits, q):
        """children[i]: (node, token) of node i's children, in the order they are tried."""
        n, width = len(children), max(1, *(len(c) for c in children))
        p = probabilities(logits, self.sampling)
        # each node's children's tokens, padded with its first child's (0 without children), so
        # that a scatter writing one value per node never meets two values at one token
        index = torch.tensor(
            [[t for _, t in kids] + [kids[0][1] if kids else 0] * (width - len(kids))
             for kids in children]
        ).to(p.device)  # fmt: skip
        has = torch.tensor([[j < len(c) for j in range(width)] for c in children]).to(p.device)
        chance = p.gather(1, index) * has  # p(child) at each node
        if q is not None:  # drafts drawn from q (a chain): min(1, p / q), residual max(p - q, 0)
            k = len(q)
            chance[:k] = chance[:k] / q.float().gather(1, index[:k]).clamp(min=1e-30)
            residual = torch.cat([(p[:k] - q.float()).clamp(min=0), p[k:]])
        else:  # one-hot proposals: a node's residual is p without its children's tokens
            removed = has.any(1, keepdim=True).expand(n, width)
            residual = p.masked_fill(
                torch.zeros_like(p, dtype=torch.bool).scatter(1, index, removed), 0
            )
        uniforms = torch.rand(n, width, generator=self.generator, device=p.device)
        drawn = sample_rows(residual, self.generator)
        chance, uniforms, drawn = (t.cpu().tolist() for t in (chance, uniforms, drawn))
        path, node = [], 0
        while True:
            rejected, taken = 0.0, None
            for j, (child, _) in enumerate(children[node]):
                c = chance[node][j]
                odds = min(1.0, c) if q is not None else self.accept_probability(c, rejected)
                if uniforms[node][j] < odds:
                    taken = child
                    break
                rejected += c
            if taken is None:
                return path, int(drawn[node])
            path.append(taken)
            node = taken
