"""A target too large for the GPU is refused before any weight is loaded, with the numbers."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from dflash.errors import UserError
from dflash.model import memory
from dflash.model.target import load_target


@pytest.fixture
def saved_target(tmp_path, small_decoder):
    model = LlamaForCausalLM(LlamaConfig(**small_decoder, tie_word_embeddings=False))
    model.save_pretrained(tmp_path)
    return tmp_path, sum(p.numel() for p in model.parameters())


def test_the_weight_count_comes_from_the_safetensors_headers(saved_target):
    path, params = saved_target
    assert memory.weight_count(path) == params


def test_a_target_larger_than_the_gpu_fails_naming_need_memory_and_the_key(
    saved_target, monkeypatch
):
    path, params = saved_target
    total = params  # a GPU with room for half the bf16 weights
    monkeypatch.setattr(memory, "gpu_memory", lambda device: (total // 2, total))
    loaded = []
    monkeypatch.setattr(
        "transformers.AutoModelForCausalLM.from_pretrained", lambda *a, **k: loaded.append(a)
    )
    with pytest.raises(UserError) as error:
        load_target(path, dtype=torch.bfloat16, device=torch.device("cuda", 0))
    message = str(error.value)
    assert f"needs {2 * params / 1e9:.1f} GB on cuda:0" in message
    assert f"which has {total / 1e9:.1f} GB" in message
    assert "train.topology.target_shards" in message
    assert not loaded  # refused before any weight was read
    # split across enough target ranks, the same target fits
    assert (
        memory.require_target_fits(
            path, torch.bfloat16, torch.device("cuda", 0), "training", shards=2
        )
        == params
    )


def test_nothing_is_checked_off_the_gpu(saved_target):
    path, _ = saved_target
    assert memory.require_target_fits(path, torch.float32, torch.device("cpu"), "eval") == 0
