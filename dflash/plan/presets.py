"""The target shapes `dflash plan` knows by name, and the datasheet figures of GPU kinds."""

from __future__ import annotations

# Shapes of the presets: the fields of a HF config.json that `dflash plan` reads.
PRESETS = {
    # config/models/qwen3-8b/config.json (Qwen3-8B's published config, the shapes every 8B bench uses)
    "qwen3-8b": {
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 151936,
        "tie_word_embeddings": False,
    },
    # config/models/smollm2-135m/config.json (the embedded default's and config/h200.yaml's target)
    "smollm2-135m": {
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "vocab_size": 49152,
        "tie_word_embeddings": True,
    },
}

# Datasheet figures per GPU (dense bf16 TFLOP/s, HBM TB/s, memory GB). Only h200 has measurements
# here; the others are reached by the ratio of these figures (labelled as projections).
GPUS = {
    "h200": {"tflops": 989, "tb_s": 4.8, "gb": 141, "source": "NVIDIA H200 SXM datasheet"},
    "h100": {"tflops": 989, "tb_s": 3.35, "gb": 80, "source": "NVIDIA H100 SXM datasheet"},
    "a100": {"tflops": 312, "tb_s": 2.039, "gb": 80, "source": "NVIDIA A100 80GB SXM datasheet"},
    "b200": {
        "tflops": 2250,
        "tb_s": 8.0,
        "gb": 180,
        "source": "NVIDIA DGX B200 datasheet, per GPU",
    },
}
