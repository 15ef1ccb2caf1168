"""The newcomer's path (issue 56): a tiny model of one's own (a 2-layer random-weight Llama with
SmolLM2's tokenizer and a chat template that renders tool calls) and one's own chats (OpenAI
format, some with tool calls) through `all` from config/my-model-cpu.yaml with only
`target.path` and the data file's path set; then commands without `--configfile`, which must
not touch the finished run."""

from __future__ import annotations

import json

import polars as pl
import pytest
from conftest import REPO, TESTS, Workflow

from dflash.io import sha256_file

pytestmark = pytest.mark.slow


def own_model(folder, smollm2_dir, template: str) -> None:
    """A 2-layer random Llama of SmolLM2's vocabulary, saved with its tokenizer."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    tokenizer.chat_template = template
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
        tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def snapshot(folder) -> dict:
    return {
        str(p.relative_to(folder)): (p.stat().st_mtime_ns, sha256_file(p))
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def own_run(tmp_path_factory, tiny_workflow, target_dir, qwen3_tokenizer) -> Workflow:
    work = tmp_path_factory.mktemp("own-model")
    # Qwen3's ChatML template over SmolLM2's own <|im_start|>/<|im_end|>: it renders tool calls
    own_model(work / "my-model", target_dir, qwen3_tokenizer.chat_template)
    (work / "chats.jsonl").write_text((TESTS / "data" / "own-chats.jsonl").read_text())
    example = (REPO / "config" / "my-model-cpu.yaml").read_text()
    mine = example.replace("path: /models/my-target", "path: my-model")
    mine = mine.replace("path: data/my-chats.jsonl", "path: chats.jsonl")
    changed = zip(mine.splitlines(), example.splitlines(), strict=True)
    assert sum(a != b for a, b in changed) == 2  # the two keys, nothing else
    (work / "mine.yaml").write_text(mine)
    flow = Workflow(tiny_workflow.repo, work)
    flow.done = flow.run("all", config="mine.yaml")
    return flow


def test_ones_own_model_and_chats_run_end_to_end_from_the_cpu_example(own_run):
    said = own_run.done.stdout + own_run.done.stderr
    # chosen for the user, and said when Snakemake started
    assert "target.mask_token_id: null -> 3, the first unused special token '<repo_name>'" in said
    assert "drafter.target_layer_ids: null -> [1] (of its 2 layers)" in said  # not [1, -1]
    assert "data.token_budget: auto -> 4096, drafter.max_anchors: auto -> 8" in said
    results = own_run.results
    drafter = json.loads((results / "drafter" / "config.json").read_text())
    assert drafter["dflash_config"] == {"mask_token_id": 3, "target_layer_ids": [1]}
    train_log = (results / "logs" / "train.log").read_text()
    assert "drafter.max_anchors 8 (data.token_budget: auto -> 4096" in train_log

    expanded = json.loads((results / "data" / "expanded" / "report.json").read_text())
    assert expanded["sources"]["chats"]["dropped"] == {}  # tool calls were all wrong_shape
    tokenized = json.loads((results / "data" / "tokenized" / "train.report.json").read_text())
    assert set(tokenized["dropped"]) == {"no_trainable_pair"}
    rows = pl.read_parquet(results / "data" / "regenerated" / "train.parquet").to_dicts()
    calls = [t for r in rows for t in r["conversations"] if t["role"] == "assistant" and t["extra"]]
    source = [json.loads(x) for x in (TESTS / "data" / "own-chats.jsonl").read_text().splitlines()]
    made = {m["tool_calls"][0]["function"]["name"] for r in source for m in r["messages"]
            if m.get("tool_calls")}  # fmt: skip
    # kept as the data has them: regeneration rewrote the plain answers only
    kept = {json.loads(t["extra"])["tool_calls"][0]["function"]["name"] for t in calls}
    assert calls and kept <= made
    assert any(t["content"] == "Let me compute that." for t in calls)

    summary = (results / "summary.md").read_text()
    assert "**Your drafter:** `results/drafter`" in summary
    assert "vllm serve my-model --speculative-config" in summary
    assert "--speculative-draft-model-path results/drafter" in summary
    # a random 2-layer target loops ("lessnesslessness..."): its τ means nothing, and says so
    assert summary.split("\n\n")[1].startswith("**Warning: these figures mean nothing.**")


def test_a_command_without_its_configfile_never_touches_the_finished_run(own_run):
    before = snapshot(own_run.results)
    for args in (("-n", "all"), ("all",), ("train",)):
        done = own_run.run(*args, config=None, check=False)
        said = done.stdout + done.stderr
        assert done.returncode != 0, args
        assert "results/ holds a run of mine.yaml" in said
        assert "the embedded default (config/config.yaml)" in said
        assert "give it --configfile mine.yaml" in said
    assert snapshot(own_run.results) == before
    # README's unlock and the run's own config: nothing refused, nothing to do
    assert own_run.run("--unlock", config=None).returncode == 0
    assert own_run.planned_jobs("all", config="mine.yaml") == {}
    assert snapshot(own_run.results) == before
