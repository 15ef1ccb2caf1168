"""The frozen target sharded across a group of target ranks (`train.topology.target_shards`):
tensor parallel, Megatron style, with torch's DTensor `parallelize_module`.

In every kept decoder layer q/k/v and the MLP's gate/up projections are column-parallel (each
rank holds 1/S of the heads and of the MLP's hidden units) and o/down are row-parallel (their
partial sums are all-reduced), so a layer's input and output stay whole on every rank: the
features are the full hidden states, concatenated as for a whole target. The embedding, the
norms and the rotary embedding are replicated; the LM head is not loaded (a target rank never
applies it).

Why tensor parallel and not FSDP2 (`fully_shard`):
- The group computes ONE batch together and its leader sends the features (the routing stays
  "batch i -> target group i % G"); FSDP shards the weights but every rank would still run the
  whole forward of a batch of its own.
- FSDP2 unshards a module in hooks on the module it wraps; the written-out layers
  (`dflash.model.decoder`) call q_proj, o_proj, the MLP, ... directly, never the decoder layer's
  forward. DTensor's hooks sit on those Linear modules, so the written-out layer, transformers'
  forward and the compiled layer all run unchanged: `view(b, n, -1, head_dim)` simply sees the
  rank's local heads.
- Communication per forward: two all-reduces of the hidden states per layer
  (2 * L * tokens * H values), against FSDP's all-gather of every weight per forward (an 8B
  target: 16 GB per rank per batch in bf16, whatever the batch). At 8K tokens and Qwen3-8B
  shapes that is 68 all-reduces of 64 MiB (34 layers run); the work per rank is 1/S of the FLOPs.
- The result differs from the whole target only by the order of o/down's sums (fp32: ~1e-7 in the tests).

Limits: dense decoders of the written-out layouts (Llama, Mistral, Qwen2, Qwen3; no MoE), with
attention heads, key/value heads and the MLP's width divisible by the shard count.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from dflash.errors import UserError
from dflash.model.decoder import static_layout
from dflash.model.memory import require_target_fits

KEY = "train.topology.target_shards"
COLUMN = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
)
ROW = ("self_attn.o_proj", "mlp.down_proj")


def check_shardable(config, shards: int) -> None:
    """UserError naming the key unless a target of this config splits into `shards` ranks."""
    config = config.get_text_config()
    if shards == 1:
        return
    if not static_layout(config) or config.model_type.endswith("_moe"):
        raise UserError(
            f"{KEY}={shards}: a {config.model_type} target cannot be sharded; sharding covers "
            "dense llama, mistral, qwen2 and qwen3 decoders without a sliding window"
        )
    sizes = {
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "intermediate_size": config.intermediate_size,
    }
    odd = [f"{k} {v}" for k, v in sizes.items() if v % shards]
    if odd:
        raise UserError(
            f"{KEY}={shards}: the target's {', '.join(odd)} not divisible by {shards}; "
            "use a shard count dividing its heads, key/value heads and MLP width"
        )


def shard_layers(layers, mesh) -> None:
    """Tensor-parallel plan on each decoder layer, in place. Weights already materialised are
    scattered from the mesh's first rank; meta weights stay meta (materialise them after)."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    plan = {name: ColwiseParallel() for name in COLUMN} | {name: RowwiseParallel() for name in ROW}
    for layer in layers:
        parallelize_module(layer, mesh, plan)


def load_sharded(path: str | Path, mesh, layer_ids: list[int], device, dtype, with_output=False):
    """`TargetFeatures` of the target at `path`, its layers sharded over `mesh`: each rank reads
    only its slices of the safetensors, so no rank ever holds the whole target."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from dflash.model.target import TargetFeatures

    config = AutoConfig.from_pretrained(path)
    check_shardable(config, mesh.size())
    require_target_fits(path, dtype, device, "a target rank", shards=mesh.size())
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    prefix = {id(m): n for n, m in model.named_modules()}
    features = TargetFeatures(model, layer_ids, with_output=with_output)
    features.lm_head = None  # never applied on a target rank: not loaded
    decoder = features.decoder
    shard_layers(decoder.layers, mesh)
    rotary = decoder.rotary_emb
    features.to_empty(device=device)
    with torch.device(device):  # its buffers are computed, not stored: build it again
        decoder.rotary_emb = type(rotary)(rotary.config)
    read_weights(Path(path), decoder, prefix[id(decoder)], mesh)
    return features


def read_weights(path: Path, decoder: nn.Module, prefix: str, mesh) -> None:
    """Copy each parameter of `decoder` from the checkpoint (names `prefix.*`), only the rank's
    slice of a sharded one."""
    from safetensors import safe_open
    from torch.distributed.tensor import DTensor, Shard

    files = _weight_files(path)
    rank = mesh.get_local_rank()
    with torch.no_grad():
        for name, param in decoder.named_parameters():
            key = f"{prefix}.{name}" if prefix else name
            if key not in files:
                raise UserError(f"target {path}: no tensor {key!r} in its safetensors files")
            with safe_open(files[key], "pt") as f:
                stored = f.get_slice(key)
                if isinstance(param, DTensor):
                    (placement,) = param.placements
                    local = param.to_local()
                    if isinstance(placement, Shard):
                        dim, size = placement.dim, local.shape[placement.dim]
                        index = [slice(None)] * local.dim()
                        index[dim] = slice(rank * size, (rank + 1) * size)
                        value = stored[tuple(index)]
                    else:
                        value = stored[:]
                    local.copy_(value)
                else:
                    param.copy_(stored[:])


def _weight_files(path: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it."""
    from safetensors import safe_open

    index = path / "model.safetensors.index.json"
    if index.exists():
        return {k: path / f for k, f in json.loads(index.read_text())["weight_map"].items()}
    with safe_open(path / "model.safetensors", "pt") as f:
        return dict.fromkeys(f.keys(), path / "model.safetensors")
