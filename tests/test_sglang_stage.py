"""The eval_sglang stage around SGLang: its meta_info read per prompt, set beside an evaluation,
its engine's environment and arguments, and the stage planned and refused as a user meets it.
SGLang itself needs a GPU and is not installed here: the meta_info dicts below are shaped as
SGLang 0.5.17 returns them (docs/notes-sglang-dflash.md), which a run on one H100 confirmed
(docs/benchmarks/2026-12-07-sglang-beside-ours-h100.md)."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import yaml
from conftest import REPO, TESTS, Workflow, served_like

from dflash.errors import UserError
from dflash.eval.served import acceptance_length
from dflash.eval.sglang_serve import counts, engine_args
from dflash.eval.sglang_stage import (
    compare,
    compare_sampled,
    engine_env,
    run,
    sglang_installed,
    summary_section,
)
from dflash.record import eval_summary


def test_tau_is_read_from_meta_info_without_the_prefills_token():
    """Block size 4: four verify rounds accepting 0, 1, 3 and 3 drafts commit 1, 2, 4 and 4
    tokens, the last cut to 3 by the stop token; with the prefill's first token the answer is 11
    tokens. τ is 10 committed tokens over 4 rounds; SGLang's own figure, 11 / 4, counts the
    prefill's token, and its correct drafts (7) the one past the stop token."""
    meta = {
        "prompt_tokens": 30,
        "completion_tokens": 11,
        "spec_verify_ct": 4,
        "spec_accept_length": 2.75,
        "spec_num_correct_drafts": 7,
        "spec_num_proposed_drafts": 12,
        "spec_correct_drafts_histogram": [1, 1, 0, 2],
    }
    row = counts(meta)
    assert acceptance_length([row]) == 2.5
    assert row["drafts"] == 4 and row["accepted"] == 6
    # rounds whose first, second and third draft were accepted
    assert row["per_position"] == [3, 2, 2]
    assert row["sglang_accept_length"] == 2.75 and row["correct_drafts"] == 7
    # the target alone, or an answer done at the prefill: no verify round, no spec_* fields
    for alone in ({"prompt_tokens": 30, "completion_tokens": 12}, {"completion_tokens": 1}):
        row = counts(alone)
        assert (row["drafts"], row["accepted"], row["per_position"]) == (0, 0, [])
        assert acceptance_length([row]) is None and row["sglang_accept_length"] is None


def test_the_engine_serves_the_drafter_through_dflash_only_when_given_one():
    request = {"target": "/t", "drafter": None, "dtype": "bfloat16", "block_size": 16,
               "context_length": 8192, "mem_fraction_static": 0.8}  # fmt: skip
    alone = engine_args(request)
    assert alone["model_path"] == "/t" and alone["mem_fraction_static"] == 0.8
    assert not any(k.startswith("speculative") for k in alone)
    served = engine_args({**request, "drafter": "/d"})
    assert served == alone | {
        "speculative_algorithm": "DFLASH",
        "speculative_draft_model_path": "/d",
        "speculative_num_draft_tokens": 16,
    }


def test_the_engines_path_puts_the_site_first_and_drops_vllm(tmp_path):
    site, vllm_site, src = tmp_path / "sglang-site", tmp_path / "vllm-site", tmp_path / "src"
    for folder in (site / "sglang", vllm_site / "vllm", src / "dflash"):
        folder.mkdir(parents=True)
        (folder / "__init__.py").write_text("")
    environ = {"PYTHONPATH": os.pathsep.join(map(str, (src, vllm_site))), "HOME": "/h"}
    env = engine_env(str(site), environ)
    assert env["PYTHONPATH"] == os.pathsep.join(map(str, (site, src))) and env["HOME"] == "/h"
    assert environ["PYTHONPATH"].endswith("vllm-site")  # the stage's own is left as it was
    assert engine_env(None, environ)["PYTHONPATH"] == str(src)
    assert sglang_installed(str(site)) and not sglang_installed(str(src))


def acceptance_like() -> dict:
    """eval/acceptance.json's fields the comparison reads: two sets of two prompts."""
    ids, sets, taus = ["a1", "a2", "b1", "b2"], ["a", "a", "b", "b"], [2.0, 3.0, 2.5, 1.5]
    return {
        "tau_macro": 2.25,
        "tau_pooled": 2.2,
        "sets": {"a": {"tau_macro": 2.5, "tau_pooled": 2.4}, "b": {"tau_macro": 2.0, "tau_pooled": 2.0}},
        "per_prompt": {"ids": ids, "sets": sets,
                       "methods": {"drafter": {"tau": taus, "tokens": [8, 8, 6, 6]}}},
    }  # fmt: skip


def test_sglangs_acceptance_is_set_beside_ours_by_prompt_and_set():
    acceptance = acceptance_like()
    served, alone = served_like(acceptance, {"b": 1.1}, engine="sglang", version="0.5.17")
    for r in served["prompts"]:
        r["per_position"] = [r["drafts"]]  # SGLang's histogram: as long as the most accepted
        r["sglang_accept_length"] = acceptance_length([r]) + 0.1
    served["prompts"][0]["per_position"] = [100, 40]
    served["server_args"] = {"attention_backend": "fa3"}
    record = compare(served, alone, acceptance, stop={2})

    assert record["sglang"] == "0.5.17" and record["server_args"] == {"attention_backend": "fa3"}
    assert record["per_prompt"]["sglang"] == [2.0, 3.0, 2.75, 1.65]
    assert record["per_prompt"]["sglang_reported"] == [2.1, 3.1, 2.85, 1.75]
    assert record["sets"]["a"]["diff_pct_macro"] == 0.0
    b = record["sets"]["b"]
    assert b["sglang_macro"] == 2.2 and b["diff_pct_macro"] == 10.0
    # every prompt's first position, and the one prompt that counted a second
    assert record["per_position"] == [1.0, 0.1]
    assert record["tokens_per_s"]["1"]["speedup"] == 2.0
    assert record["tokens_per_s"]["32"]["speedup"] == 0.9
    text = summary_section(record)
    assert "**Served by SGLang 0.5.17**" in text and "| b | 2 | 2.2 | 2.0 | +10.0 % |" in text
    summary = eval_summary({**acceptance, "baselines": {}, "tokens_per_s": 1, "speedup": 1,
                            "teacher_forced_tau": None, "lossless": True, "n_prompts": 4},
                           {"results": [], "lossless": True}, sglang=record)  # fmt: skip
    assert summary["quality"]["sglang"]["version"] == "0.5.17"
    assert summary["quality"]["sglang"]["sglang_macro"] == 2.35  # (2 + 3 + 2.75 + 1.65) / 4
    assert summary["speed"]["sglang_speedup"] == {"1": 2.0, "8": 1.5, "32": 0.9}
    assert "vllm" not in summary["quality"]

    served["prompts"][0]["id"] = "not-a-prompt-of-this-run"
    with pytest.raises(UserError, match="eval_sglang: prompts .*not-a-prompt-of-this-run"):
        compare(served, alone, acceptance, stop={2})


def test_sglangs_acceptance_at_temperature_is_pooled_beside_ours_with_a_caveat_if_greedy():
    served = {
        "sampling_verify": True,
        "sampled": [
            {"temperature": 1.0, "top_p": 1.0, "top_k": 0,
             "seeds": [{"a": {"drafts": 10, "accepted": 5, "tokens": 16}},
                       {"a": {"drafts": 10, "accepted": 7, "tokens": 18}}]}
        ],
    }  # fmt: skip
    ours = {"runs": [{"temperature": 1.0, "methods": {"drafter": {
        "overall": {"tau_pooled": 1.5}, "sets": {"a": {"tau_pooled": 1.5}}}}}]}  # fmt: skip
    (run_,) = compare_sampled(served, ours)
    assert run_["draft_rule"] == "greedy" and run_["sglang_pooled"] == 1.6  # 1 + 12 / 20
    assert run_["sets"]["a"]["per_seed"] == [1.5, 1.7] and run_["diff_pct_pooled"] == 6.67
    assert "caveat" not in run_
    (run_,) = compare_sampled({**served, "sampling_verify": False}, None)
    assert run_["ours_pooled"] is None and "verified these requests greedily" in run_["caveat"]
    assert compare_sampled({"sampled": []}, ours) == []


def test_the_stage_stops_with_one_clear_message_where_sglang_is_missing(tmp_path):
    settings = {"site": str(tmp_path), "concurrency": [8], "context_length": 8192,
                "mem_fraction_static": 0.8}  # fmt: skip
    args = SimpleNamespace(config={"eval": {"sglang": settings}})
    with pytest.raises(UserError) as caught:
        run(args)  # before anything loads
    message = str(caught.value)
    assert f"SGLang is not installed in eval.sglang.site ({tmp_path})" in message
    assert "sglang==0.5.17" in message and "eval.sglang.enabled: false" in message


def test_eval_sglang_is_planned_when_enabled_and_read_by_the_report_and_the_record(tmp_path):
    """A dry run only (`snakemake -n`): with eval.sglang.enabled true the plan holds eval_sglang,
    the report reads its sglang.json and the run record hashes it; with false it holds none."""
    config = yaml.safe_load((TESTS / "data" / "tiny.yaml").read_text())
    (tmp_path / "local.jsonl").write_bytes((TESTS / "data" / "local.jsonl").read_bytes())
    for enabled in (True, False):
        config["eval"]["sglang"] = {"enabled": enabled}
        (tmp_path / f"{enabled}.yaml").write_text(yaml.safe_dump(config))
    flow = Workflow(REPO, tmp_path)
    dry = flow.run("-n", "-p", "all", config="True.yaml").stdout
    assert "rule eval_sglang:" in dry
    assert "python -m dflash eval-sglang " in dry and "--output results/eval/sglang.json" in dry
    assert "--sglang results/eval/sglang.json" in dry.split("python -m dflash report ")[1]
    record_inputs = dry.split("rule record:")[1].split("output:")[0]
    assert "results/eval/sglang.json" in record_inputs
    assert "results/manifests/eval_sglang.json" in record_inputs
    assert "eval_sglang" not in flow.planned_jobs("all", config="False.yaml")


def test_eval_sglang_alone_depends_on_eval_sglang():
    """Turning SGLang on, or tuning it, reruns eval_sglang and no other stage (but the run
    record, which keeps the whole config)."""
    from dflash.config import load_config
    from dflash.stages import STAGES

    config = load_config(REPO / "config" / "config.yaml")
    for name, stage in STAGES.items():
        if stage.config == ("",):
            continue
        reads = [k for k in stage.depends(config) if k.startswith("eval.sglang")]
        assert bool(reads) == (name == "eval-sglang"), (name, reads)
