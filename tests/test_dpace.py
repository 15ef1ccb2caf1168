"""D-PACE (drafter.loss: dpace) against its definition, and the default loss left as it was."""

import pytest
import torch
import torch.nn.functional as F

from dflash.model.dpace import dpace_weights
from dflash.model.drafter import Drafter, DrafterConfig
from dflash.model.lm_loss import chunked_lm_loss, weighted_lm_loss
from dflash.model.objective import (
    default_gamma,
    dense_mask,
    dflash_loss,
    dflash_mask_mod,
    make_blocks,
    sample_anchors,
    sdpa_attend,
)


def blocks_case(b=3, n=4, bs=6, seed=0):
    """Per-slot CE (b, n, bs) and trained slots: slot 0 never, gaps inside blocks (a user turn
    between two answers), a block past the row's end, a padding block."""
    g = torch.Generator().manual_seed(seed)
    ce = torch.rand(b, n, bs, generator=g) * 4.0
    trained = torch.rand(b, n, bs, generator=g) < 0.75
    trained[..., 0] = False
    trained[0, 1, 3:] = False  # runs past the sequence end
    trained[1, 2] = False  # a padding block
    return ce, trained


def loop_weights(ce, trained, alpha):
    """The definition, slot by slot: C_m = prod over trained k <= m of (1-a) exp(-CE_k) + a,
    w_k = sum over trained m >= k of C_m, for trained k."""
    w = torch.zeros_like(ce, dtype=torch.float64)
    b, n, bs = ce.shape
    for i in range(b):
        for j in range(n):
            reach, prod = [0.0] * bs, 1.0
            for m in range(bs):
                if trained[i, j, m]:
                    prod *= (1 - alpha) * torch.exp(-ce[i, j, m].double()).item() + alpha
                    reach[m] = prod
            for k in range(bs):
                if trained[i, j, k]:
                    w[i, j, k] = sum(reach[m] for m in range(k, bs) if trained[i, j, m])
    return w


@pytest.mark.parametrize("alpha", [0.0, 0.3, 0.5, 1.0])
def test_dpace_weights_equal_a_loop_over_the_definition(alpha):
    ce, trained = blocks_case()
    w = dpace_weights(ce, trained, alpha)
    assert torch.allclose(w.double(), loop_weights(ce, trained, alpha), rtol=1e-5, atol=1e-6)
    assert not w.requires_grad and torch.equal(w > 0, trained)


def test_alpha_one_weighs_each_slot_by_the_trained_slots_from_it_on():
    ce, trained = blocks_case(seed=1)
    from_here = trained.flip(-1).cumsum(-1).flip(-1).float() * trained
    assert torch.equal(dpace_weights(ce, trained, 1.0), from_here)


def test_with_alpha_zero_the_loss_gradient_is_minus_that_of_the_expected_accepted_length():
    """The paper's derivation: sum_m prod_{k<=m} q_k is the expected number of accepted draft
    tokens; with alpha 0 the D-PACE loss's gradient is exactly minus its gradient."""
    g = torch.Generator().manual_seed(2)
    b, n, bs, vocab = 2, 3, 5, 11
    logits = torch.randn(b * n * bs, vocab, generator=g, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, vocab, (b * n * bs,), generator=g)
    trained = torch.rand(b, n, bs, generator=g) < 0.8
    trained[..., 0] = False
    ce = F.cross_entropy(logits, labels, reduction="none")
    w = dpace_weights(ce.detach().view(b, n, bs), trained, 0.0).double()
    (grad_loss,) = torch.autograd.grad((w.view(-1) * ce).sum(), logits, retain_graph=True)
    q = torch.where(trained, torch.exp(-ce.view(b, n, bs)), torch.ones(()))
    expected_length = (torch.cumprod(q, dim=-1) * trained).sum()
    (grad_length,) = torch.autograd.grad(expected_length, logits)
    assert torch.allclose(grad_loss, -grad_length, rtol=1e-5, atol=1e-6)  # weights in fp32


def test_weighted_lm_loss_sees_every_chunk_before_weighing_and_equals_full_logits():
    """Chunks of 7 tokens cut blocks of 5: the weights must still come from the whole block."""
    g = torch.Generator().manual_seed(3)
    b, n, bs, width, vocab = 2, 3, 5, 16, 40
    hidden = torch.randn(b * n * bs, width, generator=g, requires_grad=True)
    head = torch.randn(vocab, width, generator=g)
    labels = torch.randint(0, vocab, (b * n * bs,), generator=g)
    trained = torch.rand(b, n, bs, generator=g) < 0.8
    trained[..., 0] = False

    def weigh(ce):
        return dpace_weights(ce.view(b, n, bs), trained, 0.5).view(-1)

    total, correct, w = weighted_lm_loss(hidden, head, labels, weigh, chunk_tokens=7)
    total.backward()
    grad = hidden.grad.clone()
    hidden.grad = None
    logits = hidden @ head.t()
    ce = F.cross_entropy(logits, labels, reduction="none")
    full_w = weigh(ce.detach())
    (full_w * ce).sum().backward()
    assert torch.allclose(w, full_w, atol=1e-6)
    assert total.item() == pytest.approx((full_w * ce).sum().item(), rel=1e-6)
    assert torch.allclose(grad, hidden.grad, atol=1e-6)
    assert torch.equal(correct, logits.argmax(-1) == labels)
    with torch.no_grad():  # the same numbers without a gradient
        again, _, _ = weighted_lm_loss(hidden, head, labels, weigh, chunk_tokens=7)
    assert again.item() == pytest.approx(total.item(), rel=1e-6)


def tiny_step_inputs(seed=0, b=2, s=24):
    cfg = DrafterConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, vocab_size=50, block_size=4, num_target_layers=8,
        target_layer_ids=[1, 3, 5], mask_token_id=3, rope_theta=10000.0,
        max_position_embeddings=256,
    )  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    drafter = Drafter(cfg)
    embed = torch.nn.Embedding(cfg.vocab_size, cfg.hidden_size)
    embed.requires_grad_(False)
    head = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g)
    ids = torch.randint(0, cfg.vocab_size, (b, s), generator=g)
    mask = (torch.rand(b, s, generator=g) < 0.8).long()
    mask[:, :4] = 0
    features = torch.randn(b, s, 3 * cfg.hidden_size, generator=g)
    return drafter, embed, head, ids, mask, features


def test_the_default_loss_is_the_decayed_loss_computed_as_before_bit_for_bit():
    """drafter.loss: decayed (the default) takes the path it took before D-PACE existed:
    the same anchors, blocks, forward and chunked CE over the exp(-(k-1)/gamma) weights,
    divided by their sum. Written out here step by step; equal to the last bit."""
    drafter, embed, head, ids, mask, features = tiny_step_inputs()
    loss, metrics = dflash_loss(
        drafter, embed, head, features, ids, mask, torch.Generator().manual_seed(5), 6
    )
    cfg = drafter.config
    b, s = ids.shape
    anchors, valid = sample_anchors(mask, 6, torch.Generator().manual_seed(5), ids, 1.0)
    blocks = make_blocks(ids, mask, anchors, valid, 4, cfg.mask_token_id, default_gamma(4))
    q_len = blocks.ids.shape[1]
    attend = sdpa_attend(
        dense_mask(dflash_mask_mod(anchors, valid, s, 4), b, q_len, s + q_len, ids.device)
    )
    hidden = drafter(
        embed(blocks.ids), features, blocks.positions, torch.arange(s).expand(b, s), attend
    )
    weights = blocks.weights.view(-1)
    total, _ = chunked_lm_loss(hidden.reshape(-1, 32), head, blocks.labels.view(-1), weights)
    expected = total / weights.sum().clamp(min=1e-6)
    assert torch.equal(loss, expected)
    assert metrics["loss"] == float(expected.detach())


@pytest.mark.parametrize("norm", ["blocks", "weights"])
def test_the_dpace_loss_is_the_weighted_ce_over_its_normaliser(norm, monkeypatch):
    """drafter.loss: dpace through the training forward: the same anchors and forward as the
    decayed loss, D-PACE's weights from each slot's CE, divided by the real blocks or by the
    weights' sum; its gradient reaches the drafter."""
    drafter, embed, head, ids, mask, features = tiny_step_inputs(seed=1)
    seen = {}

    def spy(hidden, head_weight, labels, weigh, chunk_tokens, compiled=False):
        seen["hidden"], seen["labels"] = hidden, labels
        return weighted_lm_loss(hidden, head_weight, labels, weigh, chunk_tokens, compiled)

    monkeypatch.setattr("dflash.model.objective.weighted_lm_loss", spy)
    loss, metrics = dflash_loss(
        drafter, embed, head, features, ids, mask, torch.Generator().manual_seed(5), 6,
        dpace={"alpha": 0.5, "norm": norm},
    )  # fmt: skip
    anchors, valid = sample_anchors(mask, 6, torch.Generator().manual_seed(5), ids, 1.0)
    blocks = make_blocks(ids, mask, anchors, valid, 4, 3, default_gamma(4))
    assert torch.equal(seen["labels"], blocks.labels.view(-1))
    ce = F.cross_entropy(seen["hidden"].detach() @ head.t(), seen["labels"], reduction="none")
    w = dpace_weights(ce.view(blocks.labels.shape), blocks.weights > 0, 0.5)
    count = valid.sum() if norm == "blocks" else w.sum()
    assert loss.item() == pytest.approx(float((w.view(-1) * ce).sum() / count), rel=1e-5)
    loss.backward()
    assert drafter.fc.weight.grad is not None and drafter.fc.weight.grad.abs().sum() > 0
    assert 1.0 <= metrics["tau"] <= 4.0


def test_dpace_refuses_distillation():
    drafter, embed, head, ids, mask, features = tiny_step_inputs()
    wide = torch.cat([features, torch.randn(*features.shape[:2], 32)], dim=-1)
    with pytest.raises(ValueError, match="D-PACE weighs hard labels"):
        dflash_loss(
            drafter, embed, head, wide, ids, mask, torch.Generator(), 6, distill=0.5,
            dpace={"alpha": 0.5, "norm": "blocks"},
        )  # fmt: skip


def test_the_training_step_passes_drafter_dpace_to_the_loss(monkeypatch):
    from dflash.model import objective
    from dflash.model.step import TrainStep, dpace_settings

    drafter, embed, head, ids, mask, features = tiny_step_inputs()
    seen = []
    real = objective.dflash_loss

    def spy(*args, **kwargs):
        seen.append(kwargs["dpace"])
        return real(*args, **kwargs)

    monkeypatch.setattr("dflash.model.step.dflash_loss", spy)
    settings = {"loss": "dpace", "dpace": {"alpha": 0.3, "norm": "weights"}}
    step = TrainStep(
        drafter, embed, head, max_anchors=6, gamma=None, attention="sdpa", compile=False,
        dpace=dpace_settings(settings),
    )  # fmt: skip
    step(features, ids, mask, torch.Generator().manual_seed(0))
    assert seen == [{"alpha": 0.3, "norm": "weights"}]
    assert dpace_settings({"loss": "decayed", "dpace": {"alpha": 0.3, "norm": "weights"}}) is None


@pytest.mark.parametrize(
    "drafter, train, message",
    [
        ({"gamma": 7.0}, {}, r"drafter.gamma \(7.0\) is the decayed loss's"),
        ({}, {"distill": 0.5}, r"drafter.loss: dpace weighs hard labels, so train.distill"),
    ],
)
def test_dpace_with_what_it_cannot_use_is_refused_naming_the_key(drafter, train, message):
    from dflash.config import ConfigError, check_levers, validate

    config = validate({"drafter": {"loss": "dpace", **drafter}, "train": train})
    with pytest.raises(ConfigError, match=message):
        check_levers(config)
    check_levers(validate({"drafter": drafter, "train": train}))  # the decayed loss takes both
