"""tau_sim: the decoding walk read off teacher-forced blocks equals real speculative decoding."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from dflash.eval.decode import DrafterProposer, Proposer, generate
from dflash.eval.predicted import full_features, tau_on_texts
from dflash.eval.sessions import StaticSession
from dflash.model.drafter import Drafter, DrafterConfig
from dflash.model.objective import dflash_loss
from dflash.model.tau_sim import capped, response_spans, simulate, tau_macro, walk

VOCAB, BLOCK = 64, 4


def test_response_spans():
    assert response_spans([0, 0, 1, 1, 1, 0, 1, 0, 1, 1]) == [(2, 4), (6, 6), (8, 9)]
    assert response_spans([0, 0]) == []


@pytest.mark.parametrize(
    ("matches", "first", "last", "rounds"),
    [
        ([0] * 6, 0, 6, [1] * 6),  # nothing accepted: one token per forward
        ([3, 0, 0, 0, 3, 0, 0], 0, 7, [4, 3]),  # jumps past the anchors it skips; 3 left: cut
        ([1, 9, 0, 2, 0], 10, 15, [2, 1, 2]),  # starts at `first`; the last round stops at `last`
        ([3, 3, 3], 0, 2, [2]),  # the stop token is a draft: the bonus after it is not counted
    ],
)
def test_walk_jumps_by_accepted_plus_one_and_stops_at_the_last_token(matches, first, last, rounds):
    assert walk(matches, first, last) == rounds
    assert sum(rounds) == last - first


@pytest.mark.parametrize(
    ("rounds", "max_new_tokens", "kept"),
    [
        ([4, 3, 1], 9, [4, 3, 1]),  # 8 committed after the prompt's token: nothing to cut
        ([4, 3, 1], 6, [4, 1]),  # the round that crosses the cap counts up to it
        ([4, 3, 1], 5, [4]),
        ([4, 3, 1], 1, []),  # the prompt's forward gives the only token
    ],
)
def test_capped_keeps_the_rounds_decoding_would_run_under_a_cap(rounds, max_new_tokens, kept):
    assert capped(rounds, max_new_tokens) == kept


def test_tau_macro_means_per_response_then_over_responses():
    assert tau_macro([[1, 3], [2]]) == 2.0
    assert tau_macro([]) is None


@pytest.fixture(scope="module")
def target(small_decoder):
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**small_decoder)).eval()


PROMPT = [1, 5, 9, 13, 2, 7, 30, 31]
NEW = 60


def overfit_drafter(target, ids, mask, steps: int):
    """A 1-layer drafter trained on one sequence until it drafts parts of it right."""
    torch.manual_seed(1)
    drafter = Drafter(DrafterConfig.for_target(target.config, 1, BLOCK, VOCAB - 1))
    layer_ids = drafter.config.target_layer_ids
    feats = full_features(target, ids, layer_ids).detach()
    embed, head = target.get_input_embeddings(), target.lm_head.weight
    opt = torch.optim.AdamW(drafter.parameters(), lr=3e-3)
    ids_t, mask_t = torch.tensor([ids]), torch.tensor([mask])
    for step in range(steps):
        gen = torch.Generator().manual_seed(step)
        loss, _ = dflash_loss(drafter, embed, head, feats, ids_t, mask_t, gen, 16)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return drafter.eval()


@pytest.mark.parametrize("steps", [0, 40, 400], ids=["untrained", "partly", "trained"])
def test_tau_sim_equals_real_decoding_round_for_round(target, steps):
    """On the target's own greedy continuation, the walk gives exactly the rounds real decoding
    gives, for a drafter that accepts nothing, some, or much (fp32, one target)."""
    session = StaticSession(target, [2])  # layer 2: the 1-layer drafter's default for 4 layers
    reference = generate(session, Proposer(), PROMPT, NEW, set()).tokens
    ids = PROMPT + reference
    mask = [0] * len(PROMPT) + [1] * len(reference)
    drafter = overfit_drafter(target, ids, mask, steps)
    assert drafter.config.target_layer_ids == [2]
    embed, head = target.get_input_embeddings(), target.lm_head.weight
    real = generate(session, DrafterProposer(drafter, embed, head), PROMPT, NEW, set())
    assert real.tokens == reference
    feats = full_features(target, ids, [2])
    (rounds,) = simulate(drafter, embed, head, [(feats, torch.tensor(ids), torch.tensor(mask))])
    assert rounds == real.accepted
    if steps == 400:  # the comparison is not trivial: the drafter really accepts blocks
        assert tau_macro([rounds]) > 2.0


def test_max_new_tokens_caps_the_walk_like_decoding(target):
    session = StaticSession(target, [2])
    reference = generate(session, Proposer(), PROMPT, NEW, set()).tokens
    ids = PROMPT + reference
    mask = [0] * len(PROMPT) + [1] * len(reference)
    drafter = overfit_drafter(target, ids, mask, 400)
    embed, head = target.get_input_embeddings(), target.lm_head.weight
    real = generate(session, DrafterProposer(drafter, embed, head), PROMPT, 25, set())
    feats = full_features(target, ids, [2])
    row = (feats, torch.tensor(ids), torch.tensor(mask))
    assert simulate(drafter, embed, head, [row], max_new_tokens=25) == [real.accepted]
    (whole,) = simulate(drafter, embed, head, [row])  # training cuts the whole walk instead
    assert capped(whole, 25) == real.accepted and len(whole) > len(real.accepted)
    for cap in range(1, len(reference) + 2):  # every cap, up to past the end of the answer
        assert [capped(whole, cap)] == simulate(drafter, embed, head, [row], max_new_tokens=cap)
    # a one-token answer has nothing to draft: an empty walk keeps the next answer in its place
    two = torch.tensor([0] * len(PROMPT) + [1] + [0] * 3 + [1] * (len(reference) - 4))
    first, second = simulate(drafter, embed, head, [(feats, torch.tensor(ids), two)])
    assert first == [] and sum(second) == len(reference) - 5


def test_tau_on_texts_gives_real_decodings_tau_on_tokens_handed_in(target):
    """Another engine's answers (here the target's own greedy tokens, as vLLM's are its
    target's): our drafter's τ on exactly those tokens is what decoding them gives, per prompt;
    a prompt answered by nothing has no τ and keeps its place."""
    session = StaticSession(target, [2])
    reference = generate(session, Proposer(), PROMPT, NEW, set()).tokens
    drafter = overfit_drafter(
        target, PROMPT + reference, [0] * len(PROMPT) + [1] * len(reference), 400
    )
    proposer = DrafterProposer(drafter, target.get_input_embeddings(), target.lm_head.weight)
    other = [1, 5, 9, 13, 2]
    real = [generate(session, proposer, p, 25, set()) for p in (PROMPT, other)]
    texts = [(PROMPT, real[0].tokens), (other, real[1].tokens), (PROMPT, [])]
    taus = tau_on_texts(target, drafter, texts, max_new_tokens=25)
    assert taus == [tau_macro([real[0].accepted]), tau_macro([real[1].accepted]), None]
    assert taus[0] > 2.0  # the drafter accepts blocks: the comparison is not trivial
