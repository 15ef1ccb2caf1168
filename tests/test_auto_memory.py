"""`auto` batch sizes (data.token_budget, drafter.max_anchors, data.max_batch_size) from a
training rank's memory and the model's shapes: the memory model against measured peaks, what
auto picks for a mocked free-memory figure, the CPU's sizes, and a run keeping its first choice."""

from __future__ import annotations

import json

import pytest
from conftest import REPO

from dflash import auto_memory
from dflash.config import load_config
from dflash.errors import UserError
from dflash.plan.memory import CPU_SIZES, Model, fit, need
from dflash.plan.rates import PRESETS
from dflash.plan.shapes import Shape

QWEN3_8B = Shape.from_config(PRESETS["qwen3-8b"], "qwen3-8b")
SMOLLM2 = Shape.from_config(PRESETS["smollm2-135m"], "smollm2-135m")
AUTO = {"token_budget": "auto", "max_batch_size": "auto"}


def test_the_model_matches_the_peaks_measured_at_8b_shapes():
    """BENCHMARKS.md: the 8B rehearsal's colocated training (4 x 2560 tokens, 256 anchors)
    peaked at 49.2 GB; the drafter step alone (2 x 2560, 512 anchors, with the bench's own copy
    of embedding and head) at 31.2-31.8 GB. The model may overshoot a little, never undershoot
    by more than 1 %."""
    colocated = Model.of(QWEN3_8B, 5, 16, 5)
    rehearsal = {"buckets": [2560], "max_length": 2560, "token_budget": 10240, "max_batch_size": 4}
    assert 0.99 * 49.2e9 <= need(colocated, rehearsal, 256)[0] <= 1.05 * 49.2e9
    alone = Model.of(QWEN3_8B, 5, 16, 5, colocated=False)
    step = dict(rehearsal, token_budget=5120, max_batch_size=2)
    embed_and_head = 2 * QWEN3_8B.vocab * QWEN3_8B.hidden * 2
    assert 0.99 * 31.8e9 <= need(alone, step, 512)[0] + embed_and_head <= 1.1 * 31.8e9


def test_auto_fills_a_gpus_free_memory_and_says_how():
    model = Model.of(QWEN3_8B, 5, 16, 5)
    data = dict(AUTO, buckets=[2560], max_length=2560)
    h200 = fit(model, data, {"max_anchors": "auto"}, (140e9, "GPU 0, H200"))
    assert h200.values == {"token_budget": 15360, "max_anchors": 512, "max_batch_size": 6}
    assert "of 126.0 GB usable (90% of 140.0 GB free on GPU 0, H200)" in h200.note
    assert need(model, dict(data, **h200.values), 512)[0] <= 0.9 * 140e9
    # 7 rows would fit too, but pass 16,384 tokens: a larger batch is fewer steps, not faster
    h100 = fit(model, data, {"max_anchors": "auto"}, (79e9, "GPU 0, H100"))
    assert h100.values == {"token_budget": 12800, "max_anchors": 512, "max_batch_size": 5}
    sized = dict(data, **h100.values)
    assert need(model, sized, 512)[0] <= 0.9 * 79e9
    # one more row would not fit
    assert need(model, dict(sized, token_budget=15360, max_batch_size=6), 512)[0] > 0.9 * 79e9
    # less memory: fewer anchors before fewer rows than one
    small = fit(model, data, {"max_anchors": "auto"}, (45e9, "a small GPU"))
    assert small.values["max_anchors"] < 512 and small.values["token_budget"] == 2560


def test_explicit_sizes_are_kept_and_only_the_auto_one_is_fitted():
    model = Model.of(QWEN3_8B, 5, 16, 5)
    data = {"buckets": [2560], "max_length": 2560, "token_budget": "auto", "max_batch_size": 4}
    chosen = fit(model, data, {"max_anchors": 256}, (140e9, "H200"))
    assert list(chosen.values) == ["token_budget"]
    assert chosen.values["token_budget"] == 10240  # capped by max_batch_size 4's rows of 2560
    assert fit(model, dict(data, token_budget=4096), {"max_anchors": 8}, None).values == {}


def test_short_buckets_with_many_rows_bound_the_budget():
    """Every bucket computes max_anchors blocks a row: 32 rows of 512 tokens make 16x the blocks
    of 8 rows of 2048, and the fit must hold them too."""
    model = Model.of(QWEN3_8B, 5, 16, 5)
    one = fit(
        model, dict(AUTO, buckets=[2048], max_length=2048), {"max_anchors": 512}, (140e9, "x")
    )
    many = dict(AUTO, buckets=[512, 1024, 2048], max_length=2048)
    fitted = fit(model, many, {"max_anchors": 512}, (140e9, "x"))
    assert fitted.values["token_budget"] < one.values["token_budget"]
    assert "at the 512-token bucket" in fitted.note


def test_too_little_memory_is_refused_with_the_numbers():
    model = Model.of(QWEN3_8B, 5, 16, 5)
    with pytest.raises(UserError) as e:
        fit(
            model,
            dict(AUTO, buckets=[2560], max_length=2560),
            {"max_anchors": "auto"},
            (24e9, "GPU 0, L4"),
        )
    message = str(e.value)
    assert message.startswith("data.token_budget, drafter.max_anchors, data.max_batch_size: auto")
    assert "GPU 0, L4 has 24.0 GB free" in message and "train.topology.targets" in message


def test_on_a_cpu_auto_gives_the_default_configs_sizes(tmp_path):
    """The CPU default says auto; on a CPU that resolves to the sizes it was measured with."""
    config = load_config(REPO / "config/config.yaml")
    assert (config["data"]["token_budget"], config["drafter"]["max_anchors"]) == ("auto", "auto")
    chosen = auto_memory.resolve(config, on_gpu=False, built=None, pin=tmp_path / "pin.json")
    assert chosen.values == CPU_SIZES
    assert config["data"]["token_budget"] == 4096 and config["drafter"]["max_anchors"] == 8
    assert config["data"]["max_batch_size"] == 16
    assert "on a CPU" in chosen.note


def own_config(tmp_path, free_gb=80):
    target = tmp_path / "target"
    target.mkdir(exist_ok=True)
    (target / "config.json").write_text(json.dumps(PRESETS["qwen3-8b"]))
    config = load_config(REPO / "config/my-model.yaml")
    config["target"]["path"] = str(target)
    config["gpu_memory_gb"] = free_gb
    return config


def test_a_run_keeps_its_first_choice_while_it_still_fits(tmp_path):
    pin = tmp_path / "results/work/auto-memory.json"
    config = own_config(tmp_path)
    first = auto_memory.resolve(config, on_gpu=True, built=None, pin=pin)
    auto_memory.keep(first, pin)
    assert json.loads(pin.read_text())["values"] == first.values
    # a few GB more free at the next start: the same sizes (a new fit would take more rows)
    again = own_config(tmp_path, free_gb=100)
    kept = auto_memory.resolve(again, on_gpu=True, built=None, pin=pin)
    assert kept.values == first.values and "kept from the run's first start" in kept.note
    assert fit(
        Model.of(QWEN3_8B, 5, 16, 5), own_config(tmp_path, 100)["data"] | {"max_batch_size": "auto"},
        {"max_anchors": "auto"}, (100e9, "x"),
    ).values != first.values  # fmt: skip
    # less free than the kept sizes need: fitted again
    tight = auto_memory.resolve(own_config(tmp_path, free_gb=60), on_gpu=True, built=None, pin=pin)
    assert "kept" not in tight.note and tight.values != first.values


def test_a_gpu_run_without_the_targets_shapes_says_to_build_it_first():
    config = load_config(REPO / "config/config.yaml")  # the target rule builds SmolLM2 from a wheel
    with pytest.raises(UserError, match="run `snakemake --cores all target` first"):
        auto_memory.resolve(config, on_gpu=True, built=None, pin=None)
