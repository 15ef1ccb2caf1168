"""`dflash plan`: its arithmetic against hand computations, measured vs projected, --from-run on a
results folder written with the stages' own keys, and its errors. CPU only, no network."""

from __future__ import annotations

import json
from pathlib import Path

import polars as pl
import pytest

from dflash.cli import build_parser, main
from dflash.plan import build
from dflash.plan.rates import PRESETS, RATES
from dflash.plan.shapes import Drafter, Shape, assumed_shape, drafter_flops, sample_flops
from dflash.plan.stages import summarize

REPO = Path(__file__).resolve().parents[1]
QWEN3_8B = Shape.from_config(PRESETS["qwen3-8b"], "qwen3-8b")
SMOLLM2 = Shape.from_config(PRESETS["smollm2-135m"], "smollm2-135m")


DRAFTER_8B = 5 * (192_937_984 + 2 * 4096 + 4096 * 4096) + 4096  # layers, fc 4096² each, norms


def checkpoints_s(n: int, params: int = DRAFTER_8B) -> float:
    """n checkpoints of a drafter by hand: 12 bytes a trained parameter, each copied to host at
    the rehearsal's 1.38 GB/s, the last written at 0.58 GB/s."""
    gb = 12 * params / 1e9
    return n * gb / 1.38 + gb / 0.58


def test_checkpoint_size_is_the_rehearsals():
    assert 12 * DRAFTER_8B / 1e9 == pytest.approx(12.58, abs=0.01)


STARTUP_8B = 31.2  # the rehearsal's, from process start to the first step


def plan(*argv: str) -> dict:
    """The plan's JSON summary for `dflash plan ARGV`."""
    return summarize(build(build_parser().parse_args(["plan", *argv])))


def stage(summary: dict, name: str) -> dict:
    return next(s for s in summary["stages"] if s["stage"] == name)


def test_presets_match_their_bench_configs_and_published_parameter_counts():
    for name, path in (
        ("qwen3-8b", "config/models/qwen3-8b"),
        ("smollm2-135m", "config/models/smollm2-135m"),
    ):
        cfg = json.loads((REPO / path / "config.json").read_text())
        assert Shape.from_config(cfg, path) == Shape.from_config(PRESETS[name], name)
    # by hand: 36 x (q 4096² + k, v 2 x 4096 x 1024 + o 4096² + MLP 3 x 4096 x 12288 + 2 norms)
    # + embedding and LM head 2 x 151936 x 4096 + final norm
    per_layer = 4096**2 * 2 + 2 * 4096 * 1024 + 3 * 4096 * 12288 + 2 * 4096
    assert QWEN3_8B.params == 36 * per_layer + 2 * 151936 * 4096 + 4096 == 8_190_726_144
    assert SMOLLM2.params == 134_515_008  # SmolLM2-135M's own count (tied embeddings)


def test_drafter_flops_match_the_bench_count_at_its_shape():
    """bench/gpu.py counted 147.48 useful TFLOP for its 4 rows (8,578 context tokens, 256
    anchors each, the first quarter of each row a prompt)."""
    path = REPO / "bench/results/2026-12-02-h200-gpu-bench-256-warm-start-pipeline-0p1.json"
    case = json.loads(path.read_text())["sections"]["drafter_step"]["256 anchors, 4x2560"]
    n = case["context_tokens"] / 4
    ours = 4 * drafter_flops(QWEN3_8B, Drafter(5, 16, 256), n, n / 4)
    assert ours / 1e12 == pytest.approx(case["useful_tflop"], rel=0.01)


def test_public_recipe_regeneration_by_hand():
    s = plan("--target", "qwen3-8b", "--samples", "800000", "--epochs", "6", "--gpus", "8")
    weights, kv_8b = 2 * 8_190_726_144, 36 * 2 * 8 * 128 * 2
    # the 8B rehearsal: 1,069,384 new tokens at 5,212 tokens/s, batch 128, turns of 901 prompt
    # + 1,023 new tokens; its steps: the full-batch ones + one engine's drain of 1,024 / 2 steps
    roof_128 = 128 / ((weights + 128 * (901 + 1023 / 2) * kv_8b) / 4.8e12)
    steps = 1_069_384 / 128 + 1024 / 2
    full_batch_rate = 128 * steps / (1_069_384 / 5212)  # tokens/s had every step been full
    fraction = full_batch_rate / roof_128
    assert 0.38 < fraction < 0.40  # every answer ran to the cap: 10 waves of 1,024 steps
    # 8B: rows of 2,048 (the longest prompt) + 2,048 (max new) cache tokens in 90 % of 141 GB
    batch = int((0.9 * 141e9 - weights) // ((2048 + 2048) * kv_8b))
    assert batch == 182
    rate = fraction * batch / ((weights + batch * (256 + 1024 / 2) * kv_8b) / 4.8e12)
    # a shard of 1/8 of the tokens, in full steps of 182 rows, + one engine's drain
    seconds = (800_000 * 1024 / 8 / batch + 2048 / 2) * batch / rate
    regen = stage(s, "regeneration")
    assert regen["seconds"] == pytest.approx(seconds, rel=1e-9)
    assert regen["basis"] == "projected" and "batch 182" in regen["how"]
    assert "8B rehearsal" in regen["source"]  # a measured 8B regeneration now wins


def test_public_recipe_training_by_hand():
    """Useful FLOPs per sample written out flat, at the plan's shape and at the measurement's."""

    def per_sample(n, prompt, anchors):
        t, anchor = anchors * 16, (prompt + n) / 2
        features = 34 * (2 * n * 192_937_984 + 4 * 128 * 32 * n * (n + 1) / 2)
        layer = 4 * t * 4096 * 4096 + 4 * (n + t) * 4096 * 1024 + 6 * t * 4096 * 12288
        layer += 4 * t * (anchor + 16) * 4096
        trained = 5 * layer + 2 * n * 5 * 4096 * 4096
        return features + 3 * trained + 4 * t * 4096 * 151936

    assert per_sample(1280, 256, 512) == pytest.approx(
        sample_flops(QWEN3_8B, Drafter(5, 16, 512), 1280, 256), rel=1e-12
    )
    # 17,555 tokens/s on one H200 at rows of 2,048 (512 prompt) and 256 anchors: samples/s per
    # GPU at the plan's shape scale by the ratio of the FLOPs per sample
    samples_s = 17555 / 2048 * per_sample(2048, 512, 256) / per_sample(1280, 256, 512)
    s = plan("--target", "qwen3-8b", "--samples", "800000", "--epochs", "6", "--gpus", "8")
    train = stage(s, "training")
    fixed = STARTUP_8B + checkpoints_s(6)  # one checkpoint at each epoch's end
    assert train["seconds"] == pytest.approx(800_000 * 6 / (8 * samples_s) + fixed, rel=1e-9)
    assert train["basis"] == "projected"
    assert s["data"]["source"].startswith("assumed")  # the recipe's mean length is an assumption
    assert s["data"]["training_tokens"] == 800_000 * 1280 * 6


def test_measured_where_shape_gpu_and_workload_are_the_measurements():
    one = plan("--target", "qwen3-8b", "--samples", "1000", "--anchors", "256",
               "--prompt-tokens", "512", "--new-tokens", "1536")  # fmt: skip
    train = stage(one, "training")
    assert train["basis"] == "measured"
    fixed = STARTUP_8B + checkpoints_s(1)
    assert train["seconds"] == pytest.approx(1000 * 2048 / 17555 + fixed)
    eight = plan("--target", "qwen3-8b", "--samples", "1000", "--anchors", "256",
                 "--prompt-tokens", "512", "--new-tokens", "1536", "--gpus", "8")  # fmt: skip
    assert stage(eight, "training")["seconds"] - fixed == pytest.approx(
        (train["seconds"] - fixed) / 8
    )
    assert "linear" in stage(eight, "training")["how"]
    # another anchor count: the same measurement, scaled, and labelled so
    other = stage(plan("--target", "qwen3-8b", "--samples", "1000", "--prompt-tokens", "512",
                       "--new-tokens", "1536"), "training")  # fmt: skip
    assert other["basis"] == "projected" and "17.6K tokens/s measured" in other["how"]
    # other data than the 8B rehearsal's: its regeneration, projected
    assert stage(one, "regeneration")["basis"] == "projected"
    assert "8B rehearsal" in stage(one, "regeneration")["source"]


def test_the_recipe_target_at_its_own_workload_is_measured():
    s = plan("--target", "smollm2-135m", "--samples", "11633", "--prompt-tokens", "619",
             "--new-tokens", "315", "--max-new-tokens", "512", "--buckets", "4",
             "--anchors", "96")  # fmt: skip
    regen = stage(s, "regeneration")
    assert regen["basis"] == "measured"
    assert regen["seconds"] == pytest.approx(11633 * 315 / 50428)
    assert stage(s, "compile warmup")["basis"] == "measured"
    assert stage(s, "compile warmup")["seconds"] == 154
    assert stage(s, "evaluation")["basis"] == "measured"
    assert stage(s, "evaluation")["seconds"] == pytest.approx(387)


REHEARSAL = ("--target", "qwen3-8b", "--samples", "512", "--epochs", "3", "--anchors", "256",
             "--max-length", "2560", "--buckets", "1", "--regen-batch", "128",
             "--max-new-tokens", "1024", "--prompt-tokens", "216", "--new-tokens", "2087",
             "--eval-prompts", "8", "--eval-new-tokens", "128")  # fmt: skip


def test_the_8b_rehearsals_case_by_hand():
    """config/rehearsal-8b.yaml's own case: the stages fitted to it read its measurements back
    (agreement by construction); training and evaluation at 8 prompts are projected."""
    by = {f["stage"]: f for f in plan(*REHEARSAL)["stages"]}
    assert by["regeneration"]["basis"] == "measured"
    assert by["regeneration"]["seconds"] == pytest.approx(512 * 2087 / 5212)
    assert by["compile warmup"]["basis"] == "measured" and by["compile warmup"]["seconds"] == 106
    assert by["tokenization"]["basis"] == "measured"
    assert by["tokenization"]["seconds"] == pytest.approx(32 + 512 * (216 + 2087) / 390000)
    assert by["evaluation"]["basis"] == "measured" and by["evaluation"]["seconds"] == 166
    # the target's preparation and the record's hash, the eval split first on the one GPU, the
    # small rules: the rehearsal's 197 s
    assert by["other rules"]["basis"] == "measured"
    assert by["other rules"]["seconds"] == pytest.approx(9 + 102 * 16.381 / 16.4 + 86, rel=1e-4)
    # training: the workflow's 16,983 tokens/s at 2,085 tokens (nearer than the bench's 2,048 to
    # the plan's 2,303, the cap of the means), scaled by FLOPs per sample, + 3 checkpoints
    train = by["training"]
    assert train["basis"] == "projected" and "17.0K tokens/s measured at 2,085" in train["how"]
    per = sample_flops(QWEN3_8B, Drafter(5, 16, 256), 2303, 216)
    samples_s = 16983 / 2085 * sample_flops(QWEN3_8B, Drafter(5, 16, 256), 2085, 216) / per
    fixed = STARTUP_8B + checkpoints_s(3)
    assert train["seconds"] == pytest.approx(512 * 3 / samples_s + fixed, rel=1e-9)
    # within 15 % of the run's 912 s (BENCHMARKS.md 2026-12-04), the warmup beside regeneration
    total = plan(*REHEARSAL)["total_s"]
    assert total == pytest.approx(
        by["regeneration"]["seconds"] + sum(by[k]["seconds"] for k in by
                                            if k not in ("regeneration", "compile warmup"))
    )  # fmt: skip
    assert abs(total / 912 - 1) < 0.15


def test_a_new_measurement_for_the_plans_shape_and_gpu_takes_precedence():
    args = build_parser().parse_args(["plan", "--target", "qwen3-8b", "--regen-batch", "256",
                                      "--max-length", "1024",  # 256 rows of 1,024 + 1,536 fit
                                      "--prompt-tokens", "300", "--new-tokens", "700"])  # fmt: skip
    p = build(args)
    # the one line a measurement adds to dflash/plan/rates.py
    new = {"stage": "regenerate", "target": "qwen3-8b", "gpu": "h200", "value": 9000.0,
           "source": "a later measurement",
           "workload": {"batch": 256, "prompt_tokens": 300, "new_tokens": 700, "max_new_tokens": 1536}}  # fmt: skip
    p.rates = [*RATES, new]  # appended last, still first choice for (qwen3-8b, h200)
    regen = stage(summarize(p), "regeneration")
    assert regen["basis"] == "measured" and regen["source"] == "a later measurement"
    assert regen["seconds"] == pytest.approx(800_000 * 700 / 9000)
    p.data = type(p.data)(800_000, 300, 1400, "given")  # longer answers: scaled from the new one
    longer = stage(summarize(p), "regeneration")
    assert longer["basis"] == "projected" and longer["source"] == "a later measurement"


def test_other_gpu_kinds_are_projections_by_datasheet_ratios():
    h200 = plan("--target", "qwen3-8b", "--anchors", "256", "--prompt-tokens", "512",
                "--new-tokens", "1536")  # fmt: skip
    a100 = plan("--target", "qwen3-8b", "--anchors", "256", "--prompt-tokens", "512",
                "--new-tokens", "1536", "--gpu", "a100")  # fmt: skip
    assert all(f["basis"] == "projected" for f in a100["stages"])
    train_h200, train_a100 = stage(h200, "training")["seconds"], stage(a100, "training")["seconds"]
    fixed = STARTUP_8B + checkpoints_s(1)  # host work, the same on either
    assert train_a100 - fixed == pytest.approx((train_h200 - fixed) * 989 / 312)
    assert stage(a100, "regeneration")["seconds"] > stage(h200, "regeneration")["seconds"]


def test_assumed_shape_for_a_parameter_count():
    shape = assumed_shape(70e9)
    assert shape.params == pytest.approx(70e9, rel=0.02)
    assert shape.hidden % 128 == 0 and 80 <= shape.hidden / shape.layers <= 120
    s = plan("--params", "70e9", "--samples", "1000", "--gpus", "8")
    assert "assumed" in s["target"]["source"]
    assert all(f["basis"] == "projected" for f in s["stages"])
    # 140 GB of weights: decoded by copies over two H200s, trained only with a caveat
    assert "over 2 GPUs" in stage(s, "regeneration")["how"]
    assert "x 4 copies" in stage(s, "regeneration")["how"]
    assert "do not fit" in stage(s, "training")["how"]


def test_split_topology_is_the_slower_half():
    s = plan("--target", "qwen3-8b", "--gpus", "8", "--topology", "4+4")
    assert s["gpus"]["topology"] == "4+4"
    train = stage(s, "training")
    assert train["basis"] == "projected" and "the slower of" in train["how"]


# -- --from-run: a results folder as the stages write it


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


@pytest.fixture
def run_folder(tmp_path) -> Path:
    """A finished one-H200 run of the SmolLM2 target, its files written with the stages' keys."""
    from dflash.data.stats import length_stats
    from dflash.train.telemetry import summarize as summarize_train

    r = tmp_path / "results"
    # the converted target lives under resources/; the run's record names it as an input
    target = "../resources/target/SmolLM2-135M-Instruct-Q8_0-0123456789ab"
    write(
        r / target / "hf/config.json",
        (REPO / "config/models/smollm2-135m/config.json").read_text(),
    )
    write(r / "MANIFEST.json", json.dumps({"inputs": {"target": {"path": target, "sha256": {}}}}))
    frame = pl.DataFrame({"length": [1000, 1200, 800, 1400], "trainable": [800, 1000, 600, 1200]})
    stats = length_stats(frame, [512, 1024, 2048], 2048, 16384, 64)
    write(r / "data/stats/stats.json", json.dumps(stats))
    gpu = {"gpus": {"count": 1, "models": ["NVIDIA H200"], "driver": "580.159.04"}}
    train_params = {  # the keys training's outputs depend on (dflash.stages), as its manifest has them
        "seed": 0,
        "target": {"mask_token_id": 3},
        "drafter": {"num_layers": 5, "block_size": 16, "max_anchors": 96},
        "compile": {"enabled": True},
        "train": {"epochs": 2, "topology": {"targets": 0, "drafters": 1}},
        "data": {"buckets": [512, 1024, 2048], "max_length": 2048, "token_budget": 16384},
        "world_size": 1,
    }
    write(
        r / "manifests/train.json",
        json.dumps({"stage": "train", "params": train_params, "environment": gpu}),
    )
    regenerate = {"batch_size": 1024, "max_new_tokens": 512, "engine": "auto"}
    regen_params = {"data": {"regenerate": regenerate, "max_length": 2048}, "shard": 0, "shards": 1}
    write(r / "manifests/regenerate_train_0.json",
          json.dumps({"stage": "regenerate", "params": regen_params, "environment": gpu}))  # fmt: skip
    step = {"loss": 5.0, "tau": 2.0, "acc": [0.5], "tokens_per_s": 300000.0,
            "time_s": {"wait": 0.0, "features": 0.01, "forward": 0.02, "backward": 0.01, "optimizer": 0.001},
            "drafters": [{"tokens": 12000, "wall_s": 0.04, "tokens_per_s": 300000.0,
                          "time_s": {"wait": 0.0}, "peak_memory_gb": 9.5}]}  # fmt: skip
    summary = summarize_train([step, step, step], {"targets": 0, "drafters": 1}, 2)
    summary |= {"compile_s": 15.0, "startup_s": 30.0}
    write(r / "train/summary.json", json.dumps(summary))
    rate = {"rows": 4, "engine": "static", "dtype": "bfloat16", "new_tokens_this_run": 3600,
            "turns_dropped_past_max_length_this_run": 0, "seconds": 0.09, "tokens_per_s": 40000.0}  # fmt: skip
    write(r / "logs/regenerate_train_0.log",
          f"2026-12-02 12:31:00,200 dflash.data.regenerate regenerate: {rate}\n"
          "2026-12-02 12:31:00,201 dflash.data.regenerate regenerate: prompt tier {'tier': 256}\n")  # fmt: skip
    shapes = [{"batch": 32, "length": 512, "first_step_s": 30.0, "step_s": 0.02}] * 3
    write(r / "compile/warmup.json", json.dumps({"torch": "2.11.0", "enabled": True, "shapes": shapes,
                                                 "seconds": 120.0, "cache_files": 10, "cache_bytes": 1}))  # fmt: skip
    method = {"n_prompts": 104, "tokens": 20000, "tokens_per_s": 400.0}
    acceptance = {"block_size": 16, "max_new_tokens": 256, **method, "baselines": {
        "target": {**method, "tokens_per_s": 320.0}, "lookup": {**method, "tokens_per_s": 500.0}}}  # fmt: skip
    write(r / "eval/acceptance.json", json.dumps(acceptance))
    return r


def test_from_run_uses_the_runs_own_rates(run_folder):
    s = plan("--from-run", str(run_folder))
    assert s["target"]["name"] == "smollm2-135m"  # the run's config.json is the preset's shape
    assert s["data"]["samples"] == 4 and s["data"]["new_tokens"] == 900  # from its stats.json
    by = {f["stage"]: f for f in s["stages"]}
    for name in ("regeneration", "compile warmup", "training", "evaluation"):
        assert by[name]["basis"] == "measured", name
        assert by[name]["source"].startswith("--from-run"), name
    assert by["regeneration"]["seconds"] == pytest.approx(4 * 900 / (3600 / 0.09))
    assert by["compile warmup"]["seconds"] == 120.0
    assert s["epochs"] == 2 and s["drafter"]["anchors"] == 96  # the run's settings
    # 2 checkpoints of the 135M target's drafter: 5 x (its layer's matmuls, norms, fc 576²)
    drafter = 5 * (2 * 576 * 576 + 2 * 576 * 192 + 3 * 576 * 1536 + 2 * 576 + 576**2) + 576
    assert by["training"]["seconds"] == pytest.approx(
        4 * 2 * 1100 / 300000 + 30.0 + checkpoints_s(2, drafter)
    )
    assert by["evaluation"]["seconds"] == pytest.approx(20000 / 400 + 20000 / 320 + 20000 / 500)
    # tokenization records no time of its own: the shipped table's rate, same tokenizer
    assert by["tokenization"]["source"].startswith("BENCHMARKS.md")
    # the run's rates also anchor a projection to more data and epochs
    bigger = plan("--from-run", str(run_folder), "--samples", "100000", "--epochs", "3")
    train = stage(bigger, "training")
    assert train["basis"] == "measured" and train["source"].startswith("--from-run")


def test_from_run_on_another_target_projects_from_the_run(run_folder):
    s = plan("--from-run", str(run_folder), "--target", "qwen3-8b", "--samples", "1000")
    regen = stage(s, "regeneration")
    assert regen["basis"] == "projected"
    # the 8B table's own entries (the plan's shape and GPU kind) win over the 135M run's
    assert regen["source"].startswith("BENCHMARKS.md 2026-12-04")
    assert stage(s, "training")["source"].startswith("BENCHMARKS.md")


# -- the command line


def test_cli_prints_a_table_and_json(capsys):
    assert (
        main(
            ["plan", "--target", "qwen3-8b", "--samples", "800000", "--epochs", "6", "--gpus", "8"]
        )
        == 0
    )
    out = capsys.readouterr().out
    for word in (
        "regeneration",
        "tokenization",
        "compile warmup",
        "training",
        "evaluation",
        "total",
    ):
        assert word in out
    assert "projected" in out and "source:" in out
    assert main(["plan", "--target", "qwen3-8b", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert {f["basis"] for f in summary["stages"]} <= {"measured", "projected"}
    total = summary["total_s"]
    by = {f["stage"]: f["seconds"] for f in summary["stages"]}
    assert total == pytest.approx(max(by["regeneration"], by["compile warmup"]) + by["tokenization"]
                                  + by["training"] + by["evaluation"] + by["other rules"])  # fmt: skip


def test_plan_does_not_import_torch():
    import subprocess
    import sys

    code = "import sys; from dflash.cli import main; main(['plan', '--target', 'qwen3-8b']); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONPATH": str(REPO), "PATH": ""}).stdout  # fmt: skip
    assert out.strip().endswith("False")


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--target", "qwen9-1t"], ["--target", "qwen9-1t", "qwen3-8b"]),
        (
            ["--target", "qwen3-8b", "--stats", "missing/stats.json"],
            ["--stats", "no such file", "missing/stats.json"],
        ),
        (["--from-run", "no-such-results"], ["--from-run", "no-such-results"]),
        (["--target", "qwen3-8b", "--topology", "4-4"], ["--topology", "4-4"]),
        (["--params", "70"], ["--params"]),
        (["--samples", "10"], ["--target"]),
        (["--params", "70e9", "--gpus", "1"], ["--gpus 1", "2 x H200"]),
        (["--target", "qwen3-8b", "--new-tokens", "0"], ["--new-tokens"]),
    ],
)
def test_bad_input_names_the_argument(argv, words, capsys):
    assert main(["plan", *argv]) == 1
    err = capsys.readouterr().err
    assert err.startswith("dflash plan: error: ")
    for word in words:
        assert word in err


def test_a_config_without_a_needed_field_is_named(tmp_path, capsys):
    cfg = dict(PRESETS["qwen3-8b"])
    del cfg["intermediate_size"]
    write(tmp_path / "model/config.json", json.dumps(cfg))
    assert main(["plan", "--target", str(tmp_path / "model")]) == 1
    assert "intermediate_size" in capsys.readouterr().err
