"""Target features from the real SmolLM2 target, and a drafter that learns from them."""

from pathlib import Path

import polars as pl
import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from dflash.model.drafter import Drafter, DrafterConfig
from dflash.model.objective import dflash_loss
from dflash.model.target import (
    TargetFeatures,
    default_layer_ids,
    load_target,
    resolve_mask_token,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def batch(tiny_workflow):
    rows = pl.read_parquet(tiny_workflow.results / "data/tokenized/train.parquet").head(2)
    width = rows["length"].max()
    ids = torch.zeros(2, width, dtype=torch.long)
    mask = torch.zeros(2, width, dtype=torch.long)
    for i, row in enumerate(rows.iter_rows(named=True)):
        ids[i, : row["length"]] = torch.tensor(row["input_ids"])
        mask[i, : row["length"]] = torch.tensor(row["loss_mask"])
    return ids, mask, rows["length"].to_list()


def test_features_equal_hidden_state_slices_and_stop_early(target_dir, batch):
    ids, _, lengths = batch
    attention = (torch.arange(ids.shape[1]) < torch.tensor(lengths)[:, None]).long()
    full = load_target(target_dir)
    with torch.no_grad():
        hidden = full(
            input_ids=ids, attention_mask=attention, output_hidden_states=True
        ).hidden_states
    layer_ids = default_layer_ids(full.config.num_hidden_layers, 5)
    expected = torch.cat([hidden[i + 1] for i in layer_ids], dim=-1)

    features = TargetFeatures(load_target(target_dir), layer_ids)
    assert features.written_out  # SmolLM2 is a Llama: its layers run written out
    got = features(ids, attention)
    assert len(features.decoder.layers) == max(layer_ids) + 1 == 28  # 28, 29, LM head cut off
    valid = attention.bool()
    assert torch.allclose(got[valid], expected[valid], atol=1e-4, rtol=1e-4)


DECODERS = {  # (config, model, config fields beyond small_decoder's)
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    # Mistral's config defaults to a 4,096-token sliding window (v0.1), which runs through
    # transformers; later Mistral models have none
    "mistral": (MistralConfig, MistralForCausalLM, {"sliding_window": None}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {}),
}


@pytest.mark.parametrize("kind", DECODERS)
def test_written_out_layers_equal_transformers_and_compile_to_one_graph(kind, small_decoder):
    """The written-out decoder (no mask machinery, no host sync) gives transformers' own hidden
    states bit for bit; a padding mask that is not right-padding goes through transformers'
    forward; compiled, every layer runs one graph."""
    import torch._dynamo

    torch.manual_seed(0)
    config, cls, extra = DECODERS[kind]
    model = cls(config(**small_decoder, **extra)).eval()
    ids = torch.randint(0, small_decoder["vocab_size"], (2, 12))
    left = torch.ones_like(ids)
    left[0, :3] = 0
    with torch.no_grad():
        hidden = model(input_ids=ids, output_hidden_states=True).hidden_states
        padded = model(input_ids=ids, attention_mask=left, output_hidden_states=True)
    layer_ids = [0, 2]
    features = TargetFeatures(model, layer_ids)
    assert features.written_out
    assert torch.equal(features(ids), torch.cat([hidden[i + 1] for i in layer_ids], -1))
    expected = torch.cat([padded.hidden_states[i + 1] for i in layer_ids], -1)
    assert torch.equal(features(ids, left)[left.bool()], expected[left.bool()])

    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    assert features.compile_layers()
    eager = features(ids, compiled=False)
    compiled = features(ids)
    assert counters["stats"]["unique_graphs"] == 1  # 3 layers, one graph
    assert torch.allclose(compiled, eager, atol=1e-5, rtol=1e-5)


def test_the_mask_token_is_the_configured_one_or_an_unused_special_and_must_fit(target_dir):
    from dflash.errors import UserError

    assert resolve_mask_token(target_dir, 3) == 3
    # a configured id needs no tokenizer (config/models: a config.json alone, random weights)
    config_only = Path(__file__).resolve().parents[1] / "config/models/smollm2-135m"
    assert resolve_mask_token(config_only, 3) == 3
    # SmolLM2's tokenizer has no mask token: the first special token its template never emits
    assert resolve_mask_token(target_dir, None) == 3
    with pytest.raises(UserError, match=r"mask_token_id: 2 '<\|im_end\|>' is a token the chat"):
        resolve_mask_token(target_dir, 2)
    with pytest.raises(UserError, match=r"mask_token_id=49152 is outside the vocabulary"):
        resolve_mask_token(target_dir, 49152)
    with pytest.raises(UserError, match="no such directory"):
        resolve_mask_token(target_dir / "missing", 3)


def test_features_with_output_end_with_what_the_lm_head_reads(target_dir, batch):
    """For distillation the whole target runs and its normed output comes after the layer
    features: the LM head on it gives the target's own logits."""
    ids, _, lengths = batch
    attention = (torch.arange(ids.shape[1]) < torch.tensor(lengths)[:, None]).long()
    full = load_target(target_dir)
    with torch.no_grad():
        logits = full(input_ids=ids, attention_mask=attention).logits
    layer_ids = default_layer_ids(full.config.num_hidden_layers, 3)
    narrow = TargetFeatures(load_target(target_dir), layer_ids)(ids, attention)
    features = TargetFeatures(load_target(target_dir), layer_ids, with_output=True)
    got = features(ids, attention)
    assert len(features.decoder.layers) == full.config.num_hidden_layers
    h = full.config.hidden_size
    valid = attention.bool()
    assert torch.equal(got[..., : 3 * h][valid], narrow[valid])
    own = got[..., 3 * h :] @ features.lm_head.weight.t()
    assert torch.allclose(own[valid], logits[valid], atol=1e-3, rtol=1e-3)


def test_drafter_overfits_one_batch(target_dir, batch):
    ids, loss_mask, _ = batch
    target = load_target(target_dir)
    layer_ids = default_layer_ids(target.config.num_hidden_layers, 1)
    features = TargetFeatures(target, layer_ids)
    feats = features(ids)
    cfg = DrafterConfig.for_target(
        target.config, num_layers=1, block_size=8, mask_token_id=3, target_layer_ids=layer_ids
    )
    torch.manual_seed(0)
    drafter = Drafter(cfg)
    opt = torch.optim.AdamW(drafter.parameters(), lr=1e-3, weight_decay=0.0)
    head = features.lm_head.weight
    history = []
    for _ in range(80):  # here tau is 1.2 at step 40, 5.6 at step 70 and 6.8 at step 80
        gen = torch.Generator().manual_seed(0)  # the same anchors every step: memorise them
        loss, metrics = dflash_loss(
            drafter, features.embed_tokens, head, feats, ids, loss_mask, gen, max_anchors=8
        )
        opt.zero_grad()
        loss.backward()
        opt.step()
        history.append(metrics)
    assert history[0]["tau"] < 1.5
    assert history[-1]["tau"] > 3.0, [round(m["tau"], 2) for m in history]
    assert history[-1]["loss"] < 0.3 * history[0]["loss"]


def test_a_sliding_window_target_runs_through_transformers(small_decoder):
    """A layout the written-out layer does not cover (here a sliding window) keeps
    transformers' forward, and compiling it is a no-op."""
    torch.manual_seed(0)
    model = MistralForCausalLM(MistralConfig(**small_decoder, sliding_window=8)).eval()
    ids = torch.randint(0, small_decoder["vocab_size"], (2, 12))
    with torch.no_grad():
        hidden = model(input_ids=ids, output_hidden_states=True).hidden_states
    features = TargetFeatures(model, [0, 2])
    assert not features.written_out and not features.compile_layers()
    assert torch.equal(features(ids), torch.cat([hidden[1], hidden[3]], -1))


def test_a_compiler_failure_leaves_the_features_eager(small_decoder, monkeypatch, caplog):
    """An inductor bug must not end a week-long run: the features run eagerly, said loudly."""
    import dflash.model.target as target_module
    from dflash.train.features import FeatureModel

    def broken(fn, **kwargs):
        def compiled(*args):
            raise RuntimeError("inductor: injected failure")

        return compiled

    monkeypatch.setattr(target_module.torch, "compile", broken)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**small_decoder)).eval()
    config = {"train": {"distill": 0}, "compile": {"enabled": True, "target": True}}
    features = FeatureModel(model, [0, 2], torch.device("cpu"), config)
    assert features.compiled
    assert features.compile_shapes([(2, 12)]) == []
    assert not features.compiled and "features run eagerly" in caplog.text
    ids = torch.randint(0, small_decoder["vocab_size"], (2, 12))
    assert torch.equal(features.queue(ids), features.queue(ids, compiled=False))
