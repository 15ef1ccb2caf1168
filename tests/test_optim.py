"""The drafter's optimiser (train.optimizer: adamw | muon) and a fine-tune's schedule
(train.finetune), on a tiny drafter and the real training step, a few steps each."""

import copy
import logging
import math

import pytest
import torch

from dflash.config import ConfigError, check_levers, validate
from dflash.model.drafter import Drafter, DrafterConfig
from dflash.model.step import TrainStep
from dflash.train import optim
from dflash.train.checkpoint import load_state, save_checkpoint

CPU = torch.device("cpu")


def tiny(seed: int = 0):
    cfg = DrafterConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, vocab_size=50, block_size=4, num_target_layers=8,
        target_layer_ids=[1, 3, 5], mask_token_id=3, rope_theta=10000.0,
        max_position_embeddings=256,
    )  # fmt: skip
    torch.manual_seed(seed)
    return Drafter(cfg)


def batch(seed: int = 0, b: int = 2, s: int = 24):
    """A cycle of 8 tokens from a random start in each row: every label follows from the
    anchor's token and the slot, so there is something to learn in a few steps."""
    g = torch.Generator().manual_seed(100 + seed)
    ids = 10 + (torch.randint(0, 8, (b, 1), generator=g) + torch.arange(s)) % 8
    mask = torch.ones_like(ids)
    mask[:, :4] = 0
    return torch.randn(b, s, 96, generator=g), ids, mask


class Run:
    """A drafter, its step and its optimiser as the trainer builds them, on fixed batches."""

    def __init__(self, config: dict, total_steps: int = 10):
        self.config = validate(copy.deepcopy(config))
        self.drafter = tiny()
        g = torch.Generator().manual_seed(1)
        self.embed = torch.nn.Embedding(50, 32).requires_grad_(False)
        self.head = torch.randn(50, 32, generator=g)
        self.frozen = optim.freeze_layers(self.drafter, self.config)
        self.step_fn = TrainStep(
            self.drafter, self.embed, self.head, max_anchors=6, gamma=None, attention="sdpa",
            compile=False,
        )  # fmt: skip
        self.optimizer, self.scheduler = optim.build(self.drafter, self.config, total_steps, CPU)
        self.done = 0

    def steps(self, n: int) -> list[float]:
        """n optimizer steps as Trainer.optimizer_step takes them; the losses."""
        losses = []
        for _ in range(n):
            features, ids, mask = batch(self.done % 3)
            metrics = self.step_fn(features, ids, mask, torch.Generator().manual_seed(self.done))
            torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), 1.0)
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
            losses.append(metrics["loss"])
            self.done += 1
        return losses

    def state(self) -> dict:
        return {
            "drafter": self.drafter.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
        }

    def load(self, state: dict) -> None:  # as Trainer.resume does
        self.drafter.load_state_dict(state["drafter"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])


def same_weights(a: Drafter, b: Drafter) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


MUON = {"train": {"optimizer": "muon", "lr": 3e-3}}


def test_the_default_optimiser_is_adamw_built_as_before_bit_for_bit():
    """train.optimizer: adamw (the default) is the AdamW and cosine schedule the trainer built
    before the key existed: the same weights to the last bit after 4 steps."""
    from dflash.train.optim import cosine_with_warmup

    run = Run({})
    assert type(run.optimizer) is torch.optim.AdamW
    before = Run({})
    before.optimizer = torch.optim.AdamW(
        before.drafter.parameters(), lr=6e-4, weight_decay=0.0, betas=(0.9, 0.95), fused=False
    )
    before.scheduler = torch.optim.lr_scheduler.LambdaLR(
        before.optimizer, cosine_with_warmup(10, 0.04)
    )
    run.steps(4)
    before.steps(4)
    assert same_weights(run.drafter, before.drafter)
    assert (
        run.optimizer.state_dict()["param_groups"] == before.optimizer.state_dict()["param_groups"]
    )


def test_muon_takes_the_weight_matrices_and_adamw_the_rest():
    run = Run(MUON)
    named = dict(run.drafter.named_parameters())
    ids = {id(p): name for name, p in named.items()}
    muon = {ids[id(p)] for g in run.optimizer.named["muon"].param_groups for p in g["params"]}
    adamw = {ids[id(p)] for g in run.optimizer.named["adamw"].param_groups for p in g["params"]}
    assert isinstance(run.optimizer.named["muon"], torch.optim.Muon)  # GroupedMuon
    assert muon | adamw == named.keys() and not muon & adamw
    assert muon == {n for n, p in named.items() if p.ndim == 2}
    projections = {f"{m}_proj" for m in ("q", "k", "v", "o", "gate", "up", "down")}
    assert muon == {"fc.weight"} | {
        n for n in named if n.split(".")[-2] in projections and n.startswith("layers.")
    }
    assert adamw and all(named[n].ndim == 1 for n in adamw)  # the RMSNorm weights
    (muon_group,) = run.optimizer.named["muon"].param_groups
    (adamw_group,) = run.optimizer.named["adamw"].param_groups
    assert muon_group["lr"] == pytest.approx(10 * adamw_group["lr"])  # train.muon.lr_scale
    assert muon_group["adjust_lr_fn"] == "match_rms_adamw" and muon_group["weight_decay"] == 0.1
    assert run.scheduler.get_last_lr()[0] == adamw_group["lr"]  # the train.lr schedule is logged


@pytest.mark.parametrize("native", [False, True])
def test_muon_where_bf16_is_emulated_is_said_to_be_slow_and_adamw_never(
    monkeypatch, caplog, native
):
    """torch's Muon orthogonalises in bf16 on any device: 4.7 s a matrix on an AVX2 CPU."""
    monkeypatch.setattr("dflash.train.optim.native_bf16", lambda device: native)
    with caplog.at_level(logging.WARNING, logger="dflash.train.optim"):
        Run({})
        adamw = len(caplog.records)
        Run(MUON)
    said = [r.getMessage() for r in caplog.records if "Newton-Schulz" in r.getMessage()]
    assert adamw == 0 and len(said) == (0 if native else 1)
    assert native or said[0].startswith("train.optimizer: muon on a CPU without bf16 units")


def test_a_muon_run_lowers_the_loss():
    run = Run(MUON, total_steps=12)
    fc = run.drafter.fc.weight.detach().clone()
    losses = run.steps(12)
    assert all(math.isfinite(x) for x in losses)
    # three batches in turn: the last three steps against the first three
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.25, losses
    assert not torch.equal(run.drafter.fc.weight, fc)  # Muon moved its matrices


def test_a_muon_run_resumed_from_a_checkpoint_ends_with_the_uninterrupted_weights(tmp_path):
    """Muon's momentum and AdamW's moments and both schedules go through a checkpoint as the
    trainer writes and reads it (weights-only loading) and resume bit for bit on CPU."""
    whole = Run(MUON)
    whole.steps(6)
    first = Run(MUON)
    first.steps(3)
    save_checkpoint(tmp_path, 3, first.state(), {"epoch": 0}, keep=1)
    second = Run(MUON)
    second.load(load_state(tmp_path / "step-00000003"))
    second.done = 3
    second.steps(3)
    assert same_weights(second.drafter, whole.drafter)
    assert not same_weights(second.drafter, first.drafter)  # the last 3 steps did something
    momentum = whole.optimizer.named["muon"].state[whole.drafter.fc.weight]["momentum_buffer"]
    resumed = second.optimizer.named["muon"].state[second.drafter.fc.weight]["momentum_buffer"]
    assert torch.equal(momentum, resumed)


def test_grouped_muon_steps_the_drafter_as_torchs_muon_does(monkeypatch):
    """The drafter's matrices stepped a shape at a time (GroupedMuon) against torch's Muon
    stepping them one by one: the same losses and weights, bit for bit on CPU, over real
    training steps."""
    grouped = Run(MUON)
    grouped_losses = grouped.steps(4)
    monkeypatch.setattr(optim, "_muon_class", lambda: torch.optim.Muon)
    plain = Run(MUON)
    assert type(plain.optimizer.named["muon"]) is torch.optim.Muon
    assert plain.steps(4) == grouped_losses
    assert same_weights(plain.drafter, grouped.drafter)


@pytest.mark.parametrize("nesterov, adjust", [(True, None), (False, "original")])
def test_grouped_muon_equals_torchs_for_tall_wide_and_square_matrices(nesterov, adjust):
    """Stacks of tall, wide and square matrices (Newton-Schulz works on the wide side) and a
    shape of its own: each step's weights and momentum equal torch's Muon's, and a state dict
    saved by one loads into the other."""
    from dflash.train.muon import GroupedMuon

    shapes = [(64, 32)] * 3 + [(32, 64)] * 2 + [(48, 48)] * 2 + [(16, 80)]

    def matrices():
        g = torch.Generator().manual_seed(1)
        return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes]

    kwargs = {"lr": 0.02, "weight_decay": 0.1, "nesterov": nesterov, "adjust_lr_fn": adjust}
    theirs, ours = matrices(), matrices()
    reference, grouped = torch.optim.Muon(theirs, **kwargs), GroupedMuon(ours, **kwargs)
    g = torch.Generator().manual_seed(2)
    for _ in range(3):
        for p, q in zip(theirs, ours, strict=True):
            p.grad = torch.randn(p.shape, generator=g)
            q.grad = p.grad.clone()
        reference.step()
        grouped.step()
        assert all(torch.equal(p, q) for p, q in zip(theirs, ours, strict=True))
    again = GroupedMuon(matrices(), **kwargs)
    again.load_state_dict(reference.state_dict())
    momentum = [reference.state[p]["momentum_buffer"] for p in theirs]
    assert all(
        torch.equal(again.state[p]["momentum_buffer"], m)
        for p, m in zip(again.param_groups[0]["params"], momentum, strict=True)
    )


def test_muon_without_torch_optim_muon_is_refused_naming_the_key_and_torch(monkeypatch):
    monkeypatch.delattr(torch.optim, "Muon")
    with pytest.raises(ConfigError, match=r"train.optimizer: muon needs torch.optim.Muon .*torch "):
        Run(MUON)
    monkeypatch.setattr("dflash.config._torch_version", lambda: (2, 8))
    with pytest.raises(ConfigError, match=r"train.optimizer: muon .* has torch 2.8"):
        check_levers(validate(copy.deepcopy(MUON)))


FINETUNE = {
    "drafter": {"init": "drafters/run-1"},  # freeze and schedule read the config only
    "train": {"lr": 6e-4, "finetune": {"lr": 1e-4, "warmup_steps": 3, "freeze_layers": 2}},
}


def test_a_finetune_keeps_its_frozen_layers_as_they_were_and_trains_the_rest():
    run = Run(FINETUNE)
    start = {k: v.clone() for k, v in run.drafter.state_dict().items()}
    run.steps(3)
    end = run.drafter.state_dict()
    frozen = {k for k in start if k.startswith(("layers.0.", "layers.1."))}
    assert frozen == set(run.frozen)
    assert all(torch.equal(start[k], end[k]) for k in frozen)
    assert all(not torch.equal(start[k], end[k]) for k in start.keys() - frozen)
    trained = {id(p) for g in run.optimizer.param_groups for p in g["params"]}
    assert trained == {id(p) for p in run.drafter.parameters() if p.requires_grad}
    assert len(trained) == len(start) - len(frozen)


def test_a_finetune_follows_its_own_peak_lr_and_warmup_steps():
    run = Run(FINETUNE, total_steps=20)
    lrs = []
    for _ in range(20):
        lrs.append(run.scheduler.get_last_lr()[0])
        run.optimizer.step()  # no gradients: moves nothing
        run.scheduler.step()
    assert lrs[:3] == pytest.approx([1e-4 / 3, 2e-4 / 3, 1e-4])  # 3 warmup steps to 1e-4
    assert lrs[3] == pytest.approx(1e-4) and max(lrs) == pytest.approx(1e-4)
    assert all(a > b for a, b in zip(lrs[3:], lrs[4:], strict=False))  # then the cosine
    plain = Run({"drafter": {"init": "drafters/run-1"}}, total_steps=100)
    assert plain.scheduler.get_last_lr()[0] == pytest.approx(6e-4 / 4)  # train.warmup_ratio
    assert plain.frozen == []


@pytest.mark.parametrize(
    "config, message",
    [
        (
            {"train": {"finetune": {"lr": 1e-4}}},
            r"train.finetune \(lr\) schedules a fine-tune, but drafter.init is random",
        ),
        (
            {
                "drafter": {"init": "x", "num_layers": 2},
                "train": {"finetune": {"freeze_layers": 3}},
            },
            r"train.finetune.freeze_layers \(3\) is more than the drafter's 2 layers",
        ),
    ],
)
def test_a_finetune_schedule_that_cannot_apply_is_refused_naming_the_key(config, message):
    with pytest.raises(ConfigError, match=message):
        check_levers(validate(config))
