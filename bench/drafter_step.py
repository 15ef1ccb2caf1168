"""Drafter step on a GPU: flex_attention vs SDPA correctness (fwd + bwd), then step time, MFU and
peak memory at Qwen3-8B drafter shapes (random init), chunked vs full-logits CE.

    python bench/drafter_step.py [--anchors 512] [--seq 2048] [--out results.json]
    python bench/drafter_step.py --shape recipe --batch 8 --anchors 96 --no-correctness \
        --configs flex:chunked:compiled   # the recipe's drafter (the training step's own path,
                                          # compile.mode included: bench/step_modes.py)

FLOPs are useful work only: context K/V projections, block tokens through all layers, attention
over the keys each query may see, the frozen LM head on block tokens; backward = 2x forward for
trained parts, 1x for the LM head (input gradient only, no weight gradient).
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

from dflash.model.drafter import Drafter, DrafterConfig
from dflash.model.lm_loss import chunked_lm_loss
from dflash.model.objective import (
    block_mask,
    dense_mask,
    dflash_mask_mod,
    flex_attend,
    make_blocks,
    sample_anchors,
    sdpa_attend,
)

PEAK_BF16 = 989e12  # H200 / H100 SXM dense bf16


def qwen3_8b_drafter(layers=5, block=16):
    return DrafterConfig(
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=layers,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
        block_size=block,
        num_target_layers=36,
        target_layer_ids=[1, 9, 17, 25, 33],
        mask_token_id=151669,
        rms_norm_eps=1e-6,
        rope_theta=1e6,
        max_position_embeddings=40960,
    )


def recipe_drafter(layers=5, block=16):
    """config/h200.yaml's drafter over SmolLM2-135M: the small shapes whose step waits on the host
    (issue 58)."""
    return DrafterConfig(
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=layers,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        vocab_size=49152,
        block_size=block,
        num_target_layers=30,
        target_layer_ids=[1, 8, 15, 22, 28],
        mask_token_id=3,
        rms_norm_eps=1e-5,
        rope_theta=1e5,
        max_position_embeddings=8192,
    )


SHAPES = {"8b": qwen3_8b_drafter, "recipe": recipe_drafter}


def inputs(cfg, b, s, anchors, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (b, s), generator=g).to(device)
    loss_mask = torch.ones(b, s, dtype=torch.long, device=device)
    loss_mask[:, : s // 8] = 0  # a prompt
    a, v = sample_anchors(loss_mask, anchors, g)
    blocks = make_blocks(ids, loss_mask, a, v, cfg.block_size, cfg.mask_token_id, 7.0)
    feats = torch.randn(b, s, len(cfg.target_layer_ids) * cfg.hidden_size, generator=g)
    return ids, loss_mask, a, v, blocks, feats.to(device)


def attend_for(backend, mod, b, q, kv, device):
    if backend == "flex":
        return flex_attend(block_mask(mod, b, q, kv, device, compile=True), compiled=True)
    return sdpa_attend(dense_mask(mod, b, q, kv, device))


def correctness(device):
    """Compiled flex_attention vs SDPA+dense mask: outputs and gradients on a small config."""
    cfg = DrafterConfig(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=32,
        vocab_size=1000,
        block_size=16,
        num_target_layers=12,
        target_layer_ids=[1, 5, 9],
        mask_token_id=3,
        rope_theta=1e6,
        max_position_embeddings=4096,
    )
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        torch.manual_seed(0)
        model = Drafter(cfg).to(device, dtype)
        b, s = 2, 300
        ids, lm, a, v, blocks, feats = inputs(cfg, b, s, 24, device)
        feats = feats.to(dtype)
        embed = torch.randn(cfg.vocab_size, cfg.hidden_size, device=device, dtype=dtype)
        x = embed[blocks.ids]
        q, kv = blocks.ids.shape[1], s + blocks.ids.shape[1]
        mod = dflash_mask_mod(a, v, s, cfg.block_size)
        pos = torch.arange(s, device=device).expand(b, s)
        results = {}
        for backend in ("sdpa", "flex"):
            model.zero_grad()
            h = model(x, feats, blocks.positions, pos, attend_for(backend, mod, b, q, kv, device))
            (h.float().pow(2).mean()).backward()
            grads = torch.cat([p.grad.float().flatten() for p in model.parameters()])
            results[backend] = (h.float(), grads)
        rel = lambda a, b: ((a - b).norm() / b.norm()).item()  # noqa: E731
        out[str(dtype)] = {
            "hidden_rel_err": rel(results["flex"][0], results["sdpa"][0]),
            "grad_rel_err": rel(results["flex"][1], results["sdpa"][1]),
        }
    return out


def useful_flops(cfg, s, n_blocks_valid, anchors_mean):
    h, i, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    kvd = cfg.num_key_value_heads * cfg.head_dim
    t = n_blocks_valid * cfg.block_size
    per_layer = (
        2 * t * h * h * 2  # q, o
        + 2 * (s + t) * h * kvd * 2  # k, v over context + block
        + 2 * t * h * i * 3  # mlp
        + 4 * t * (anchors_mean + cfg.block_size) * cfg.head_dim * cfg.num_attention_heads
    )
    trained = cfg.num_hidden_layers * per_layer + 2 * s * len(cfg.target_layer_ids) * h * h
    head = 2 * t * h * v
    return 3 * trained + 2 * head


def step_bench(device, backend, ce, anchors, s, steps=5, compile_model=False, shape="8b", b=1):
    # (a whole-drafter `reduce-overhead` here failed on 2026-12-07: a CUDA graph's output saved
    # for backward was overwritten; bench/step_modes.py times compile.mode on training's path)
    cfg = SHAPES[shape]()
    torch.manual_seed(0)
    model = Drafter(cfg).to(device, torch.bfloat16)
    head = torch.randn(cfg.vocab_size, cfg.hidden_size, device=device, dtype=torch.bfloat16) * 0.02
    ids, lm, a, v, blocks, feats = inputs(cfg, b, s, anchors, device)
    feats = feats.to(torch.bfloat16)
    x = head[blocks.ids]
    q, kv = blocks.ids.shape[1], s + blocks.ids.shape[1]
    pos = torch.arange(s, device=device)[None].expand(b, s)
    fwd = model
    if compile_model:
        fwd = torch.compile(model)
    labels, weights = blocks.labels.view(-1), blocks.weights.view(-1)

    def step():
        mod = dflash_mask_mod(a, v, s, cfg.block_size)
        attend = attend_for(backend, mod, b, q, kv, device)
        hid = fwd(x, feats, blocks.positions, pos, attend).view(-1, cfg.hidden_size)
        if ce == "chunked":
            total, _ = chunked_lm_loss(hid, head, labels, weights, chunk_tokens=2048)
        else:
            logits = (hid @ head.t()).float()
            total = (F.cross_entropy(logits, labels, reduction="none") * weights).sum()
        (total / weights.sum()).backward()

    t0 = time.perf_counter()
    step()
    torch.cuda.synchronize()
    first = time.perf_counter() - t0
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    walls = []
    for _ in range(steps):
        w0 = time.perf_counter()
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        walls.append(time.perf_counter() - w0)
        times.append(start.elapsed_time(end) / 1e3)
    t = sorted(times)[len(times) // 2]
    anchors_mean = a[v].float().mean().item()
    flops = useful_flops(cfg, s, int(v.sum()), anchors_mean)
    return {
        "backend": backend,
        "ce": ce,
        "compiled_model": compile_model,
        "shape": shape,
        "batch": b,
        "wall_s": round(sorted(walls)[len(walls) // 2], 4),  # host included: launch-bound shows
        "anchors": anchors,
        "seq": s,
        "step_s": round(t, 4),
        "first_step_s": round(first, 1),
        "tflops": round(flops / t / 1e12, 1),
        "mfu": round(flops / t / PEAK_BF16, 4),
        "peak_gb": round(torch.cuda.max_memory_allocated() / 1e9, 2),
        "block_tokens_per_s": round(int(v.sum()) * cfg.block_size / t),
    }


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--anchors", type=int, default=512)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--out", default="drafter_step.json")
    p.add_argument("--configs", default="flex:chunked,sdpa:chunked,flex:full,flex:chunked:compiled")
    p.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--no-correctness", action="store_true")
    args = p.parse_args()
    device = torch.device("cuda")
    report = {
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(),
        "correctness": None if args.no_correctness else correctness(device),
        "steps": [],
    }
    print(json.dumps(report["correctness"], indent=1), flush=True)
    for spec in args.configs.split(","):
        backend, ce, *rest = spec.split(":")
        try:
            compile_model = bool(rest)  # flex:chunked:compiled
            r = step_bench(device, backend, ce, args.anchors, args.seq, args.steps, compile_model,
                           args.shape, args.batch)  # fmt: skip
        except torch.OutOfMemoryError as e:
            r = {"backend": backend, "ce": ce, "error": f"OOM: {str(e)[:120]}"}
        torch.cuda.empty_cache()
        report["steps"].append(r)
        print(json.dumps(r), flush=True)
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    print(
        f"{'backend':8} {'ce':8} {'comp':5} {'step s':>8} {'TFLOP/s':>8} {'MFU':>6} {'peak GB':>8}"
    )
    for r in report["steps"]:
        if "error" in r:
            print(r)
            continue
        print(
            f"{r['backend']:8} {r['ce']:8} {str(r['compiled_model']):5} {r['step_s']:8.4f} "
            f"wall {r['wall_s']:8.4f} "
            f"{r['tflops']:8.1f} {r['mfu']:6.3f} {r['peak_gb']:8.2f}"
        )


if __name__ == "__main__":
    main()
