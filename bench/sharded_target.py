"""A target sharded across N GPUs (train.topology.target_shards, dflash/train/shard.py) against
the whole target on one: do the features agree, and what does sharding cost per GPU? (issue 37)

    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1   # NVLink multicast stays off
    torchrun --standalone --nproc-per-node N bench/sharded_target.py [--out results.json]
    torchrun --standalone --nproc-per-node 2 bench/sharded_target.py --tiny   # CPU, gloo

With random weights of real shapes (config/models/qwen3-8b by default, made on the machine from
one seed; `--save DIR` writes them and loads the shards back as training does, each rank reading
only its slices), truncated to the deepest layer a 5-layer drafter reads (34 of 36 layers):

1. agreement: the sharded features (replicated on every rank) against the whole target's on
   rank 0, in fp32 and bf16 (`--dtypes`), as max abs and max relative difference;
2. features throughput in bf16 (eager; `--compile` adds the compiled layer): tokens/s of the
   sharded group and per GPU, against the whole target on one GPU, and their ratio;
3. the communication alone: the forward's 2 all-reduces per layer of the hidden states
   (tokens x hidden, bf16), timed without the compute, and the bytes each moves; with
   `--profile`, the NCCL kernels' time inside one sharded forward (CUDA only);
4. peak memory per rank.

`--save` applies to bf16, the dtype training loads. The sharded copy is made layer by layer, so
a rank holds the whole target once (a Qwen3-32B-shaped one, 62 GB in bf16, fits an H200 with
its 31 GB shard beside it; fp32 would not: `--dtypes bfloat16`).

Rank 0 prints one JSON document and writes it to `--out`. NVLink multicast (NVLS) must stay off
on the lent machines (KINDS.md): this script sets NCCL_NVLS_ENABLE=0 and
TORCH_SYMM_MEM_DISABLE_MULTICAST=1 unless they are set already.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import time
from pathlib import Path

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # before NCCL starts
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from dflash.model.target import TargetFeatures, default_layer_ids  # noqa: E402
from dflash.train.shard import check_shardable, load_sharded, shard_layers  # noqa: E402

HERE = Path(__file__).resolve().parent
TINY = dict(  # seconds on a CPU: the script's logic, not its numbers
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=8,
    num_attention_heads=4,
    num_key_value_heads=4,
    head_dim=16,
    vocab_size=256,
)


def setup():
    cuda = torch.cuda.is_available()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None)
    from torch.distributed.device_mesh import init_device_mesh

    return device, init_device_mesh(device.type, (dist.get_world_size(),))


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device, warm: int, reps: int) -> float:
    """Seconds per call, every rank in step (a barrier before each measurement)."""
    for _ in range(warm):
        fn()
    sync(device)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    sync(device)
    return (time.perf_counter() - t0) / reps


def build(config, dtype, device, layer_ids, save: Path | None):
    """The whole target's features (random weights from seed 0, the same on every rank); rank 0
    writes the model, truncated to the layers run, to `save`."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    features = TargetFeatures(model.eval(), layer_ids)
    if save is not None and dist.get_rank() == 0:
        model.save_pretrained(save)
    features.lm_head = None  # never applied to features
    return features


def sharded_copy(whole: TargetFeatures, mesh) -> TargetFeatures:
    """A copy of `whole` with its layers sharded (rank 0's weights, scattered), copied one layer
    at a time so that the rank never holds two whole targets."""
    layers = whole.decoder.layers
    whole.decoder.layers = torch.nn.ModuleList()
    try:
        sharded = copy.deepcopy(whole)  # embedding, norms, rotary: replicated
    finally:
        whole.decoder.layers = layers
    copies = torch.nn.ModuleList()
    for layer in layers:
        copies.append(copy.deepcopy(layer))
        shard_layers(copies[-1:], mesh)
    sharded.decoder.layers = copies
    return sharded


def diff(a: torch.Tensor, b: torch.Tensor) -> dict:
    d = (a.float() - b.float()).abs().max().item()
    return {"max_abs": d, "max_rel": d / max(b.float().abs().max().item(), 1e-30)}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--config", default=str(HERE.parent / "config/models/qwen3-8b"), help="target config dir"
    )
    p.add_argument("--tiny", action="store_true", help="tiny shapes (CPU): checks the logic")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--length", type=int, default=2048)
    p.add_argument("--drafter-layers", type=int, default=5, help="sets the layers read")
    p.add_argument("--compile", action="store_true", help="also time the compiled layer")
    p.add_argument("--save", type=Path, help="write the random target here, load shards back")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument(
        "--dtypes", default="float32,bfloat16", help="agreement in these (bf16 is timed)"
    )
    p.add_argument("--profile", action="store_true", help="NCCL kernel time in a forward (CUDA)")
    p.add_argument("--out", type=Path)
    args = p.parse_args()

    from transformers import AutoConfig

    device, mesh = setup()
    rank, world = dist.get_rank(), dist.get_world_size()
    config = AutoConfig.from_pretrained(args.config)
    if args.tiny:
        config = AutoConfig.for_model(config.model_type, **TINY)
        args.batch, args.length = 2, 64
    check_shardable(config, world)
    layer_ids = default_layer_ids(config.num_hidden_layers, args.drafter_layers)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, config.vocab_size, (args.batch, args.length), generator=g).to(device)
    tokens = ids.numel()
    result = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "world": world,
        "config": args.config if not args.tiny else "tiny",
        "batch": [args.batch, args.length],
        "layers_run": max(layer_ids) + 1,
        "layer_ids": layer_ids,
        "torch": torch.__version__,
    }
    warm, reps = (2, args.reps) if device.type == "cuda" else (1, 1)
    for dtype in (getattr(torch, d) for d in args.dtypes.split(",")):
        name = str(dtype).removeprefix("torch.")
        save = args.save / name if args.save is not None and dtype == torch.bfloat16 else None
        whole = build(config, dtype, device, layer_ids, save)
        if save is not None:
            dist.barrier()
            t0 = time.perf_counter()
            sharded = load_sharded(save, mesh, layer_ids, device, dtype)
            result[f"load_s_{name}"] = round(time.perf_counter() - t0, 2)
        else:
            sharded = sharded_copy(whole, mesh)
        reset_peak(device)
        got = sharded(ids)
        row = {"peak_gb_sharded": peak_gb(device)}
        if rank == 0:
            row |= diff(got, whole(ids))
        if dtype == torch.bfloat16:
            row |= throughput(whole, sharded, ids, device, warm, reps, tokens, world, args)
            row["allreduce"] = allreduce_cost(config, layer_ids, tokens, dtype, device, reps)
        result[name] = row
        del whole, sharded
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if rank == 0:
        print(json.dumps(result, indent=1))
        if args.out:
            args.out.write_text(json.dumps(result, indent=1) + "\n")
    dist.destroy_process_group()


def throughput(whole, sharded, ids, device, warm, reps, tokens, world, args) -> dict:
    out = {}
    for mode in ("eager", "compiled") if args.compile else ("eager",):
        if mode == "compiled":
            whole.compile_layers()
            sharded.compile_layers()
        t_sharded = timed(lambda: sharded(ids), device, warm, reps)
        # the whole target on one GPU: every rank runs its own copy at once, as colocated
        # training would (no communication)
        t_whole = timed(lambda: whole(ids), device, warm, reps)
        per_gpu = tokens / t_sharded / world
        out[mode] = nccl_share(lambda: sharded(ids), device) if args.profile else {}
        out[mode] |= {
            "sharded_s": round(t_sharded, 4),
            "sharded_tokens_per_s": round(tokens / t_sharded),
            "sharded_tokens_per_s_per_gpu": round(per_gpu),
            "whole_s": round(t_whole, 4),
            "whole_tokens_per_s_per_gpu": round(tokens / t_whole),
            "per_gpu_ratio": round(per_gpu / (tokens / t_whole), 3),
        }
    return out


def nccl_share(fn, device) -> dict:
    """The kernels' time on this rank's GPU in one call of `fn`, and the NCCL kernels' part of it
    (an all-reduce kernel also counts the time it waits for the slower rank)."""
    if device.type != "cuda":
        return {}
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    sync(device)
    dist.barrier()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        sync(device)
    try:
        kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    except Exception as e:  # a profiler's failure must not cost the run its other numbers
        return {"profile_error": repr(e)}
    total = sum(e.time_range.elapsed_us() for e in kernels) / 1e6
    nccl = sum(e.time_range.elapsed_us() for e in kernels if "nccl" in e.name.lower()) / 1e6
    return {
        "kernel_s": round(total, 4),
        "nccl_kernel_s": round(nccl, 4),
        "nccl_kernels": sum("nccl" in e.name.lower() for e in kernels),
    }


def allreduce_cost(config, layer_ids, tokens, dtype, device, reps) -> dict:
    """The forward's communication alone: 2 all-reduces of (tokens, hidden) per layer run."""
    n = 2 * (max(layer_ids) + 1)
    x = torch.ones(tokens, config.hidden_size, dtype=dtype, device=device)

    def run():
        for _ in range(n):
            dist.all_reduce(x)

    t = timed(run, device, 1, max(1, reps // 2))
    size = x.numel() * x.element_size()
    return {
        "count": n,
        "bytes_each": size,
        "s_per_forward": round(t, 4),
        # what NCCL's tests call bus bandwidth: 2 (N-1)/N of the buffer crosses each link
        "bus_gb_per_s": round(2 * (dist.get_world_size() - 1) / dist.get_world_size() * size * n
                              / t / 1e9, 1),
    }  # fmt: skip


def reset_peak(device):
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_gb(device) -> float | None:
    if device.type != "cuda":
        return None
    return round(torch.cuda.max_memory_allocated(device) / 2**30, 2)


if __name__ == "__main__":
    main()
