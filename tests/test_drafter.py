"""The drafter and its objective, proven against independent oracles on tiny configs."""

import json
import math

import pytest
import torch
import torch.nn.functional as F
from conftest import REPO
from safetensors.torch import load_file

from dflash.model.drafter import (
    WEIGHTS,
    Drafter,
    DrafterCache,
    DrafterConfig,
    load_drafter,
    save_drafter,
)
from dflash.model.lm_loss import chunked_lm_loss
from dflash.model.objective import (
    Blocks,
    block_mask,
    block_metrics,
    copies_context,
    dense_mask,
    dflash_loss,
    dflash_mask_mod,
    flex_attend,
    full_attend,
    host_metrics,
    make_blocks,
    sample_anchors,
    sdpa_attend,
)
from dflash.model.target import default_layer_ids

torch.manual_seed(0)


def tiny_config(**kw):
    base = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        vocab_size=50,
        block_size=4,
        num_target_layers=8,
        target_layer_ids=[1, 3, 5],
        mask_token_id=3,
        rope_theta=10000.0,
        max_position_embeddings=256,
    )
    return DrafterConfig(**{**base, **kw})


def random_case(b=3, s=20, n=3, bs=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(6, s + 1, (b,), generator=g)
    lengths[0] = s
    loss_mask = (torch.rand(b, s, generator=g) < 0.7).long()
    loss_mask &= (torch.arange(s) < lengths[:, None]).long()
    anchors, valid = sample_anchors(loss_mask, n, g)
    return loss_mask, lengths, anchors, valid


def oracle(anchors, valid, ctx_len, bs):
    b, n = anchors.shape
    out = torch.zeros(b, n * bs, ctx_len + n * bs, dtype=torch.bool)
    for i in range(b):
        for q in range(n * bs):
            blk = q // bs
            if not valid[i, blk]:
                continue
            for kv in range(ctx_len + n * bs):
                if kv < ctx_len:
                    out[i, q, kv] = kv < anchors[i, blk]
                else:
                    out[i, q, kv] = (kv - ctx_len) // bs == blk
    return out


@pytest.mark.parametrize("seed", range(4))
def test_mask_matches_loop_oracle(seed):
    bs, s, n = 4, 20, 3
    loss_mask, _, anchors, valid = random_case(s=s, n=n, bs=bs, seed=seed)
    # the last block may run past the sequence end
    anchors[0, -1], valid[0, -1] = s - 2, True
    mod = dflash_mask_mod(anchors, valid, s, bs)
    expected = oracle(anchors, valid, s, bs)
    assert torch.equal(dense_mask(mod, 3, n * bs, s + n * bs, "cpu"), expected)
    bm = block_mask(mod, 3, n * bs, s + n * bs, "cpu")
    # Materialise the BlockMask: block-level coverage from the BlockMask, then mask_mod inside.
    cover = bm.to_dense().bool()[:, 0]
    qb, kb = bm.BLOCK_SIZE
    cover = cover.repeat_interleave(qb, 1).repeat_interleave(kb, 2)[:, : n * bs, : s + n * bs]
    materialised = cover & dense_mask(bm.mask_mod, 3, n * bs, s + n * bs, "cpu")
    assert torch.equal(materialised, expected)


def test_anchor_sampling_is_seeded_and_legal():
    loss_mask, lengths, _, _ = random_case()
    a1, v1 = sample_anchors(loss_mask, 5, torch.Generator().manual_seed(7))
    a2, v2 = sample_anchors(loss_mask, 5, torch.Generator().manual_seed(7))
    assert torch.equal(a1, a2) and torch.equal(v1, v2)
    for i in range(loss_mask.shape[0]):
        real = a1[i][v1[i]].tolist()
        assert real == sorted(real) and len(set(real)) == len(real)
        assert all(loss_mask[i, a] and loss_mask[i, a + 1] for a in real)
    none = sample_anchors(torch.zeros(2, 9, dtype=torch.long), 4, torch.Generator())
    assert none[0].shape == (2, 4) and not none[1].any()


def test_copy_anchors_are_where_the_next_token_continues_an_earlier_four_gram():
    ids = torch.tensor([[5, 6, 7, 8, 9, 1, 2, 5, 6, 7, 8, 3]])
    # tokens 7..10 (5, 6, 7, 8) repeat tokens 0..3: prompt lookup at anchor 9 (matching 5, 6, 7)
    # proposes 8, the row's next token
    assert copies_context(ids)[0].nonzero().flatten().tolist() == [9]
    g = torch.Generator().manual_seed(3)
    rows = torch.randint(0, 3, (4, 60), generator=g)  # 3 symbols: many repeats
    got = copies_context(rows)
    for r, row in enumerate(rows.tolist()):
        for a in range(60):
            gram = row[a - 2 : a + 2] if a >= 2 and a + 1 < 60 else None
            earlier = gram is not None and any(row[j : j + 4] == gram for j in range(0, a - 2))
            assert bool(got[r, a]) == earlier, (r, a)
    assert not copies_context(torch.tensor([[1, 1, 1]])).any()  # shorter than one n-gram


def test_copy_weight_draws_copy_anchors_more_often_and_one_keeps_the_uniform_draw():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 50_000, (8, 400), generator=g)
    ids[:, 300:380] = ids[:, 100:180]  # the answer repeats part of its context
    loss_mask = torch.ones_like(ids)
    copy = copies_context(ids)
    assert copy[:, 300:380].float().mean() > 0.9 and copy[:, :300].sum() == 0

    def draw(weight):
        a, v = sample_anchors(loss_mask, 32, torch.Generator().manual_seed(1), ids, weight)
        assert v.all() and all(r.tolist() == sorted(set(r.tolist())) for r in a)
        return a, copy.gather(1, a).float().mean().item()

    uniform = sample_anchors(loss_mask, 32, torch.Generator().manual_seed(1))
    assert torch.equal(draw(1.0)[0], uniform[0])  # weight 1: the reference's draw, unchanged
    share = copy.float().mean().item()  # ~0.19 of the positions
    assert draw(1.0)[1] < share + 0.1
    assert draw(8.0)[1] > 0.55  # about 8 x 0.19 / (8 x 0.19 + 0.81) = 0.65 without replacement


def test_blocks_never_outnumber_the_batch_width():
    """A sample of width s has at most s - 1 anchors: more blocks would only be padding."""
    loss_mask = torch.ones(2, 9, dtype=torch.long)
    anchors, valid = sample_anchors(loss_mask, 512, torch.Generator().manual_seed(0))
    assert anchors.shape == valid.shape == (2, 9)
    assert valid.sum(1).tolist() == [8, 8]  # every position but the last is an anchor
    assert sorted(anchors[0, :8].tolist()) == list(range(8))


def test_blocks_weights_and_slot0_exclusion():
    ids = torch.tensor([[10, 11, 12, 13, 14, 15]])
    loss_mask = torch.tensor([[0, 1, 1, 0, 1, 1]])
    anchors, valid = torch.tensor([[1, 4]]), torch.tensor([[True, True]])
    blocks = make_blocks(ids, loss_mask, anchors, valid, block_size=4, mask_token_id=3, gamma=2.0)
    assert blocks.ids.tolist() == [[11, 3, 3, 3, 14, 3, 3, 3]]
    assert blocks.positions.tolist() == [[1, 2, 3, 4, 4, 5, 6, 7]]
    assert blocks.labels.tolist() == [[[11, 12, 13, 14], [14, 15, 0, 0]]]
    w = [1.0, math.exp(-0.5), math.exp(-1.0)]
    # block 0: slot 1 -> pos 2 (trainable), slot 2 -> pos 3 (not), slot 3 -> pos 4 (trainable)
    assert blocks.weights[0, 0].tolist() == pytest.approx([0.0, w[0], 0.0, w[2]])
    # block 1: slot 1 -> pos 5, slots 2-3 run past the sequence end
    assert blocks.weights[0, 1].tolist() == pytest.approx([0.0, w[0], 0.0, 0.0])


def test_chunked_ce_equals_full_ce_and_gradients():
    h = torch.randn(37, 16, requires_grad=True)
    head = torch.randn(50, 16)
    labels = torch.randint(0, 50, (37,))
    weights = torch.rand(37)
    loss, correct = chunked_lm_loss(h, head, labels, weights, chunk_tokens=7)
    loss.backward()
    grad = h.grad.clone()
    h.grad = None
    logits = h @ head.t()
    full = (F.cross_entropy(logits, labels, reduction="none") * weights).sum()
    full.backward()
    assert loss.item() == pytest.approx(full.item(), rel=1e-6)
    assert torch.allclose(grad, h.grad, atol=1e-6)
    assert torch.equal(correct, logits.argmax(-1) == labels)


@pytest.mark.parametrize("distill", [0.0, 0.3, 1.0])
def test_soft_label_ce_equals_cross_entropy_with_the_mixed_distribution(distill):
    """With `distill`, each label is the token mixed with the target's own softmax; the fused
    loss and its gradient equal F.cross_entropy against that distribution."""
    g = torch.Generator().manual_seed(1)
    h = torch.randn(37, 16, generator=g, requires_grad=True)
    target_h = torch.randn(37, 16, generator=g)
    head = torch.randn(50, 16, generator=g)
    labels = torch.randint(0, 50, (37,), generator=g)
    weights = torch.rand(37, generator=g)
    loss, correct = chunked_lm_loss(
        h, head, labels, weights, chunk_tokens=7, soft=(target_h, distill)
    )
    loss.backward()
    grad, h.grad = h.grad.clone(), None
    logits = h @ head.t()
    label = (1 - distill) * F.one_hot(labels, 50).float() + distill * torch.softmax(
        target_h @ head.t(), -1
    )
    full = (F.cross_entropy(logits, label, reduction="none") * weights).sum()
    full.backward()
    assert loss.item() == pytest.approx(full.item(), rel=1e-5)
    assert torch.allclose(grad, h.grad, atol=1e-5)
    assert torch.equal(correct, logits.argmax(-1) == labels)
    if distill == 0.0:  # the soft path with weight 0 is the hard loss
        assert loss.item() == pytest.approx(chunked_lm_loss(h, head, labels, weights)[0].item())


def test_distill_reads_the_target_output_at_the_position_before_each_label():
    """Slot k's soft label comes from the target's output at a+k-1 (where the target predicted
    the token at a+k); the drafter itself reads only the target layers' features."""
    cfg = tiny_config()
    torch.manual_seed(0)
    drafter = Drafter(cfg)
    ids, _, features, embed, _, _ = training_inputs(cfg, b=2, s=24)
    loss_mask = torch.ones_like(ids)
    head = torch.randn(cfg.vocab_size, cfg.hidden_size)
    out = torch.randn(*ids.shape, cfg.hidden_size)
    wide = torch.cat([features, out], -1)

    def loss(feats, distill, lm_loss=None):
        g = torch.Generator().manual_seed(0)
        return dflash_loss(
            drafter, embed, head, feats, ids, loss_mask, g, 4, distill=distill, lm_loss=lm_loss
        )[0]

    seen = {}

    def spy(hidden, head_weight, labels, weights, chunk_tokens, soft=None):
        seen["soft"] = soft
        return chunked_lm_loss(hidden, head_weight, labels, weights, chunk_tokens, soft=soft)

    loss(wide, 0.5, spy)
    g = torch.Generator().manual_seed(0)
    anchors, valid = sample_anchors(loss_mask, 4, g)
    blocks = make_blocks(ids, loss_mask, anchors, valid, cfg.block_size, cfg.mask_token_id, 7.0)
    source = (blocks.positions - 1).clamp(min=0)
    expected = torch.stack([out[b, source[b]] for b in range(2)]).reshape(-1, cfg.hidden_size)
    soft_hidden, weight = seen["soft"]
    assert weight == 0.5 and torch.equal(soft_hidden, expected)
    # the target's output does not reach the drafter: with distill 0 and the narrow features,
    # and with distill 1e-9, the loss is the same
    assert loss(features, 0.0).item() == pytest.approx(loss(wide, 1e-9).item(), rel=1e-5)
    with pytest.raises(ValueError, match="then the target's output"):
        loss(features, 0.5)


def training_inputs(cfg, b=3, s=20, n=3, seed=0):
    loss_mask, _, anchors, valid = random_case(b=b, s=s, n=n, bs=cfg.block_size, seed=seed)
    ids = torch.randint(0, cfg.vocab_size, (b, s))
    blocks = make_blocks(ids, loss_mask, anchors, valid, cfg.block_size, cfg.mask_token_id, 7.0)
    features = torch.randn(b, s, len(cfg.target_layer_ids) * cfg.hidden_size)
    embed = torch.nn.Embedding(cfg.vocab_size, cfg.hidden_size)
    return ids, blocks, features, embed, anchors, valid


def masked_drafter(cfg):
    """A tiny drafter on `training_inputs` under the DFlash mask: (mask_mod, its (batch, queries,
    keys), and the drafter's forward without gradients given an attention)."""
    model = Drafter(cfg).eval()
    ids, blocks, feats, embed, anchors, valid = training_inputs(cfg)
    b, s = ids.shape
    q_len = blocks.ids.shape[1]
    mod = dflash_mask_mod(anchors, valid, s, cfg.block_size)
    pos = torch.arange(s).expand(b, s)
    x = embed(blocks.ids).detach()

    def forward(attend):
        with torch.no_grad():
            return model(x, feats, blocks.positions, pos, attend)

    return mod, (b, q_len, s + q_len), forward


def test_flex_attention_equals_sdpa_forward_on_cpu():
    mod, dims, forward = masked_drafter(tiny_config())
    dense = forward(sdpa_attend(dense_mask(mod, *dims, "cpu")))
    flex = forward(flex_attend(block_mask(mod, *dims, "cpu")))
    assert torch.allclose(dense, flex, atol=1e-5, rtol=1e-5)


def test_compiled_flex_masks_equal_eager_and_a_later_step_wraps_nothing_anew(monkeypatch, request):
    """Training's flex path (compiled mask and attention) gives the eager path's output, and
    after the first step no step calls `torch.compile` again: each call copies the compiler's
    config, a third of the recipe's host time per step when it was called twice a step."""
    from dflash.model import objective

    mod, dims, run = masked_drafter(tiny_config())
    calls = []
    real_compile = torch.compile

    def compile(fn, **kwargs):  # dynamo's tracing without inductor: its CPU code for the mask
        calls.append(fn)  # builder does not build (torch 2.13); the GPU test compiles for real
        return real_compile(fn, **{**kwargs, "backend": "eager"})

    monkeypatch.setattr(torch, "compile", compile)
    objective.compiled_flex.cache_clear()  # and after: later tests compile for real
    request.addfinalizer(objective.compiled_flex.cache_clear)

    def forward(compile):
        mask = block_mask(mod, *dims, "cpu", compile=compile)
        return mask, run(flex_attend(mask, compile))

    eager_mask, eager = forward(False)  # (eager flex_attention wraps itself at every call)
    calls.clear()
    first_mask, first = forward(True)
    wrapped = [fn.__name__ for fn in calls]
    assert wrapped == ["create_block_mask", "flex_attention"]  # once each
    _, second = forward(True)
    assert len(calls) == 2
    assert torch.equal(first_mask.to_dense(), eager_mask.to_dense())
    torch.testing.assert_close(first, eager, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(second, first)


def reference_block(weights, config, ctx_features, block_embeds, anchor):
    """One block, from a saved drafter's raw tensors and config.json alone, written out from the
    published equations: separate context/block projections, explicit softmax, RoPE with the
    queries taking the last B positions. Shares no code with dflash.model."""
    bs, eps = config["block_size"], config["rms_norm_eps"]
    nh, nkv, hd = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    theta = config["rope_parameters"]["rope_theta"]

    def rms(x, name):
        x32 = x.float()
        return weights[name] * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(
            x.dtype
        )

    def lin(x, name):
        return x @ weights[name].t()

    ctx = rms(lin(ctx_features[:, :anchor], "fc.weight"), "hidden_norm.weight")
    positions = torch.arange(anchor + bs, dtype=torch.float32)
    inv_freq = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd)
    angles = torch.cat([positions[:, None] * inv_freq] * 2, dim=-1)
    cos, sin = angles.cos(), angles.sin()

    def rope(t, c, s_):
        half = hd // 2
        return t * c + torch.cat([-t[..., half:], t[..., :half]], -1) * s_

    x = block_embeds
    for i in range(config["num_hidden_layers"]):
        p = f"layers.{i}."
        h = rms(x, p + "input_layernorm.weight")
        q = rms(
            lin(h, p + "self_attn.q_proj.weight").view(1, bs, nh, hd), p + "self_attn.q_norm.weight"
        )
        k = torch.cat(
            [lin(ctx, p + "self_attn.k_proj.weight"), lin(h, p + "self_attn.k_proj.weight")], 1
        )
        v = torch.cat(
            [lin(ctx, p + "self_attn.v_proj.weight"), lin(h, p + "self_attn.v_proj.weight")], 1
        )
        k = rms(k.view(1, -1, nkv, hd), p + "self_attn.k_norm.weight")
        v = v.view(1, -1, nkv, hd)
        q = rope(q.transpose(1, 2), cos[-bs:], sin[-bs:])
        k = rope(k.transpose(1, 2), cos, sin)
        k = k.repeat_interleave(nh // nkv, 1)
        v = v.transpose(1, 2).repeat_interleave(nh // nkv, 1)
        out = ((q @ k.transpose(-1, -2)) / math.sqrt(hd)).softmax(-1) @ v
        x = x + lin(out.transpose(1, 2).reshape(1, bs, nh * hd), p + "self_attn.o_proj.weight")
        h = rms(x, p + "post_attention_layernorm.weight")
        gate = F.silu(lin(h, p + "mlp.gate_proj.weight")) * lin(h, p + "mlp.up_proj.weight")
        x = x + lin(gate, p + "mlp.down_proj.weight")
    return rms(x, "norm.weight")


def test_training_forward_matches_reference_and_kv_cache_inference(tmp_path):
    """A saved drafter, run by an independent reimplementation of the public loader's forward,
    gives the training-mode outputs; so does the KV-cache inference path."""
    cfg = tiny_config()
    model = Drafter(cfg).eval()
    save_drafter(model, tmp_path / "d", dtype=torch.float32)
    weights = load_file(tmp_path / "d" / "model.safetensors")
    config = json.loads((tmp_path / "d" / "config.json").read_text())
    ids, blocks, feats, embed, anchors, valid = training_inputs(cfg, b=1, n=3)
    valid[:] = True
    anchors[0] = torch.tensor([4, 9, 15])
    blocks = make_blocks(
        ids, torch.ones_like(ids), anchors, valid, cfg.block_size, cfg.mask_token_id, 7.0
    )
    s = ids.shape[1]
    q_len = blocks.ids.shape[1]
    mask = dense_mask(
        dflash_mask_mod(anchors, valid, s, cfg.block_size), 1, q_len, s + q_len, "cpu"
    )
    x = embed(blocks.ids).detach()
    with torch.no_grad():
        train = model(x, feats, blocks.positions, torch.arange(s)[None], sdpa_attend(mask))
        for n, a in enumerate(anchors[0].tolist()):
            sl = slice(n * cfg.block_size, (n + 1) * cfg.block_size)
            ref = reference_block(weights, config, feats, x[:, sl], a)
            assert torch.allclose(train[:, sl], ref, atol=1e-5), f"block {n}"
        # Inference: context arrives in two chunks through the KV cache, then the block.
        a = anchors[0, 2].item()
        cache = DrafterCache()
        bs = cfg.block_size
        empty_block = x[:, :0]
        model(
            empty_block,
            feats[:, :6],
            torch.arange(0)[None],
            torch.arange(6)[None],
            full_attend,
            cache,
        )
        sl = slice(2 * bs, 3 * bs)
        infer = model(
            x[:, sl],
            feats[:, 6:a],
            blocks.positions[:, sl],
            torch.arange(6, a)[None],
            full_attend,
            cache,
        )
        assert len(cache) == a
    assert torch.allclose(train[:, sl], infer, atol=1e-5)


def test_save_load_round_trip_and_public_layout(tmp_path):
    cfg = tiny_config()
    model = Drafter(cfg)
    save_drafter(model, tmp_path / "d", dtype=torch.float32)
    loaded = load_drafter(tmp_path / "d")
    for k, v in model.state_dict().items():
        assert torch.equal(v, loaded.state_dict()[k]), k
    keys = set(load_file(tmp_path / "d" / "model.safetensors"))
    expected = {"fc.weight", "hidden_norm.weight", "norm.weight"}
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}."
        expected |= {
            p + f"self_attn.{m}.weight"
            for m in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")
        }
        expected |= {p + f"mlp.{m}.weight" for m in ("gate_proj", "up_proj", "down_proj")}
        expected |= {p + "input_layernorm.weight", p + "post_attention_layernorm.weight"}
    assert keys == expected  # no embedding, no LM head, no rotary buffers
    config = json.loads((tmp_path / "d" / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"]
    assert config["auto_map"] == {"AutoModel": "dflash.DFlashDraftModel"}
    assert (tmp_path / "d" / "dflash.py").read_text().startswith('"""The DFlash drafter')
    assert config["block_size"] == 4 and config["num_target_layers"] == 8
    assert config["dflash_config"] == {"mask_token_id": 3, "target_layer_ids": [1, 3, 5]}
    # the rest of what vLLM 0.24.0's DFlash loader reads (docs/serving.md names the files)
    vllm = {"hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"}
    vllm |= {"num_key_value_heads", "head_dim", "rms_norm_eps", "rope_parameters", "hidden_act"}
    vllm |= {"max_position_embeddings", "vocab_size"}
    assert vllm <= config.keys(), vllm - config.keys()
    from transformers import Qwen3Config

    hf = Qwen3Config(
        **{k: v for k, v in config.items() if k not in ("architectures", "model_type")}
    )
    assert hf.num_hidden_layers == 2 and hf.head_dim == 8


def test_automodel_with_remote_code_builds_the_drafter_and_drafts_what_it_does(tmp_path):
    """The exported directory carries its modeling file (auto_map): transformers' usual loader
    gives the DFlash class, not a plain Qwen3 model, and its block forward equals ours."""
    from transformers import AutoModel

    cfg = tiny_config()
    model = Drafter(cfg).eval()
    for p in model.parameters():  # nonzero everywhere, so a dropped weight would show
        p.data.normal_(0, 0.3)
    save_drafter(model, tmp_path / "d", dtype=torch.float32)
    hf = AutoModel.from_pretrained(tmp_path / "d", trust_remote_code=True).eval()
    assert type(hf).__name__ == "DFlashDraftModel"
    assert hf.target_layer_ids == [1, 3, 5] and hf.mask_token_id == 3 and hf.block_size == 4
    s, q = 7, cfg.block_size
    feats = torch.randn(2, s, 3 * cfg.hidden_size)
    block = torch.randn(2, q, cfg.hidden_size)
    positions = torch.arange(s + q)[None].expand(2, -1)
    with torch.no_grad():
        ours = model(block, feats, positions[:, s:], positions[:, :s], full_attend)
        theirs = hf(noise_embedding=block, target_hidden=feats, position_ids=positions)
    assert torch.allclose(ours, theirs, atol=1e-5), (ours - theirs).abs().max()


@pytest.mark.parametrize(
    ("max_new", "stop"), [(30, set()), (7, set()), (30, {17, 40})], ids=["free", "cap", "stop"]
)
def test_spec_generate_of_the_export_commits_what_our_evaluation_commits(
    tmp_path, small_decoder, max_new, stop
):
    """The exported class's `spec_generate` (the reference class's method, written by us) is
    our evaluation's loop: same tokens, same tokens per round, under a cap and at stop tokens.
    tests/test_reference_client.py checks it on a trained drafter and against the reference."""
    from transformers import AutoModel, LlamaConfig, LlamaForCausalLM

    from dflash.eval.decode import DrafterProposer, generate
    from dflash.eval.sessions import HFSession

    torch.manual_seed(0)
    target = LlamaForCausalLM(LlamaConfig(**small_decoder)).eval()
    model = Drafter(DrafterConfig.for_target(target.config, 1, 4, 63)).eval()
    for p in model.parameters():
        p.data.normal_(0, 0.3)
    save_drafter(model, tmp_path / "d", dtype=torch.float32)
    hf = AutoModel.from_pretrained(tmp_path / "d", trust_remote_code=True).eval()
    embed, head = target.get_input_embeddings(), target.lm_head.weight
    for prompt in ([1, 5, 9, 13, 2, 7, 30, 31], [3, 4, 5, 6, 7, 8, 9, 10, 3, 4, 5, 6]):
        ours = generate(
            HFSession(target, model.config.target_layer_ids),
            DrafterProposer(model, embed, head),
            prompt,
            max_new,
            stop,
        )
        out = hf.spec_generate(target, torch.tensor([prompt]), max_new, sorted(stop))
        assert out[0].tolist() == prompt + ours.tokens
        assert hf.acceptance_lengths == ours.accepted


def test_default_layer_ids():
    assert default_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert default_layer_ids(30, 5) == [1, 8, 14, 20, 27]
    assert default_layer_ids(30, 1) == [15]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_flex_attention_equals_sdpa_forward_and_backward_on_gpu():
    cfg = tiny_config(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, block_size=16
    )
    model = Drafter(cfg).cuda()
    ids, blocks, feats, embed, anchors, valid = training_inputs(cfg, b=2, s=200, n=8)
    b, s = ids.shape
    q_len = blocks.ids.shape[1]
    mod = dflash_mask_mod(anchors.cuda(), valid.cuda(), s, cfg.block_size)
    x, feats = embed(blocks.ids).detach().cuda(), feats.cuda()
    pos = torch.arange(s, device="cuda").expand(b, s)
    out = {}
    for name, attend in [
        ("sdpa", sdpa_attend(dense_mask(mod, b, q_len, s + q_len, "cuda"))),
        (
            "flex",
            flex_attend(block_mask(mod, b, q_len, s + q_len, "cuda", compile=True), compiled=True),
        ),
    ]:
        model.zero_grad()
        h = model(x, feats, blocks.positions.cuda(), pos, attend)
        h.pow(2).mean().backward()
        out[name] = (h.detach(), torch.cat([p.grad.flatten() for p in model.parameters()]))
    assert torch.allclose(out["flex"][0], out["sdpa"][0], atol=1e-4, rtol=1e-4)
    assert torch.allclose(out["flex"][1], out["sdpa"][1], atol=1e-4, rtol=1e-3)


@pytest.fixture
def graphs_only(monkeypatch):
    """torch.compile through dynamo and AOTAutograd without inductor's code generation, for the
    tests that count dynamo's graphs (the count does not depend on the backend; a cold inductor
    cache made those two tests 80 s of C++ compiles on a 2-core CPU)."""
    compile = torch.compile
    monkeypatch.setattr(
        torch, "compile", lambda fn, **kwargs: compile(fn, **kwargs | {"backend": "aot_eager"})
    )


@pytest.mark.slow
def test_compiled_step_does_not_recompile_for_a_different_anchor_count(graphs_only):
    from torch._dynamo.utils import counters

    from dflash.model.step import TrainStep

    torch._dynamo.reset()
    counters.clear()
    cfg = tiny_config()
    drafter = Drafter(cfg)
    embed = torch.nn.Embedding(cfg.vocab_size, cfg.hidden_size).requires_grad_(False)
    step = TrainStep(
        drafter, embed, embed.weight, max_anchors=4, gamma=None, attention="sdpa", compile=True
    )
    ids = torch.randint(0, cfg.vocab_size, (2, 24))
    feats = torch.randn(2, 24, 3 * cfg.hidden_size)
    many = torch.ones_like(ids)
    one = torch.zeros_like(ids)
    one[:, 5:7] = 1  # exactly one eligible anchor per sample
    step(feats, ids, many, torch.Generator().manual_seed(0))
    graphs = counters["stats"]["unique_graphs"]
    assert graphs > 0
    for loss_mask in (one, many, torch.zeros_like(ids)):
        step(feats, ids, loss_mask, torch.Generator().manual_seed(1))
    assert counters["stats"]["unique_graphs"] == graphs


@pytest.mark.slow
def test_compiled_layers_trace_one_layer_and_match_the_eager_step():
    """compile.scope layers (the default): dynamo traces two layers however deep the drafter
    (the first, whose input needs no gradient, and one graph every later layer shares), while
    the whole-drafter graph grows with depth; the step's loss and gradients are the eager
    step's."""
    from torch._dynamo.utils import counters

    from dflash.model.step import TrainStep

    ids = torch.randint(0, 50, (2, 24), generator=torch.Generator().manual_seed(0))
    feats = torch.randn(2, 24, 3 * 32, generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    captured, grads = {}, {}
    for scope, layers, compile in [
        ("layers", 2, True),
        ("layers", 3, True),
        ("model", 1, True),
        ("model", 3, True),
        ("eager", 3, False),
    ]:
        torch._dynamo.reset()
        counters.clear()
        torch.manual_seed(0)
        drafter = Drafter(tiny_config(num_hidden_layers=layers))
        embed = torch.nn.Embedding(50, 32).requires_grad_(False)
        step = TrainStep(
            drafter, embed, embed.weight, max_anchors=4, gamma=None, attention="sdpa",
            compile=compile, compile_scope=scope,
        )  # fmt: skip
        metrics = step(feats, ids, mask, torch.Generator().manual_seed(2))
        captured[scope, layers] = counters["stats"]["calls_captured"]
        grads[scope, layers] = (metrics["loss"], [p.grad.clone() for p in drafter.parameters()])
    assert captured["layers", 3] == captured["layers", 2] > 0
    assert captured["model", 3] > captured["model", 1]
    loss, eager = grads["eager", 3]
    for scope in ("layers", "model"):
        got_loss, got = grads[scope, 3]
        assert got_loss == pytest.approx(loss, rel=1e-5)
        for a, b in zip(got, eager, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("scope", ["layers", "model"])
def test_compile_mode_reaches_torch_compile_and_each_step_is_marked(monkeypatch, scope):
    """compile.mode reduce-overhead (CUDA graphs) is torch.compile's mode for the drafter under
    either scope, and every step then tells the graphs where it begins (the outputs of the step
    before may be overwritten); under `default` no step is marked."""
    from dflash.model.step import TrainStep

    modes, marks = [], []
    monkeypatch.setattr(torch, "compile", lambda fn, **k: modes.append(k.get("mode")) or fn)
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: marks.append(1))
    drafter = Drafter(tiny_config(num_hidden_layers=2))
    embed = torch.nn.Embedding(50, 32).requires_grad_(False)
    ids = torch.randint(0, 50, (2, 24), generator=torch.Generator().manual_seed(0))
    feats = torch.randn(2, 24, 3 * 32, generator=torch.Generator().manual_seed(1))
    for mode, steps_marked in (("default", 0), ("reduce-overhead", 2)):
        step = TrainStep(
            drafter, embed, embed.weight, max_anchors=4, gamma=None, attention="sdpa",
            compile=True, compile_scope=scope, compile_mode=mode,
        )  # fmt: skip
        assert modes.pop() == mode
        marks.clear()
        for seed in range(2):
            step(feats, ids, torch.ones_like(ids), torch.Generator().manual_seed(seed))
        assert len(marks) == steps_marked


def test_the_warmup_compiles_the_configs_compile_mode(monkeypatch):
    """The warmup builds the step with compile.mode, as training does (a graph of another mode
    would be another graph)."""
    from dflash.config import validate
    from dflash.model import step
    from dflash.train.warmup import warm_shapes

    class Built(Exception):
        pass

    def record(*args, **kwargs):
        raise Built(kwargs)

    monkeypatch.setattr(step, "TrainStep", record)
    config = validate({"compile": {"enabled": True, "mode": "reduce-overhead"}})
    config["compile"]["device"] = "cpu"
    with pytest.raises(Built) as built:
        warm_shapes(REPO / "config" / "models" / "smollm2-135m", config, [(1, 16)])
    assert built.value.args[0]["compile_mode"] == "reduce-overhead"


def test_cuda_graphs_with_gradient_accumulation_are_refused_naming_both_keys():
    from dflash.config import ConfigError, check_levers, validate

    graphs = {"compile": {"mode": "reduce-overhead"}, "train": {"grad_accum": 2}}
    with pytest.raises(
        ConfigError, match=r"compile.mode: reduce-overhead .* train.grad_accum \(2\)"
    ):
        check_levers(validate(graphs))
    check_levers(validate(graphs | {"train": {"grad_accum": 1}}))
    check_levers(validate(graphs | {"compile": {"mode": "default"}}))


@pytest.mark.slow
def test_compiled_layers_compile_every_bucket_shape(graphs_only):
    """Each shape is two entries of the layers' compiled function: past torch's default limit
    of 8 (a fifth shape) dynamo would run the layers eagerly, with only a log line."""
    from torch._dynamo.utils import counters

    from dflash.model.step import TrainStep, run_shapes

    torch._dynamo.reset()
    counters.clear()
    cfg = tiny_config(num_hidden_layers=3)
    drafter = Drafter(cfg)
    embed = torch.nn.Embedding(cfg.vocab_size, cfg.hidden_size).requires_grad_(False)
    step = TrainStep(
        drafter, embed, embed.weight, max_anchors=2, gamma=None, attention="sdpa", compile=True
    )
    shapes = [(1, 8 * (i + 1)) for i in range(5)]  # 10 entries: past the limit of 8
    run_shapes(step, shapes, 3 * cfg.hidden_size, cfg.vocab_size, torch.float32)
    assert counters["stats"]["unique_graphs"] == 2 * len(shapes)


def test_target_top_init_copies_the_targets_top_layers_and_output_norm(target_dir):
    """drafter.init: target_top starts drafter layer i as target layer L-n+i (SmolLM2 is Llama:
    no q/k norms, so those keep their ones) and the output norm as the target's final norm."""
    from safetensors import safe_open
    from transformers import AutoConfig

    from dflash.model.start import init_from_target_top

    cfg = DrafterConfig.for_target(AutoConfig.from_pretrained(target_dir), 2, 4, mask_token_id=3)
    model = Drafter(cfg)
    fc_before = model.fc.weight.clone()
    copied = init_from_target_top(model, target_dir)
    top = cfg.num_target_layers - 2
    with safe_open(target_dir / "model.safetensors", "pt") as f:
        for i in range(2):
            for name in (
                "self_attn.q_proj.weight",
                "mlp.down_proj.weight",
                "input_layernorm.weight",
            ):
                mine = model.state_dict()[f"layers.{i}.{name}"]
                assert torch.equal(mine, f.get_tensor(f"model.layers.{top + i}.{name}").float())
        assert torch.equal(model.norm.weight, f.get_tensor("model.norm.weight").float())
    assert len(copied) == 1 + 2 * 9  # per layer: 4 projections, 3 MLP, 2 norms
    assert torch.equal(model.layers[0].self_attn.q_norm.weight, torch.ones(cfg.head_dim))
    assert torch.equal(model.fc.weight, fc_before)  # reads target features: stays random


def test_block_metrics_stay_on_the_device_and_equal_the_indexed_definition():
    """The step's metrics are tensors (no host sync inside a training step) and equal what a
    verifier accepts: per real block, the slots before the first miss."""
    g = torch.Generator().manual_seed(3)
    b, n, bs = 3, 5, 8
    correct = torch.rand(b * n * bs, generator=g) < 0.8
    weights = (torch.rand(b, n, bs, generator=g) < 0.9).float()
    valid = torch.rand(b, n, generator=g) < 0.7
    blocks = Blocks(
        anchors=torch.zeros(b, n, dtype=torch.long),
        valid=valid,
        ids=torch.zeros(b, n * bs, dtype=torch.long),
        positions=torch.zeros(b, n * bs, dtype=torch.long),
        labels=torch.zeros(b, n, bs, dtype=torch.long),
        weights=weights,
    )
    m = block_metrics(correct, blocks)
    assert all(isinstance(v, torch.Tensor) for v in m.values())
    ok = (correct.view(b, n, bs)[:, :, 1:] & (weights[:, :, 1:] > 0))[valid].float()
    assert float(m["tau"]) == 1.0 + ok.cumprod(dim=1).sum(dim=1).mean().item()
    assert m["acc"].tolist() == ok.mean(0).tolist()
    assert host_metrics({**m, "loss": torch.tensor(float("inf"))})["blocks"] == int(valid.sum())
    assert math.isnan(host_metrics({**m, "loss": torch.tensor(float("inf"))})["loss"])
    none = block_metrics(correct, Blocks(**{**blocks.__dict__, "valid": torch.zeros_like(valid)}))
    assert math.isnan(float(none["tau"])) and all(math.isnan(a) for a in none["acc"].tolist())


def test_an_exported_drafter_that_differs_from_the_run_is_refused_naming_each_key(tmp_path):
    """drafter.init: <folder> must equal the run's drafter: each differing key is named with both
    values and where the run sets it; the keys that agree are not named."""
    from dflash.errors import UserError
    from dflash.model import start

    assert start.WEIGHTS == WEIGHTS
    run = tiny_config()
    save_drafter(Drafter(run), tmp_path / "same")
    start.check_fits(tmp_path / "same", run)  # fits: no error
    other = tiny_config(block_size=8, target_layer_ids=[1, 5], hidden_size=48, mask_token_id=4)
    save_drafter(Drafter(other), tmp_path / "other")
    with pytest.raises(UserError) as refused:
        start.check_fits(tmp_path / "other", run)
    message = str(refused.value)
    assert message.startswith(f"drafter.init: {tmp_path / 'other'} does not fit this run: ")
    assert "block_size: init 8, run 4 (drafter.block_size)" in message
    assert "target_layer_ids: init [1, 5], run [1, 3, 5] (drafter.target_layer_ids)" in message
    assert "mask_token_id: init 4, run 3 (target.mask_token_id)" in message
    assert "hidden_size: init 48, run 32 (the target)" in message
    assert message.count(" run ") == 4  # heads, layers, vocabulary ... agree: not named
    (tmp_path / "same" / "config.json").write_text('{"model_type": "qwen3"}')
    with pytest.raises(UserError, match="config.json is no DFlash drafter config"):
        start.check_fits(tmp_path / "same", run)
    (tmp_path / "other" / WEIGHTS).unlink()
    with pytest.raises(UserError, match="is not an exported drafter: it has no model.safetensors"):
        start.check_fits(tmp_path / "other", run)
    with pytest.raises(UserError, match="no such directory"):
        start.check_fits(tmp_path / "missing", run)


def test_an_exported_drafter_loads_into_the_run_in_fp32_weight_for_weight(tmp_path):
    from dflash.model.start import initialise

    saved = Drafter(tiny_config())
    save_drafter(saved, tmp_path / "d")  # bf16, as the train rule exports it
    model = Drafter(tiny_config())
    assert (
        initialise(model, str(tmp_path / "d"), tmp_path)
        == f"drafter.init: weights of {tmp_path / 'd'}"
    )
    exported = load_file(tmp_path / "d" / WEIGHTS)
    for k, v in model.state_dict().items():
        assert v.dtype == torch.float32 and torch.equal(v, exported[k].float()), k


def test_the_training_step_draws_its_anchors_with_the_configured_copy_weight(monkeypatch):
    """drafter.copy_anchor_weight reaches the anchor draw of every training step."""
    from dflash.model import objective
    from dflash.model.step import TrainStep

    cfg = tiny_config()
    ids, _, features, embed, _, _ = training_inputs(cfg, b=2, s=24)
    head = torch.randn(cfg.vocab_size, cfg.hidden_size)
    seen = []

    def spy(loss_mask, max_anchors, generator, input_ids=None, copy_weight=1.0):
        seen.append((input_ids is ids, copy_weight))
        return sample_anchors(loss_mask, max_anchors, generator, input_ids, copy_weight)

    monkeypatch.setattr(objective, "sample_anchors", spy)
    step = TrainStep(
        Drafter(cfg), embed, head, max_anchors=4, gamma=None, attention="sdpa", compile=False,
        copy_weight=3.0,
    )  # fmt: skip
    loss, _ = step.loss(features, ids, torch.ones_like(ids), torch.Generator().manual_seed(0))
    assert torch.isfinite(loss) and seen == [(True, 3.0)]
