"""A random target of a config's shapes and a random drafter over it, for timing decoding steps
on a GPU machine without any weights carried (bf16 on CUDA, fp32 elsewhere)."""

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from dflash.model.drafter import Drafter, DrafterConfig
from dflash.model.target import default_layer_ids


def random_target_and_drafter(config_path: str, drafter_layers: int = 5, block_size: int = 16):
    """(device, target config, target, its feature layer ids, drafter), seeded."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(config_path)
    with device:
        model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
        layers = default_layer_ids(config.num_hidden_layers, drafter_layers)
        drafter_config = DrafterConfig.for_target(config, drafter_layers, block_size, 3)
        drafter_config.target_layer_ids = layers
        drafter = Drafter(drafter_config).to(dtype).eval()
    return device, config, model, layers, drafter
