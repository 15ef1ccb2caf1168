"""Sampling as users serve: the target's distribution warped as engines warp it, keyed draws
that depend on nothing but a row's own logits and key, and speculative sampling that is lossless
in distribution (each acceptance rule's rounds against their exact outcome probabilities, a
goodness-of-fit test that a biased rule fails), reducing to the greedy path as the temperature
goes to 0 in the real decoding loops."""

import random
import statistics

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from dflash.eval.decode import Proposer, SampledDrafts, generate, generate_tree
from dflash.eval.sessions import HFSession, StaticSession
from dflash.eval.setup import LookupProposer
from dflash.eval.verify import Greedy, Sampled
from dflash.model.sampling import (
    Sampling,
    keyed_sample,
    probabilities,
    row_key,
    sample_rows,
    warped_logits,
)
from dflash.model.tau_sim import walk
from dflash.model.tau_sim_sampled import argmax_ceiling, expected_tau

VOCAB, BLOCK, N_TOKENS = 64, 4, 3


def chi_square_p(observed: torch.Tensor, expected: torch.Tensor) -> float:
    """Pearson's test of counts against expected counts, cells under 5 expected pooled."""
    big = expected >= 5
    obs = torch.cat([observed[big], observed[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = exp > 0
    stat = ((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()
    dof = torch.tensor(float(keep.sum() - 1))
    return float(torch.special.gammaincc(dof / 2, stat / 2))


def test_warping_keeps_the_top_k_then_the_top_p_tokens():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0]])
    assert warped_logits(logits, Sampling(1.0, top_k=2)).isfinite().tolist() == [
        [True, True, False, False, False]
    ]
    p = logits.softmax(-1)[0].tolist()  # 0.64, 0.23, 0.09, ...
    kept = warped_logits(logits, Sampling(1.0, top_p=0.8)).isfinite()[0].tolist()
    assert kept == [True, True, False, False, False] and p[0] < 0.8 < p[0] + p[1]
    # the top token always stays, whatever top_p
    assert warped_logits(logits, Sampling(1.0, top_p=0.01)).isfinite().sum() == 1
    # temperature divides before the filters; at 0 the distribution is the argmax
    torch.testing.assert_close(
        probabilities(logits, Sampling(0.5)), (logits / 0.5).softmax(-1), rtol=1e-6, atol=1e-7
    )
    assert probabilities(logits, Sampling()).tolist() == [[1.0, 0.0, 0.0, 0.0, 0.0]]


def test_keyed_draws_follow_the_distribution_and_depend_on_the_row_alone():
    torch.manual_seed(0)
    logits = torch.randn(1, 12) * 2
    s = Sampling(0.8, top_p=0.95)
    keys = torch.tensor([row_key(0, "row", i) for i in range(6000)])
    positions = torch.randint(0, 4000, (6000,))
    drawn = keyed_sample(logits.expand(6000, -1), s, keys, positions)
    counts = torch.bincount(drawn, minlength=12).float()
    assert chi_square_p(counts, 6000 * probabilities(logits, s)[0]) > 1e-3
    # a row's token is the same alone, in another batch, or in another order
    rows = torch.randn(5, 12)
    together = keyed_sample(rows, s, keys[:5], positions[:5])
    alone = [
        keyed_sample(rows[i : i + 1], s, keys[i : i + 1], positions[i : i + 1]) for i in range(5)
    ]
    assert together.tolist() == torch.cat(alone).tolist()
    flipped = keyed_sample(rows.flip(0), s, keys[:5].flip(0), positions[:5].flip(0))
    assert flipped.flip(0).tolist() == together.tolist()
    # greedy is the argmax, whatever the keys
    assert (
        keyed_sample(rows, Sampling(), keys[:5], positions[:5]).tolist() == rows.argmax(-1).tolist()
    )


def test_expected_tau_is_the_greedy_walk_at_certainty_and_the_mean_of_sampled_walks():
    rng = random.Random(0)
    first, last = 10, 60
    matches = [rng.randrange(0, BLOCK) for _ in range(first, last)]
    alpha = [[1.0 if k < m else 0.0 for k in range(BLOCK - 1)] for m in matches]
    rounds = walk(matches, first, last)
    assert expected_tau(alpha, first, last) == pytest.approx(statistics.fmean(rounds))
    # chances strictly between 0 and 1: tokens over the rounds that simulated walks take
    alpha = [[rng.uniform(0.2, 0.95) for _ in range(BLOCK - 1)] for _ in range(first, last)]
    total = 0
    for _ in range(4000):
        a = first
        while a < last:
            n = 0
            while n < BLOCK - 1 and rng.random() < alpha[a - first][n]:
                n += 1
            a = min(a + n + 1, last)
            total += 1
    assert expected_tau(alpha, first, last) == pytest.approx(
        (last - first) * 4000 / total, rel=0.01
    )


@pytest.fixture(scope="module")
def peaked(small_decoder):
    """The small test target with its head scaled, so that its distributions are peaked (top
    token ~0.35): an acceptance rule's error then shows in a few hundred samples."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**small_decoder)).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(30)
    return model


class Oracle(Proposer):
    """Drafts the target's own greedy continuation (logits from uncached forwards): drafts the
    target often accepts, so that the rule's arithmetic is what the samples test."""

    block_size = BLOCK

    def __init__(self, model):
        self.model, self.known = model, {}

    @torch.no_grad()
    def draft_logits(self, committed, features):
        key = tuple(committed)  # seeds share their early contexts: each is forwarded once
        if key not in self.known:
            seq, out = list(committed), []
            for _ in range(BLOCK - 1):
                logits = self.model(input_ids=torch.tensor([seq])).logits[0, -1]
                out.append(logits)
                seq.append(int(logits.argmax()))
            self.known[key] = torch.stack(out)
        return self.known[key]

    def propose(self, committed, features):
        return self.draft_logits(committed, features).argmax(-1).tolist()


PROMPT = [1, 5, 9, 13, 2, 7]


class TooGenerous(Sampled):
    """A biased rule: a proposal is taken 1.3 times as often as the target's probability says."""

    def accept_probability(self, p, rejected_mass):
        return min(1.0, 1.3 * super().accept_probability(p, rejected_mass))


RULE_VOCAB, DRAWS = 6, 6000
WARP = Sampling(0.8, top_p=0.95)  # top-p leaves a token out of some rows: it must never come


def target_rows(n: int) -> torch.Tensor:
    """n rows of the target's logits (one per verified position or tree node), peaked enough
    that drafts are often accepted and an acceptance rule's bias shows."""
    return torch.randn(n, RULE_VOCAB, generator=torch.Generator().manual_seed(n)) * 2


def rule_p_value(draw, expected: dict) -> float:
    """Chi-square p-value of DRAWS outcomes of `draw()` against exact outcome probabilities;
    an outcome the rule must never give fails at once."""
    seen: dict = {}
    for _ in range(DRAWS):
        outcome = draw()
        assert outcome in expected and expected[outcome] > 0, outcome
        seen[outcome] = seen.get(outcome, 0) + 1
    keys = sorted(expected)
    observed = torch.tensor([float(seen.get(k, 0)) for k in keys])
    return chi_square_p(observed, DRAWS * torch.tensor([expected[k] for k in keys]))


def chain_outcomes(p, accept, residual) -> dict:
    """Exact probabilities of a chain round's committed tokens: accept[i][x] the chance draft
    position i commits x and goes on, residual[i][x] the chance it commits x and stops."""
    out, paths = {}, {(): 1.0}
    for i in range(len(p)):
        grown = {}
        for path, w in paths.items():
            for x in range(RULE_VOCAB):
                out[(*path, x)] = out.get((*path, x), 0.0) + w * float(residual[i][x])
                if i < len(p) - 1 and accept[i][x] > 0:
                    grown[(*path, x)] = w * float(accept[i][x])
        paths = grown
    return out


def test_a_chain_round_commits_each_token_with_the_targets_probability():
    """One-hot drafts (the drafter's argmax, lookup's copy): over 6000 rounds the committed
    tokens are what plain sampling gives, draft by draft; a rule 1.3x too generous fails."""
    logits = target_rows(3)
    p = probabilities(logits, WARP)
    drafts = [int(p[0].argmax()), int(p[1].argsort()[-2])]  # a likely draft, a less likely one
    accept = [
        torch.zeros(RULE_VOCAB).index_fill(0, torch.tensor([d]), 1.0) * p[i]
        for i, d in enumerate(drafts)
    ]
    residual = [p[i] - accept[i] for i in range(2)] + [p[2]]
    expected = chain_outcomes(p, accept, residual)
    rule, biased = Sampled(WARP, "cpu", seed=1), TooGenerous(WARP, "cpu", seed=1)
    assert rule_p_value(lambda: tuple(rule.chain(drafts, logits)), expected) > 1e-4
    assert rule_p_value(lambda: tuple(biased.chain(drafts, logits)), expected) < 1e-6


def test_a_tree_round_commits_each_branch_and_token_with_the_targets_probability():
    """A tree (two children at the root, a grandchild under the first): recursive rejection
    takes each child with its probability under the target and draws any other token from the
    target; the biased rule fails."""
    from dflash.eval.ddtree import DraftTree

    logits = target_rows(4)  # rows: root, node 1, node 2, node 3
    p = probabilities(logits, WARP)
    a, b = p[0].argsort(descending=True)[:2].tolist()
    c = int(p[1].argmax())
    tree = DraftTree(
        torch.tensor([-1, a, b, c]), torch.tensor([-1, 0, 0, 1]), torch.tensor([0, 1, 1, 2]),
        torch.zeros(4),
    )  # fmt: skip
    expected = {}
    for z in range(RULE_VOCAB):
        expected[((), z)] = 0.0 if z in (a, b) else float(p[0, z])
        expected[((1,), z)] = 0.0 if z == c else float(p[0, a] * p[1, z])
        expected[((1, 3), z)] = float(p[0, a] * p[1, c] * p[3, z])
        expected[((2,), z)] = float(p[0, b] * p[2, z])
    expected = {k: v for k, v in expected.items() if v > 0}

    def draw(rule):
        path, token = rule.tree(tree, logits)
        return tuple(path), token

    rule, biased = Sampled(WARP, "cpu", seed=2), TooGenerous(WARP, "cpu", seed=2)
    assert rule_p_value(lambda: draw(rule), expected) > 1e-4
    assert rule_p_value(lambda: draw(biased), expected) < 1e-6


def test_drafts_drawn_from_the_drafter_are_accepted_at_min_of_one_and_p_over_q():
    """vLLM's probabilistic draft rule: drafts drawn from the drafter's own q, accepted with
    min(1, p/q), the residual max(p - q, 0): each committed token again has the target's
    probability (min(p, q) + max(p - q, 0) = p)."""
    logits = target_rows(3)
    p = probabilities(logits, WARP)
    q = probabilities(target_rows(2) + logits[:2], Sampling(1.0))  # near the target, not it
    expected = chain_outcomes(
        p, [torch.minimum(p[i], q[i]) for i in range(2)],
        [(p[i] - q[i]).clamp(min=0) for i in range(2)] + [p[2]],
    )  # fmt: skip
    rule, drafter = Sampled(WARP, "cpu", seed=3), torch.Generator().manual_seed(4)

    def draw():
        drafts = torch.multinomial(q, 1, generator=drafter)[:, 0].tolist()
        return tuple(rule.chain(drafts, logits, q))

    assert rule_p_value(draw, expected) > 1e-4


@torch.no_grad()
def exact_marginals(model, s: Sampling) -> list[torch.Tensor]:
    """P(token i = v) for the first N_TOKENS tokens of plain sampling, by enumeration."""
    seqs, weights, out = torch.tensor([PROMPT]), torch.ones(1), []
    for k in range(N_TOKENS):
        joint = weights[:, None] * probabilities(model(input_ids=seqs).logits[:, -1], s)
        out.append(joint.sum(0))
        if k < N_TOKENS - 1:
            tokens = torch.arange(VOCAB).repeat(len(seqs))[:, None]
            seqs = torch.cat([seqs.repeat_interleave(VOCAB, 0), tokens], 1)
            weights = joint.reshape(-1)
    return out


def methods(model, rule):
    """The speculative paths the end-to-end test decodes, each a fresh decoding per call."""
    session = HFSession(model, [0, 1])
    oracle = Oracle(model)
    return {
        "chain": lambda: generate(session, oracle, PROMPT, N_TOKENS, set(), rule),
        "ddtree": lambda: generate_tree(
            session, oracle, PROMPT, N_TOKENS, set(), 5, 3, False, rule
        ),
        "probabilistic": lambda: generate(
            session, SampledDrafts(oracle, rule), PROMPT, N_TOKENS, set(), rule
        ),
    }


def marginal_p_values(model, rule, samples):
    """For each method: the p-value of each of the first N_TOKENS tokens' marginal against the
    exact one, over `samples` seeds, and its mean tokens per round."""
    expected = exact_marginals(model, rule.sampling)
    out = {}
    for name, decode in methods(model, rule).items():
        counts, rounds = torch.zeros(N_TOKENS, VOCAB), []
        for seed in range(samples):
            rule.reseed(10_000 + seed)
            gen = decode()
            for k, token in enumerate(gen.tokens[:N_TOKENS]):
                counts[k, token] += 1
            rounds += gen.accepted
        p_values = [chi_square_p(counts[k], samples * expected[k]) for k in range(N_TOKENS)]
        out[name] = (p_values, sum(rounds) / len(rounds))
    return out


@pytest.mark.slow
def test_the_decoding_loops_sample_what_plain_sampling_samples(peaked):
    """End to end through the real loops and the small target: over 200 seeds at temperature
    0.8 with top-p 0.95, the first three tokens of the chain, DDTree and drawn drafts follow the
    target's own distribution (plain sampling's, enumerated exactly), with drafts accepted often
    enough to matter. Its power is the rules' tests above; this one catches a loop that feeds a
    rule the wrong rows or draws. Nine statistics: a correct path falls under 1e-4 by chance
    0.1 % of the time."""
    found = marginal_p_values(peaked, Sampled(Sampling(0.8, top_p=0.95), "cpu"), 200)
    for name, (p_values, _) in found.items():
        assert min(p_values) > 1e-4, (name, p_values)
    assert found["chain"][1] > 1.3 and found["ddtree"][1] > found["chain"][1]


def test_argmax_ceiling_reads_each_drafts_chance_at_the_position_it_fills():
    """Draft k after anchor a fills position a + k, and the target's chance for it is read at
    a + k - 1: a target sure of every token but the one at first + 6 commits 6 tokens in the
    first round (5 drafts, then the target's own draw), then 16 a round (block 16)."""
    first, last = 10, 48
    best = [1.0] * last
    best[first + 5] = 0.0
    assert argmax_ceiling(best, first, last, 16) == pytest.approx(38 / 3)
    assert argmax_ceiling([0.0] * last, first, last, 16) == pytest.approx(1.0)
    assert argmax_ceiling(best, first, first, 16) is None


def test_argmax_ceiling_along_plain_samples_is_what_a_drafter_of_the_targets_argmax_reaches(
    peaked,
):
    """The ceiling read along the target's own plain samples (as eval_sampling reads it)
    against real speculative sampling with a drafter of the target's greedy continuation (the
    best of one token a slot), over 40 seeds of 16 tokens at T = 1 and at T = 0.8 with top-p
    0.95: within 10 % (0.1 % and 1.1 % here; over other seeds of 24 tokens the real τ ran 0-5 %
    above the reading: accepted argmax drafts make a surer context than sampled text)."""
    new, seeds = 16, 40
    session, oracle = HFSession(peaked, [0, 1]), Oracle(peaked)
    for s in (Sampling(1.0), Sampling(0.8, top_p=0.95)):
        rule, real, read = Sampled(s, "cpu"), [], []
        draws = torch.Generator().manual_seed(0)
        for seed in range(seeds):
            rule.reseed(10_000 + seed)
            real.append(
                statistics.fmean(generate(session, oracle, PROMPT, new, set(), rule).accepted)
            )
            ids = list(PROMPT)
            with torch.no_grad():
                for _ in range(new):
                    p = probabilities(peaked(input_ids=torch.tensor([ids])).logits[0, -1], s)
                    ids.append(int(torch.multinomial(p, 1, generator=draws)))
                logits = peaked(input_ids=torch.tensor([ids])).logits[0]
            first, last = len(PROMPT), len(ids) - 1
            best = [0.0] * first + probabilities(logits[first:last], s).max(-1).values.tolist()
            read.append(argmax_ceiling(best, first, last, BLOCK))
        assert statistics.fmean(read) == pytest.approx(statistics.fmean(real), rel=0.1), s.label


@pytest.mark.parametrize("kind", [StaticSession, HFSession], ids=["static", "hf"])
def test_sampling_near_temperature_zero_decodes_the_greedy_tokens(peaked, kind):
    """The sampled rule at T = 1e-4 is the greedy path (a distribution that is all but one-hot):
    the same tokens as greedy decoding, for the chain, lookup and a tree."""
    session = kind(peaked, [0, 1])
    oracle = Oracle(peaked)
    near_zero = Sampled(Sampling(1e-4), "cpu")
    decodings = [
        lambda rule: generate(session, oracle, PROMPT, 12, set(), rule),
        lambda rule: generate(session, LookupProposer(BLOCK), PROMPT, 12, set(), rule),
        lambda rule: generate_tree(session, oracle, PROMPT, 12, set(), 5, 3, True, rule),
    ]
    for decode in decodings:
        assert decode(near_zero).tokens == decode(Greedy()).tokens
    # drafts drawn from the drafter's own distribution, which is all but its argmax here
    drawn = generate(session, SampledDrafts(oracle, near_zero), PROMPT, 12, set(), near_zero)
    assert drawn.tokens == decodings[0](Greedy()).tokens


def test_draws_come_from_the_rule_generator_alone():
    """Two rules reseeded alike draw alike; another seed draws otherwise."""
    probs = torch.full((4, 50), 1 / 50)
    a, b = (torch.Generator().manual_seed(3) for _ in range(2))
    assert sample_rows(probs, a).tolist() == sample_rows(probs, b).tolist()
    assert (
        sample_rows(probs, torch.Generator().manual_seed(4)).tolist()
        != sample_rows(probs, torch.Generator().manual_seed(3)).tolist()
    )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_keyed_draws_on_the_gpu_are_the_cpus_and_replay_inside_cuda_graphs(small_decoder):
    """The hash's int64 arithmetic wraps alike on both devices (the same uniforms bit for bit),
    and the batched engine's sampled steps, replayed from CUDA graphs, give each row the tokens
    it gets in other company."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from dflash.model.batched import BatchedGreedy
    from dflash.model.sampling import keyed_uniform

    keys = torch.tensor([row_key(0, "row", i) for i in range(64)])
    positions = torch.arange(64) * 37
    on_gpu = keyed_uniform(keys.cuda(), positions.cuda()).cpu()
    assert torch.equal(on_gpu, keyed_uniform(keys, positions))
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(**small_decoder)).cuda().eval()
    prompts = [torch.randint(0, VOCAB, (n,)).tolist() for n in (5, 9, 3)]
    stream = [row_key(1, "r", i) for i in range(3)]

    def decode(rows):  # prompt i in cache row rows[i]
        engine = BatchedGreedy(model, 3, capacity=64, prompt_width=16, sampling=Sampling(1.0))
        tokens = [[t] for t in engine.prefill(rows, prompts, stream)]
        for _ in range(12):
            step = engine.step()
            for i, row in enumerate(rows):
                tokens[i].append(step[row])
        return tokens

    assert decode([0, 1, 2]) == decode([2, 0, 1])
