"""Speculative decoding is lossless, stops like the reference, and its caches stay right,
whatever the drafts, on both target sessions (static caches and transformers' own cache)."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from dflash.eval.decode import DrafterProposer, Proposer, generate, generate_tree
from dflash.eval.probe import probe_steps
from dflash.eval.run import LookupProposer
from dflash.eval.sessions import DrafterSession, HFSession, StaticSession
from dflash.model.batched import BatchedGreedy
from dflash.model.drafter import Drafter, DrafterConfig, layer_projections, layer_rest
from dflash.model.engine import StaticTarget
from dflash.model.fused import StepPieces, fused
from dflash.model.objective import full_attend

VOCAB, BLOCK = 64, 4


@pytest.fixture(scope="module")
def target(small_decoder):
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**small_decoder)).eval()


@pytest.fixture(scope="module")
def drafter(target):
    torch.manual_seed(1)
    cfg = DrafterConfig.for_target(target.config, 1, BLOCK, VOCAB - 1)
    return Drafter(cfg).eval()


@pytest.fixture(params=[StaticSession, HFSession], ids=["static", "hf"])
def kind(request):
    return request.param


def session(target, drafter, kind=StaticSession):
    return kind(target, drafter.config.target_layer_ids)


def proposer(target, drafter):
    return DrafterProposer(drafter, target.get_input_embeddings(), target.lm_head.weight)


PROMPTS = [[1, 5, 9, 13, 2, 7], [3, 3, 3, 3], [10, 20, 30, 40, 50, 60, 7, 8, 9]]


@torch.no_grad()
def recomputed_greedy(model, prompt, n):
    """Greedy decoding with no cache at all: the whole sequence forwarded for every token."""
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(model(input_ids=torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(prompt) :]


def greedy(target, drafter, prompt, n=40, kind=StaticSession):
    return generate(session(target, drafter, kind), Proposer(), prompt, n, eos_ids=set())


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


@pytest.mark.parametrize("config", [LlamaConfig, Qwen3Config], ids=["llama", "qwen3"])
def test_static_target_equals_the_transformers_forward(config, small_decoder):
    """Logits' argmax and every selected layer's features, prompt then cached steps."""
    torch.manual_seed(0)
    model = (LlamaForCausalLM if config is LlamaConfig else Qwen3ForCausalLM)(
        config(**small_decoder)
    )
    model.eval()
    ids = torch.randint(0, VOCAB, (1, 14))
    with torch.no_grad():
        out = model(input_ids=ids, output_hidden_states=True)
    layers = [0, 2]
    expected = torch.cat([out.hidden_states[i + 1] for i in layers], -1)[0]
    engine = StaticTarget(model, layers, capacity=32)
    pos = torch.arange(14)[None]
    split = 9  # a prompt, then two more steps through the cache
    parts = [engine.forward(ids[:, :split], pos[:, :split], pos[0, :split])]
    for lo, hi in [(split, 12), (12, 14)]:
        parts.append(engine.forward(ids[:, lo:hi], pos[:, lo:hi], pos[0, lo:hi]))
    tokens = torch.cat([p[0] for p in parts])
    features = torch.cat([p[1] for p in parts])
    assert torch.equal(tokens, out.logits[0].argmax(-1))
    torch.testing.assert_close(features, expected, atol=1e-5, rtol=1e-5)


def test_compiled_decode_steps_equal_eager_ones(small_decoder):
    """The fused (compiled) halves of a decode step's layers, used on GPUs, compute what the eager
    ones do: the batched engine's tokens and the static target's features and tokens."""
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(**small_decoder)).eval()
    prompts = [torch.randint(0, VOCAB, (n,)).tolist() for n in (5, 9, 3)]
    runs = []
    for compiled in (False, True):
        engine = BatchedGreedy(model, 3, capacity=64, prompt_width=16, compiled=compiled)
        first = engine.prefill([0, 1, 2], prompts)
        runs.append([first] + [engine.step() for _ in range(12)])
    assert runs[0] == runs[1]

    ids = torch.randint(0, VOCAB, (1, 14))
    pos = torch.arange(14)[None]
    outs = []
    for compiled in (False, True):
        engine = StaticTarget(model, [0, 2], capacity=32)
        engine.pieces = StepPieces(engine.rows.device, compiled=compiled)
        engine.forward(ids[:, :9], pos[:, :9], pos[0, :9], last_only=True)
        outs.append(engine.forward(ids[:, 9:], pos[:, 9:], pos[0, 9:]))
    assert torch.equal(outs[0][0], outs[1][0])
    torch.testing.assert_close(outs[0][1], outs[1][1], atol=1e-5, rtol=1e-5)


def test_packed_prefill_gives_each_prompt_the_tokens_it_has_alone(small_decoder, monkeypatch):
    """flex packs prompts end to end into one prefill call: each prompt's tokens are those of
    the padded prefill (sdpa) and do not depend on which prompts share its call or where in the
    call it sits (a resumed regeneration refills rows in other company)."""
    monkeypatch.setattr(BatchedGreedy, "PREFILL_TOKENS", 512)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(**small_decoder)).eval()
    lengths = (5, 130, 3, 200, 17)
    prompts = [torch.randint(0, VOCAB, (n,)).tolist() for n in lengths]

    def decode(attention, calls):
        engine = BatchedGreedy(model, 5, capacity=320, prompt_width=256, attention=attention)
        tokens = {}
        for call in calls:
            assert engine.prefill_count([lengths[i] for i in call]) == len(call)
            for i, token in zip(
                call, engine.prefill(call, [prompts[i] for i in call]), strict=True
            ):
                tokens[i] = [token]
        for _ in range(12):
            for i, token in enumerate(engine.step()):
                tokens[i].append(token)
        return tokens

    padded = decode("sdpa", [[0, 1], [2, 3], [4]])  # two prompts of 256 a call
    assert decode("flex", [[0, 1], [2, 3, 4]]) == padded
    assert decode("flex", [[4, 3, 0], [2, 1]]) == padded
    engine = BatchedGreedy(model, 5, capacity=320, prompt_width=256, attention="flex")
    # blocks of 128: 5 -> 1, 130 -> 2, 3 -> 1 fill 512 tokens; 200 waits for the next call
    assert engine.prefill_count(list(lengths)) == 3


@pytest.mark.parametrize("prompt", PROMPTS)
def test_target_only_decoding_equals_greedy_without_a_cache(target, drafter, kind, prompt):
    assert greedy(target, drafter, prompt, 30, kind).tokens == recomputed_greedy(target, prompt, 30)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_untrained_drafter_is_lossless(target, drafter, kind, prompt):
    reference = greedy(target, drafter, prompt)
    out = generate(session(target, drafter, kind), proposer(target, drafter), prompt, 40, set())
    assert out.tokens == reference.tokens
    assert all(1 <= a <= BLOCK for a in out.accepted)
    assert sum(out.accepted) == len(out.tokens) - 1  # every token but the prompt's is a round's


@pytest.mark.parametrize("right", [0, 1, 2, BLOCK - 1])
def test_partial_acceptance_crops_the_cache_and_stays_lossless(target, drafter, kind, right):
    prompt = PROMPTS[0]
    reference = greedy(target, drafter, prompt, 41)
    s = session(target, drafter, kind)
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


class TreeOracle(Proposer):
    """Drafter logits that put the target's greedy continuation first at every depth (`wrong`:
    a token the target never takes there)."""

    block_size = BLOCK

    def __init__(self, continuation, prompt_len, wrong=False):
        self.cont, self.prompt_len, self.shift = continuation, prompt_len, int(wrong)

    def start(self, prompt, features, capacity):
        self.seen, self.session = 0, self

    def draft_logits(self, anchor, features):
        self.seen += features.shape[0]  # committed rows so far: the anchor's index follows them
        done = self.seen - self.prompt_len
        truth = self.cont[1 + done : done + BLOCK]
        logits = torch.zeros(BLOCK - 1, VOCAB)
        logits[range(len(truth)), [(t + self.shift) % VOCAB for t in truth]] = 10.0
        return logits


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "ddtree"])
def test_a_stop_token_accepted_inside_a_block_ends_decoding_there(target, drafter, tree):
    """A perfect drafter drafts the stop token in the middle of a block: decoding ends with that
    round, which counts the tokens up to the stop token only (the bonus after it is dropped),
    as the reference counts it. Before, decoding ran on to max_new_tokens and counted it all."""
    prompt = PROMPTS[1]
    reference = greedy(target, drafter, prompt, 40).tokens
    # A token first seen as a draft (not the bonus) of a later round: the stop token.
    at = next(
        i
        for i in range(BLOCK + 1, len(reference))
        if reference[i] not in reference[:i] and (i - 1) % BLOCK != BLOCK - 1
    )
    eos = reference[at]
    rounds = [BLOCK] * ((at - 1) // BLOCK) + [(at - 1) % BLOCK + 1]
    if tree:
        oracle = TreeOracle(reference, len(prompt))
        out = generate_tree(session(target, drafter), oracle, prompt, 40, {eos}, 8, topk=2)
    else:
        oracle = Oracle(reference, len(prompt), BLOCK - 1)
        out = generate(session(target, drafter), oracle, prompt, 40, {eos})
    assert out.tokens == reference[: at + 1]
    assert out.accepted == rounds and rounds[-1] < BLOCK


def test_max_new_tokens_caps_the_last_round(target, drafter):
    prompt = PROMPTS[1]
    reference = greedy(target, drafter, prompt, 40)
    out = generate(
        session(target, drafter), Oracle(reference.tokens, len(prompt), BLOCK - 1), prompt, 7, set()
    )
    assert out.tokens == reference.tokens[:7] and out.accepted == [BLOCK, 2]


@pytest.mark.parametrize("fused_layers", [False, True], ids=["eager", "fused"])
def test_static_drafter_session_equals_recomputing_the_whole_context(target, drafter, fused_layers):
    """Drafting after context fed in rounds (cached, padded to B) == drafting after it all at
    once through the training-time forward; with the rounds' layers fused (compiled) as on
    GPUs, too."""
    torch.manual_seed(2)
    width = len(drafter.config.target_layer_ids) * drafter.config.hidden_size
    feats = torch.randn(11, width)
    embed, head = target.get_input_embeddings(), target.lm_head.weight
    pieces = DrafterSession(drafter, embed, head)
    cpu = torch.device("cpu")
    pieces.pieces = tuple(fused(f, cpu, fused_layers) for f in (layer_projections, layer_rest))
    pieces.reset(64)
    for chunk in (feats[:6], feats[6:9]):
        pieces.draft_logits(5, chunk)
    cached = pieces.draft_logits(7, feats[9:])
    block = torch.full((1, BLOCK), drafter.config.mask_token_id)
    block[0, 0] = 7
    with torch.no_grad():
        hidden = drafter(
            embed(block),
            feats[None],
            torch.arange(11, 11 + BLOCK)[None],
            torch.arange(11)[None],
            full_attend,
        )
    whole = hidden[0, 1:] @ head.T
    torch.testing.assert_close(cached, whole, atol=1e-5, rtol=1e-5)
    assert pieces.length == 11


@pytest.mark.parametrize("budget", [1, 6, 24])
def test_ddtree_decoding_is_lossless(target, drafter, kind, budget):
    for prompt in PROMPTS:
        reference = greedy(target, drafter, prompt)
        s = session(target, drafter, kind)
        out = generate_tree(s, proposer(target, drafter), prompt, 40, set(), budget=budget, topk=4)
        assert out.tokens == reference.tokens
        assert all(1 <= a <= BLOCK for a in out.accepted)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graph_decoding_equals_transformers_decoding_on_gpu(target, drafter):
    """On GPU the static session replays captured graphs; outputs equal the eager HF session's.
    The last prompt outgrows the caches, so both are reallocated and their graphs recaptured
    (into a new memory pool: the old one tripped an allocator assert in the first H200 run)."""
    model, draft = target.to("cuda"), drafter.to("cuda")
    try:
        static = session(model, draft, StaticSession)
        hf = session(model, draft, HFSession)
        for prompt in [*PROMPTS, list(range(1, 60)) * 5]:
            for make in (lambda: Proposer(), lambda: proposer(model, draft)):
                fast = generate(static, make(), prompt, 40, set())
                slow = generate(hf, make(), prompt, 40, set())
                assert fast.tokens == slow.tokens and fast.accepted == slow.accepted
            tree = generate_tree(static, proposer(model, draft), prompt, 40, set(), 6, 4)
            assert tree.tokens == greedy(model, draft, prompt, 40, HFSession).tokens
        assert static.engine.capacity == 512  # grown once, from 256
        assert static.graphs.enabled and static.graphs.graphs  # really replayed graphs
    finally:
        target.to("cpu"), drafter.to("cpu")


@pytest.mark.parametrize("budget", [None, 6])
def test_a_lookup_branch_beside_the_drafter_is_lossless(target, drafter, kind, budget):
    for prompt in [*PROMPTS, [4, 8, 15, 16, 23, 42] * 3]:
        reference = greedy(target, drafter, prompt)
        s = session(target, drafter, kind)
        out = generate_tree(s, proposer(target, drafter), prompt, 40, set(), budget, 4, True)
        assert out.tokens == reference.tokens
        assert all(1 <= a <= BLOCK for a in out.accepted)


def test_a_lookup_branch_accepts_whichever_branch_the_target_follows(target, drafter):
    """Beside a drafter that is always wrong, every round accepts what prompt lookup alone
    would; beside a perfect one, what the drafter alone would (B per round)."""
    prompt = [4, 8, 15, 16, 23, 42] * 3
    reference = greedy(target, drafter, prompt, 40).tokens
    alone = generate(session(target, drafter), LookupProposer(BLOCK), prompt, 40, set())
    assert max(alone.accepted) > 1  # the target repeats itself: lookup has something to win
    wrong = TreeOracle(reference, len(prompt), wrong=True)
    out = generate_tree(session(target, drafter), wrong, prompt, 40, set(), None, 1, True)
    assert out.tokens == reference and out.accepted == alone.accepted
    perfect = TreeOracle(reference, len(prompt))
    out = generate_tree(
        session(target, drafter), perfect, prompt, 1 + 5 * BLOCK, set(), None, 1, True
    )
    assert out.accepted == [BLOCK] * 5


def test_the_clock_probe_between_methods_leaves_decoding_as_it_was(target, drafter, kind):
    """The evaluation times fixed steps on its live sessions after its methods (the clock's
    check): the methods after it decode the same tokens in the same rounds."""
    t, p = session(target, drafter, kind), proposer(target, drafter)
    before = [generate(t, p, prompt, 40, set()) for prompt in PROMPTS]
    probe = probe_steps(t, p, VOCAB)
    after = [generate(t, p, prompt, 40, set()) for prompt in PROMPTS]
    assert [g.tokens for g in after] == [g.tokens for g in before]
    assert [g.accepted for g in after] == [g.accepted for g in before]
    assert min(probe["verify_1_ms"], probe[f"verify_{BLOCK}_ms"], probe["drafter_round_ms"]) > 0
    assert probe["drafter_cache_rows"] >= 64 + BLOCK  # the CPU probe's prefix and a round


@pytest.mark.parametrize("budget", ["plain", None, 6], ids=["generate", "chain", "ddtree"])
@pytest.mark.parametrize("poisoned", ["target", "drafter"])
def test_a_round_reads_no_cache_row_past_its_span(target, drafter, budget, poisoned, monkeypatch):
    """A round costs the same whatever longer prompts grew the caches before it: the target's
    and the drafter's steps read only the rows up to their span (`attended`). Every row of one
    cache past the first span is NaN here, which any read of it would spread into the tokens."""
    from dflash.eval import sessions

    def decode(span_rows):
        monkeypatch.setattr(sessions, "SPAN_ROWS", span_rows)
        t, p = session(target, drafter), proposer(target, drafter)
        t.reset(4096)
        features = t.forward(PROMPTS[0])[1]
        p.start(PROMPTS[0], features, 4096)
        p.session.draft_logits(PROMPTS[0][-1], features)  # allocates the drafter's cache
        caches = {"target": t.engine.keys + t.engine.values, "drafter": sum(p.session.cache.kv, ())}
        for cache in caches[poisoned]:
            cache[:, :, 256:] = float("nan")
        draft_logits, nan_drafts = p.session.draft_logits, []

        def watched(*args):  # a NaN draft is only rejected: watch the drafter's logits
            logits = draft_logits(*args)
            nan_drafts.append(bool(logits.isnan().any()))
            return logits

        monkeypatch.setattr(p.session, "draft_logits", watched)
        prompt = PROMPTS[2]
        if budget == "plain":
            return generate(t, p, prompt, 40, set()), any(nan_drafts)
        return generate_tree(t, p, prompt, 40, set(), budget, 4), any(nan_drafts)

    reference = greedy(target, drafter, PROMPTS[2])
    out, nan_drafts = decode(256)
    assert out.tokens == reference.tokens and not nan_drafts
    whole, nan_drafts = decode(1 << 20)  # the whole cache: the NaN rows are read
    assert whole.tokens != reference.tokens if poisoned == "target" else nan_drafts


@pytest.mark.parametrize("budget", ["plain", None, 6], ids=["generate", "chain", "ddtree"])
@pytest.mark.parametrize("lookup", [False, True], ids=["", "lookup"])
def test_decoding_across_many_span_boundaries_stays_lossless(
    target, drafter, budget, lookup, monkeypatch
):
    """Spans of 4 rows: every round's steps cross span boundaries (the drafter's padded rows,
    a tree straddling one, the span growing mid-sequence) and still decode the target's text
    with the acceptance of whole-cache steps."""
    from dflash.eval import sessions

    def decode(prompt):
        t, p = session(target, drafter), proposer(target, drafter)
        if budget == "plain":
            proposer_ = LookupProposer(BLOCK) if lookup else p
            return generate(t, proposer_, prompt, 40, set())
        return generate_tree(t, p, prompt, 40, set(), budget, 4, lookup)

    prompts = [*PROMPTS, [4, 8, 15, 16, 23, 42] * 3]
    whole = [decode(prompt) for prompt in prompts]
    monkeypatch.setattr(sessions, "SPAN_ROWS", 4)
    for prompt, reference in zip(prompts, whole, strict=True):
        out = decode(prompt)
        assert out.tokens == greedy(target, drafter, prompt).tokens
        assert out.accepted == reference.accepted
