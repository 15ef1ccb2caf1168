"""Will the target fit? Its weights' bytes, read from the safetensors headers before any weight is
loaded, against the GPU's memory: a 70B target on one 141 GB GPU fails in a second with the
numbers and the key that shards it, not minutes later with an out-of-memory traceback."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import torch

from dflash.errors import UserError

SHARD_KEY = "train.topology.target_shards"


def weight_count(model_dir: str | Path) -> int:
    """Parameters stored in the model folder's safetensors files (their headers only)."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise UserError(f"target {model_dir}: no *.safetensors files")
    count = 0
    for file in files:
        with open(file, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        for name, entry in header.items():
            if name != "__metadata__":
                n = 1
                for dim in entry["shape"]:
                    n *= dim
                count += n
    return count


def host_available() -> int:
    """Bytes of host memory a new allocation can have (psutil's `available`: MemAvailable on
    Linux)."""
    import psutil

    return psutil.virtual_memory().available


def gpu_memory(device: torch.device) -> tuple[int, int]:
    """(free, total) bytes of a CUDA device."""
    return torch.cuda.mem_get_info(device)


def require_target_fits(
    model_dir: str | Path,
    dtype: torch.dtype,
    device: torch.device,
    what: str,
    shards: int = 1,
    extra_bytes: int = 0,
) -> int:
    """Raise a UserError when the target's weights (split `shards` ways) plus `extra_bytes`
    exceed the device's memory; returns the bytes needed. Nothing to check off CUDA."""
    device = torch.device(device)
    if device.type != "cuda":
        return 0
    weights = weight_count(model_dir) * torch.tensor([], dtype=dtype).element_size()
    need = weights // shards + extra_bytes
    free, total = gpu_memory(device)
    if need > total:
        gb = 1e9
        split = f" split {shards} ways" if shards > 1 else ""
        raise UserError(
            f"{what}: the target {model_dir} needs {need / gb:.1f} GB on {device} "
            f"({weights / gb:.1f} GB of {str(dtype).removeprefix('torch.')} weights{split}"
            + (f", {extra_bytes / gb:.1f} GB beside them" if extra_bytes else "")
            + f"), which has {total / gb:.1f} GB ({free / gb:.1f} GB free). Shard the target "
            f"across target ranks with {SHARD_KEY} (training), or use GPUs with more memory."
        )
    return need


def peak_memory_gb() -> float | None:
    """The most GPU memory this process has allocated (GB), on whichever GPU it used."""
    if not torch.cuda.is_available():
        return None
    return round(
        max(map(torch.cuda.max_memory_allocated, range(torch.cuda.device_count()))) / 1e9, 1
    )


def decode_weight_bytes(model) -> int:
    """The weights a decode step reads: all but the input embedding table (one row a token),
    which the LM head reads whole where it is tied."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    embed = model.get_input_embeddings().weight
    tied = embed is model.get_output_embeddings().weight
    return total if tied else total - embed.numel() * embed.element_size()


def kv_bytes_per_token(model) -> int:
    """Keys and values of one cached token in every layer, in the model's dtype."""
    from dflash.model.decoder import head_dim

    c = model.config
    size = model.get_input_embeddings().weight.element_size()
    return 2 * c.num_hidden_layers * c.num_key_value_heads * head_dim(c) * size
