"""A rehearsal target: a randomly initialised, seeded Hugging Face model of a public config's
shapes (e.g. Qwen3-8B), with a real tokenizer.

No large weights can be downloaded on the machines this project runs on, but the shapes, memory,
kernels and times of every stage do not depend on the weights' values: a random target at real
shapes rehearses a run at the scale users train, made on the machine that runs it (16 GB of
weights never travel). Its answers are meaningless and, since a random model almost never emits
its end-of-turn token, run to `max_new_tokens`; τ means nothing there, time and memory do.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from dflash.errors import UserError
from dflash.model.memory import peak_memory_gb

log = logging.getLogger(__name__)


def load_model_config(path: Path):
    """A transformers config from a `config.json` file or a folder holding one."""
    from transformers import AutoConfig

    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise UserError(f"target.random_init.config: {file}: no such config file")
    return AutoConfig.from_pretrained(file)


def build_random_target(
    model_config: Path,
    tokenizer_dir: Path,
    out_dir: Path,
    seed: int,
    dtype: torch.dtype = torch.bfloat16,
    device: str = "auto",
) -> dict:
    """Write the random model and the tokenizer to `out_dir`; returns what was made.

    Weights are drawn on the GPU where there is one (an 8B model takes minutes on the host), by
    the model's own initialiser after `torch.manual_seed(seed)`: the same seed, device and torch
    give the same weights. LM-head rows past the tokenizer's vocabulary are zeroed, so the
    model, like a real one, never emits an id the tokenizer cannot decode (padding rows of a
    151,936-row Qwen3 head beside 151,669 tokens).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = load_model_config(model_config)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    vocab = config.get_text_config().vocab_size
    if len(tokenizer) > vocab:
        raise UserError(
            f"target.random_init: the tokenizer in {tokenizer_dir} has {len(tokenizer)} tokens, "
            f"more than the config's vocab_size {vocab} ({model_config})"
        )
    if not tokenizer.chat_template:
        raise UserError(
            f"target.random_init: the tokenizer in {tokenizer_dir} has no chat template"
        )
    # the ids the tokenizer defines (a public config may name another tokenizer's)
    config.eos_token_id = tokenizer.eos_token_id
    config.pad_token_id = tokenizer.pad_token_id
    config.bos_token_id = tokenizer.bos_token_id
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    started = time.perf_counter()
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    with torch.no_grad():
        model.get_output_embeddings().weight[len(tokenizer) :] = 0
    n_params = sum(p.numel() for p in model.parameters())
    init_s = time.perf_counter() - started
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out_dir, max_shard_size="5GB")
    tokenizer.save_pretrained(out_dir)
    made = {
        "parameters": n_params,
        "dtype": str(dtype).removeprefix("torch."),
        "seed": seed,
        "device": device,
        "init_s": round(init_s, 1),
        "write_s": round(time.perf_counter() - started - init_s, 1),
        "peak_memory_gb": peak_memory_gb(),
    }
    log.info("random target: %s", made)
    return made


def run(args) -> None:
    """`dflash random-target`: the standalone command (the target rule calls the same code)."""
    from dflash.io import atomic_path

    with atomic_path(args.out, is_dir=True) as tmp:
        build_random_target(args.model_config, args.tokenizer, tmp, args.seed, device=args.device)
