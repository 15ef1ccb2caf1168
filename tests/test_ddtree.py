"""DDTree drafting and verification, proven against brute-force oracles and a real HF model."""

import itertools
import random

import pytest
import torch

from dflash.eval.ddtree import (
    DraftTree,
    accepted_tokens,
    build_tree,
    chain_tree,
    hf_tree_mask,
    kept_cache_rows,
    tree_attention_mask,
    tree_positions,
    walk,
    with_path,
)


def paths_of(tree: DraftTree) -> list[tuple[int, ...]]:
    """Root-to-node token paths (root excluded) of every node, in node order."""
    toks, parents = tree.tokens.tolist(), tree.parents.tolist()
    out = [()]
    for i in range(1, len(toks)):
        out.append(out[parents[i]] + (toks[i],))
    return out


def all_paths(logits: torch.Tensor, topk: int) -> dict[tuple[int, ...], float]:
    """Every candidate node (a path of per-depth top-k tokens) with its summed logprob."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    cands = [logp[d].topk(topk).indices.tolist() for d in range(logits.shape[0])]
    lp = logp.tolist()
    out = {}
    for depth in range(1, logits.shape[0] + 1):
        for path in itertools.product(*cands[:depth]):
            score = 0.0
            for d, t in enumerate(path):
                score += lp[d][t]
            out[path] = score
    return out


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("topk", [5, 3])
def test_build_tree_is_top_n_prefix_closed(seed, topk):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(3, 5, generator=gen) * 2
    ref = all_paths(logits, topk)
    ranked = sorted(ref, key=lambda p: -ref[p])
    for budget in [1, 2, 5, 10, 16, 30, len(ref), len(ref) + 7]:
        tree = build_tree(7, logits, budget, topk=topk)
        paths = paths_of(tree)
        assert tree.size == min(budget, len(ref))
        assert tree.tokens[0] == 7 and tree.parents[0] == -1 and tree.depths[0] == 0
        assert set(paths[1:]) == set(ranked[: tree.size])
        assert len(set(paths)) == len(paths)
        for i, p in enumerate(paths[1:], start=1):
            assert p[:-1] in paths[:i]  # parent present and added earlier (topological order)
            assert tree.depths[i] == len(p)
            assert tree.scores[i].item() == pytest.approx(ref[p], abs=1e-5)
        # Best-first: nodes come out in non-increasing score order.
        assert torch.all(tree.scores[2:] <= tree.scores[1:-1] + 1e-6)


def test_build_tree_ties_are_deterministic():
    logits = torch.zeros(3, 6)  # every candidate ties within its depth
    a, b = build_tree(0, logits, 20, topk=4), build_tree(0, logits, 20, topk=4)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.parents, b.parents)
    assert a.tokens[1:5].tolist() == [0, 1, 2, 3]  # ties ranked by token id


def test_chain_tree():
    tree = chain_tree(4, torch.tensor([9, 8, 7]))
    assert tree.tokens.tolist() == [4, 9, 8, 7]
    assert tree.parents.tolist() == [-1, 0, 1, 2]
    assert tree.depths.tolist() == [0, 1, 2, 3]
    assert tree_attention_mask(tree, 2).tolist() == [
        [True, True] + [j <= i for j in range(4)] for i in range(4)
    ]


@pytest.mark.parametrize("seed", range(4))
def test_tree_attention_mask_matches_ancestors(seed):
    gen = torch.Generator().manual_seed(seed)
    tree = build_tree(1, torch.randn(5, 7, generator=gen), budget=40, topk=3)
    prefix_len = 3
    mask = tree_attention_mask(tree, prefix_len)
    m = tree.size + 1
    assert mask.shape == (m, prefix_len + m) and mask.dtype == torch.bool
    assert mask[:, :prefix_len].all()
    parents = tree.parents.tolist()
    for i in range(m):
        anc, j = set(), i
        while j >= 0:
            anc.add(j)
            j = parents[j]
        assert mask[i, prefix_len:].tolist() == [j in anc for j in range(m)]
    add = hf_tree_mask(tree, prefix_len, torch.float32)
    assert add.shape == (1, 1, m, prefix_len + m)
    assert torch.equal(add[0, 0] == 0, mask)
    assert torch.equal(tree_positions(tree, prefix_len), prefix_len + tree.depths)


def check_walk(seed: int) -> int:
    """Walk a tree against a toy target; check it is lossless and maximal. Returns len(path)."""
    vocab, rng = 4, random.Random(seed)
    table = {k: rng.randrange(vocab) for k in itertools.product(range(vocab), repeat=2)}

    def next_token(seq):  # a deterministic "target": greedy token from the last two tokens
        return table[tuple(seq[-2:])]

    prefix = [rng.randrange(vocab) for _ in range(3)]  # last one is the root (last committed)
    seq = list(prefix)
    for _ in range(5):
        seq.append(next_token(seq))
    greedy = seq[len(prefix) :]
    # A drafter that often, not always, favours the target's greedy token, so walks end at all
    # depths: rejected at the root, midway, or accepted down to a leaf.
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(4, vocab, generator=gen)
    logits[range(4), greedy[:4]] += 2.0 * torch.rand(4, generator=gen)
    tree = build_tree(prefix[-1], logits, budget=12, topk=3)
    paths = paths_of(tree)
    target_next = torch.tensor([next_token(prefix + list(p)) for p in paths])
    path, bonus = walk(tree, target_next)

    assert accepted_tokens(tree, path, bonus) == greedy[: len(path) + 1]  # lossless
    # Longest: no node of the tree matches a longer prefix of the greedy continuation.
    assert len(path) == max(len(p) for p in paths if tuple(greedy[: len(p)]) == p)
    assert [tree.parents[i].item() for i in path] == [0, *path][: len(path)]
    return len(path)


@pytest.mark.parametrize("seed", range(40))
def test_walk_is_lossless_and_longest(seed):
    check_walk(seed)


def test_walk_cases_cover_all_depths():
    # Guards the test above against only ever exercising trivial walks.
    assert {check_walk(s) for s in range(40)} == {0, 1, 2, 3, 4}


def test_walk_rejects_at_root():
    tree = chain_tree(0, [1, 2])
    assert walk(tree, torch.tensor([3, 2, 0])) == ([], 3)
    assert walk(tree, torch.tensor([1, 2, 0])) == ([1, 2], 0)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_tree_forward_matches_sequential_hf(attn):
    transformers = pytest.importorskip("transformers")
    from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=50,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    cfg._attn_implementation = attn
    model = LlamaForCausalLM(cfg).eval()
    assert transformers.__version__.startswith("5.")

    prefix = torch.randint(0, 50, (1, 6))
    root = 17
    tree = build_tree(root, torch.randn(4, 50) * 3, budget=20, topk=4)
    prefix_len = prefix.shape[1]
    with torch.no_grad():
        cache = DynamicCache(config=cfg)
        model(input_ids=prefix, cache=cache, use_cache=True)
        out = model(
            input_ids=tree.tokens[None],
            position_ids=tree_positions(tree, prefix_len)[None],
            attention_mask=hf_tree_mask(tree, prefix_len, torch.float32),
            cache=cache,
            use_cache=True,
        )
        tree_logits = out.logits[0]
        for i, p in enumerate(paths_of(tree)):
            seq = torch.cat([prefix, torch.tensor([[root, *p]])], dim=1)
            ref = model(input_ids=seq).logits[0, -1]
            torch.testing.assert_close(tree_logits[i], ref, atol=1e-4, rtol=1e-4)

        # Committing: keep the prefix, root and accepted rows, then decode the bonus token; its
        # logits must match running the committed sequence from scratch. A random model rarely
        # accepts anything, so commit the path to the deepest node as if it had been accepted.
        path = [int(tree.depths.argmax())]
        while tree.parents[path[0]] > 0:
            path.insert(0, int(tree.parents[path[0]]))
        bonus = int(tree_logits[path[-1]].argmax())
        rows = kept_cache_rows(path, prefix_len)
        for layer in cache.layers:
            layer.keys, layer.values = layer.keys[:, :, rows], layer.values[:, :, rows]
        assert cache.get_seq_length() == prefix_len + 1 + len(path)
        nxt = model(input_ids=torch.tensor([[bonus]]), cache=cache, use_cache=True).logits[0, -1]
        committed = [root, *(int(tree.tokens[i]) for i in path), bonus]
        ref = model(input_ids=torch.cat([prefix, torch.tensor([committed])], 1)).logits[0, -1]
        torch.testing.assert_close(nxt, ref, atol=1e-4, rtol=1e-4)


def test_a_lookup_branch_reuses_the_nodes_it_shares_and_walks_like_any_branch():
    """with_path adds prompt lookup's continuation to a drafter tree: shared prefixes are not
    duplicated, new nodes follow their parents, and the target's greedy walk takes whichever
    branch it agrees with further."""
    tree = chain_tree(7, [1, 2, 3])
    both = with_path(tree, [1, 5, 6])  # shares the first draft, then branches off
    assert paths_of(both) == [(), (1,), (1, 2), (1, 2, 3), (1, 5), (1, 5, 6)]
    assert both.parents.tolist() == [-1, 0, 1, 2, 1, 4]
    assert both.depths.tolist() == [0, 1, 2, 3, 2, 3]
    assert all(p < i for i, p in enumerate(both.parents.tolist()))
    assert paths_of(with_path(tree, [1, 2])) == paths_of(tree)  # nothing new: unchanged
    assert paths_of(with_path(tree, [])) == paths_of(tree)
    # the target's next token after each node (root first): it follows the lookup branch
    target_next = torch.tensor([1, 5, 9, 9, 6, 8])
    path, bonus = walk(both, target_next)
    assert path == [1, 4, 5] and bonus == 8
    assert accepted_tokens(both, path, bonus) == [1, 5, 6, 8]
