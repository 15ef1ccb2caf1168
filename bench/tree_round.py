"""What a DDTree round costs beyond the chain's, piece by piece (issue 33: the recipe's tree-16
rounds cost 4.2 ms against the chain's 2.8 on the H200).

Times, on a random SmolLM2-135M-shaped target and 5-layer drafter after a 512-token prefix:
moving an accepted path's cache rows (one copy for the whole model, as `StaticTarget.move_rows`
does now, against the old two per layer and cache), building a best-first tree from the drafter's
logits, and the whole round (draft, tree, verify, walk, keep the path) against a chain round as
`generate` runs it.

    python3 bench/tree_round.py --out tree-round.json
"""

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from random_models import random_target_and_drafter  # noqa: E402

from dflash.eval import ddtree  # noqa: E402
from dflash.eval.decode import DrafterProposer  # noqa: E402
from dflash.eval.sessions import StaticSession  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--config", default="config/models/smollm2-135m")
p.add_argument("--reps", type=int, default=200)
p.add_argument("--out")
args = p.parse_args()
device, config, model, layers, drafter = random_target_and_drafter(args.config, 5)
target = StaticSession(model, layers)
proposer = DrafterProposer(drafter, model.get_input_embeddings(), model.lm_head.weight)
prefix = torch.randint(0, config.vocab_size, (512,)).tolist()
target.reset(1024)
_, features = target.forward(prefix)
proposer.start(prefix, features, 1024)


def timed_ms(step) -> float:
    for _ in range(5):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(args.reps):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return round(1000 * (time.perf_counter() - started) / args.reps, 4)


engine = target.engine
src = 512 + torch.tensor([1, 3, 4, 9, 12], device=device)
dst = 512 + 1 + torch.arange(5, device=device)


def move_per_layer():  # the old move_rows
    for cache in (*engine.keys, *engine.values):
        cache[:, :, dst] = cache[:, :, src]


logits = proposer.session.draft_logits(prefix[-1], features[-16:])
proposer.session.length = len(prefix)
tree_64 = ddtree.build_tree(0, logits.float(), 64, 8)


def round_of(budget):
    def step():
        target.crop(len(prefix))
        proposer.session.length = len(prefix) - 16
        draft = proposer.session.draft_logits(prefix[-1], features[-16:])
        if budget is None:
            tree = ddtree.chain_tree(prefix[-1], draft.argmax(-1).tolist())
        else:
            tree = ddtree.build_tree(prefix[-1], draft.float(), budget, 8)
        verified, _ = target.forward_tree(tree, len(prefix))
        path, _ = ddtree.walk(tree, verified.cpu())
        target.keep_path(path or [1, 2, 3], len(prefix))  # as if 3+ drafts were accepted

    return step


def plain_round():
    """A chain round as `generate` runs it: no tree, a 16-token verify."""
    target.crop(len(prefix))
    proposer.session.length = len(prefix) - 16
    draft = proposer.session.draft_logits(prefix[-1], features[-16:]).argmax(-1).tolist()
    verified, _ = target.forward([prefix[-1], *draft])
    verified.tolist()


out = {
    "round_plain_chain_ms": timed_ms(plain_round),
    "move_rows_one_copy_ms": timed_ms(lambda: engine.move_rows(src, dst)),
    "move_rows_per_layer_ms": timed_ms(move_per_layer),
    "build_tree_64_ms": timed_ms(lambda: ddtree.build_tree(0, logits.float(), 64, 8)),
    # the host's part of the tree's mask, the ancestors a verify step builds its mask from
    "ancestors_64_ms": timed_ms(lambda: ddtree.tree_attention_mask(tree_64, 0)),
    **{f"round_{b or 'chain'}_ms": timed_ms(round_of(b)) for b in (None, 16, 64)},
}
print(out, flush=True)
if args.out:
    Path(args.out).write_text(json.dumps({"device": str(device), **out}, indent=1))
