"""Speculative decoding is lossless and its caches stay right, whatever the drafts."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from dflash.eval.decode import (
    DrafterProposer,
    DrafterSession,
    Proposer,
    TargetSession,
    generate,
    generate_tree,
)
from dflash.model.drafter import Drafter, DrafterConfig

VOCAB, BLOCK = 64, 4


@pytest.fixture(scope="module")
def target():
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def drafter(target):
    torch.manual_seed(1)
    cfg = DrafterConfig.for_target(target.config, 1, BLOCK, VOCAB - 1)
    return Drafter(cfg).eval()


def session(target, drafter):
    return TargetSession(target, drafter.config.target_layer_ids)


PROMPTS = [[1, 5, 9, 13, 2, 7], [3, 3, 3, 3], [10, 20, 30, 40, 50, 60, 7, 8, 9]]


def greedy(target, drafter, prompt, n=40):
    return generate(session(target, drafter), Proposer(), prompt, n, eos_ids=set())


class Oracle(Proposer):
    """Knows the target's greedy continuation; gets the first `right` drafts right, then
    proposes wrong tokens (right = B-1 is a perfect drafter)."""

    def __init__(self, continuation, prompt_len, right):
        self.cont, self.offset, self.right = continuation, prompt_len, right
        self.block_size = BLOCK

    def propose(self, committed, features):
        done = len(committed) - self.offset
        truth = self.cont[done : done + BLOCK - 1]
        return [t if i < self.right else (t + 1) % VOCAB for i, t in enumerate(truth)]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_untrained_drafter_is_lossless(target, drafter, prompt):
    reference = greedy(target, drafter, prompt)
    out = generate(
        session(target, drafter),
        DrafterProposer(drafter, target.get_input_embeddings(), target.lm_head.weight),
        prompt,
        40,
        eos_ids=set(),
    )
    assert out.tokens == reference.tokens
    assert all(1 <= a <= BLOCK for a in out.accepted)


@pytest.mark.parametrize("right", [0, 1, 2, BLOCK - 1])
def test_partial_acceptance_crops_the_cache_and_stays_lossless(target, drafter, right):
    prompt = PROMPTS[0]
    reference = greedy(target, drafter, prompt, 41)
    s = session(target, drafter)
    out = generate(s, Oracle(reference.tokens, len(prompt), right), prompt, 41, eos_ids=set())
    assert out.tokens == reference.tokens
    # every full round accepts exactly `right` drafts plus the bonus
    assert out.accepted[:-1] == [right + 1] * (len(out.accepted) - 1)
    # the cache holds every committed token but the last (the next anchor)
    assert s.length == len(prompt) + sum(out.accepted)


def test_perfect_drafter_reaches_tau_equal_block_size(target, drafter):
    prompt = PROMPTS[1]
    reference = greedy(target, drafter, prompt, 1 + 10 * BLOCK)
    out = generate(
        session(target, drafter),
        Oracle(reference.tokens, len(prompt), BLOCK - 1),
        prompt,
        1 + 10 * BLOCK,
        eos_ids=set(),
    )
    assert out.tokens == reference.tokens and out.accepted == [BLOCK] * 10


def test_generation_stops_at_eos(target, drafter):
    reference = greedy(target, drafter, PROMPTS[2])
    eos = reference.tokens[5]
    out = generate(session(target, drafter), Proposer(), PROMPTS[2], 40, eos_ids={eos})
    assert out.tokens == reference.tokens[: reference.tokens.index(eos) + 1]


def test_drafter_cache_equals_recomputing_the_whole_context(target, drafter):
    """Drafting after context fed in pieces (cached) == drafting after it all at once."""
    torch.manual_seed(2)
    width = len(drafter.config.target_layer_ids) * drafter.config.hidden_size
    feats = torch.randn(11, width)
    embed, head = target.get_input_embeddings(), target.lm_head.weight
    pieces = DrafterSession(drafter, embed, head)
    for chunk in (feats[:6], feats[6:9]):
        pieces.draft_logits(5, chunk)
    cached = pieces.draft_logits(7, feats[9:])
    whole = DrafterSession(drafter, embed, head).draft_logits(7, feats)
    torch.testing.assert_close(cached, whole, atol=1e-5, rtol=1e-5)
    assert len(pieces.cache) == 11


@pytest.mark.parametrize("budget", [1, 6, 24])
def test_ddtree_decoding_is_lossless(target, drafter, budget):
    proposer = DrafterProposer(drafter, target.get_input_embeddings(), target.lm_head.weight)
    for prompt in PROMPTS:
        reference = greedy(target, drafter, prompt)
        s = session(target, drafter)
        out = generate_tree(s, proposer, prompt, 40, set(), budget=budget, topk=4)
        assert out.tokens == reference.tokens
        assert all(1 <= a <= BLOCK for a in out.accepted)
