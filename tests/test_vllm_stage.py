"""The eval_vllm stage around vLLM: its counters read per prompt, set beside a real run's
evaluation, and the stage planned and refused as a user meets it. vLLM itself needs a GPU; it
ran on the H200 (BENCHMARKS.md), not here."""

from __future__ import annotations

import json
import re
import shutil
from types import SimpleNamespace

import pytest
import yaml
from conftest import OVER, Workflow, jobs_in, served_like

from dflash.errors import UserError
from dflash.eval.metrics import text_digest
from dflash.eval.serve_loop import difference
from dflash.eval.vllm_serve import ACCEPTED, DRAFTS, PER_POSITION, counters
from dflash.eval.vllm_stage import compare, same_text, summary_section, walk_served
from dflash.record import eval_summary


def test_counters_differenced_over_a_request():
    def snapshot(drafts, accepted, per_position):
        return counters(
            [
                SimpleNamespace(name="vllm:num_requests_running", value=1),
                SimpleNamespace(name=DRAFTS, value=drafts),
                SimpleNamespace(name=ACCEPTED, value=accepted),
                SimpleNamespace(name=PER_POSITION, values=per_position),
            ]
        )

    before = snapshot(10, 14, [8, 4, 2])
    after = snapshot(15, 25, [12, 7, 4, 2])
    assert difference(after, before) == {"drafts": 5, "accepted": 11, "per_position": [4, 3, 2, 2]}


def test_vllm_acceptance_is_set_beside_a_real_runs_tau_by_prompt_and_set(second_workflow):
    acceptance = json.loads((second_workflow.results / "eval/acceptance.json").read_text())
    sets = list(dict.fromkeys(acceptance["per_prompt"]["sets"]))
    served, alone = served_like(acceptance, {sets[-1]: 1.1})
    record = compare(served, alone, acceptance, stop={2})

    assert record["per_prompt"]["ids"] == acceptance["per_prompt"]["ids"]
    for i, tau in enumerate(acceptance["per_prompt"]["methods"]["drafter"]["tau"]):
        scale = 1.1 if record["per_prompt"]["sets"][i] == sets[-1] else 1.0
        assert record["per_prompt"]["vllm"][i] == pytest.approx(tau * scale, abs=0.006)
    last = record["sets"][sets[-1]]
    assert last["diff_pct_macro"] == pytest.approx(10.0, abs=0.5)
    for name in sets[:-1]:
        assert record["sets"][name]["diff_pct_macro"] == pytest.approx(0.0, abs=0.5)
    assert record["identical_to_target_alone"] == 1.0
    assert record["tokens_per_s"]["1"]["speedup"] == pytest.approx(2.0)
    assert record["tokens_per_s"]["8"]["speedup"] == pytest.approx(1.5)
    assert record["tokens_per_s"]["32"]["speedup"] == pytest.approx(0.9)
    text = summary_section(record)
    assert f"| {sets[-1]} |" in text and "concurrency 32 0.90x" in text
    # as the report reads it back from vllm.json (keys sorted as text): still 1, 8, 32
    reread = json.loads(json.dumps(record, sort_keys=True))
    assert re.search("batch 1 .* concurrency 8 .* concurrency 32 ", summary_section(reread))
    # the run record keeps vLLM's acceptance length beside ours, its speedups with the speeds
    ddtree = json.loads((second_workflow.results / "eval/ddtree.json").read_text())
    summary = eval_summary(acceptance, ddtree, record)
    assert summary["quality"]["vllm"]["vllm_macro"] == record["acceptance_length"]["vllm_macro"]
    assert summary["speed"]["vllm_speedup"] == {"1": 2.0, "8": 1.5, "32": 0.9}
    assert "vllm" not in eval_summary(acceptance, ddtree)["quality"]

    # our drafter's τ on vLLM's own tokens (the walk): vLLM 10 % above it in the last set alone
    walked = acceptance["per_prompt"]["methods"]["drafter"]["tau"]
    record = compare(served, alone, acceptance, stop={2}, walked=walked)
    assert record["sets"][sets[-1]]["diff_pct_same_tokens"] == pytest.approx(10.0, abs=0.5)
    for name in sets[:-1]:
        assert record["sets"][name]["diff_pct_same_tokens"] == pytest.approx(0.0, abs=0.5)
    assert record["on_vllm_text"]["walked_prompts"] == len(walked)
    assert record["per_prompt"]["ours_on_vllm_text"] == walked
    assert "ours on vLLM's tokens" in summary_section(record)

    served["prompts"][0]["id"] = "not-a-prompt-of-this-run"
    with pytest.raises(UserError, match="not-a-prompt-of-this-run"):
        compare(served, alone, acceptance, stop={2})


def test_the_prompts_where_vllm_decoded_our_drafters_text_are_compared_apart():
    """vLLM's acceptance length beside ours only where both decoded the same tokens (vLLM
    returns the stop token, our digest leaves it out either way), and how often vLLM's target
    alone decoded our target's text."""
    stop = {2}
    ours_tokens = {"a": [5, 6, 7, 2], "b": [5, 6, 8], "c": [9, 9, 9, 9]}
    ours = {
        "ids": ["a", "b", "c"],
        "target": {"text": [text_digest(t, stop) for t in ([5, 6, 7], [5, 6, 8], [9, 9, 1])]},
        "methods": {
            "drafter": {
                "text": [text_digest(ours_tokens[i], stop) for i in "abc"],
                "tau": [2.0, 3.0, 4.0],
            }
        },
    }

    def row(pid, tokens, drafts, accepted):
        return {"id": pid, "tokens": tokens, "drafts": drafts, "accepted": accepted}

    rows = [row("a", [5, 6, 7], 2, 3), row("b", [5, 6, 8, 2], 1, 1), row("c", [9, 9, 3], 1, 3)]
    alone = [row("a", [5, 6, 7, 2], 0, 0), row("b", [5, 7], 0, 0), row("c", [9, 9, 1], 0, 0)]
    assert same_text(rows, alone, ours, stop) == {
        "prompts": 2,  # a and b; c parted from our drafter's text
        "of": 3,
        "vllm_macro": 2.25,  # (2.5 + 2.0) / 2
        "ours_macro": 2.5,
        "target_alone_same": 2,  # a and c
    }
    del ours["methods"]["drafter"]["text"]  # an acceptance.json from before the digests
    assert same_text(rows, alone, ours, stop) is None


def test_our_drafters_tau_on_vllms_answers_is_read_with_the_runs_target_and_drafter(
    second_workflow, trained_drafter
):
    """walk_served loads the run's target and drafter as the evaluation does and gives, on
    answers handed in (here our own decoding's, fp32, as vLLM's are its target's), the τ our
    decoding measured on them, prompt by prompt."""
    from dflash.eval.decode import DrafterProposer, generate
    from dflash.eval.sessions import target_session
    from dflash.model.drafter import load_drafter
    from dflash.model.target import load_target

    target = second_workflow.target / "hf"
    config = yaml.safe_load((second_workflow.workdir / "tiny.yaml").read_text())
    config["eval"].update(dtype="float32", device="cpu", max_new_tokens=24)
    model, drafter = load_target(target), load_drafter(trained_drafter)
    session = target_session(model, drafter.config.target_layer_ids)
    proposer = DrafterProposer(drafter, model.get_input_embeddings(), model.lm_head.weight)
    prompts = [[1, 2, 3, 4], [5, 6, 7, 8, 9, 10]]  # token ids: any prompt the target answers
    gens = [generate(session, proposer, ids, 24, set()) for ids in prompts]
    rows = [{"prompt_ids": p, "tokens": g.tokens} for p, g in zip(prompts, gens, strict=True)]
    args = SimpleNamespace(target=target, drafter=trained_drafter)
    taus = walk_served(args, config, rows)
    assert taus == [round(sum(g.accepted) / len(g.accepted), 4) for g in gens]


def test_eval_vllm_is_planned_alone_when_enabled_and_refused_without_vllm(
    second_workflow, tmp_path
):
    """Enabling vLLM adds eval_vllm to a run's plan and changes nothing else in it (not the
    evaluation it is compared with); where vLLM is not installed the stage stops with one clear
    message, whatever else is stale."""
    workdir = tmp_path / "work"
    # mtimes kept; the converted target (half a gigabyte) read where it is, not copied
    skip = shutil.ignore_patterns("resources")
    shutil.copytree(second_workflow.workdir, workdir, symlinks=True, ignore=skip)
    (workdir / "resources").symlink_to(second_workflow.workdir / "resources")
    flow = Workflow(second_workflow.repo, workdir)
    config = yaml.safe_load((workdir / "tiny.yaml").read_text())
    config["train"]["lr"] *= 2  # training stale, as after any change a user makes upstream
    (workdir / "stale.yaml").write_text(yaml.safe_dump(config))
    config["eval"]["vllm"] = {"enabled": True}
    (workdir / "vllm.yaml").write_text(yaml.safe_dump(config))
    before = flow.planned_jobs("all", *OVER, config="stale.yaml")
    assert {"train", "eval_acceptance", "eval_ddtree"} <= before.keys()
    dry = flow.run("-n", "all", *OVER, config="vllm.yaml").stdout
    assert jobs_in(dry) == {**before, "eval_vllm": 1}
    # the run record hashes what eval_vllm writes, as every other stage's outputs
    record_inputs = dry.split("rule record:")[1].split("output:")[0]
    assert "results/eval/vllm.json" in record_inputs
    assert "results/manifests/eval_vllm.json" in record_inputs
    # eval.vllm is not a param of the evaluation it is compared with
    changed = flow.run("--list-changes", "params", *OVER, config="vllm.yaml").stdout
    assert "eval/acceptance.json" not in changed and "eval/ddtree.json" not in changed
    done = flow.run(
        "eval_vllm", "--allowed-rules", "eval_vllm", *OVER, config="vllm.yaml", check=False
    )
    assert done.returncode != 0
    log = (workdir / "results/logs/eval_vllm.log").read_text()
    assert "vLLM is not installed here" in log and "eval.vllm.enabled: false" in log
    assert "Traceback" not in log


def test_vllms_acceptance_at_temperature_is_pooled_over_sets_and_seeds_beside_ours():
    """vLLM's counters at a temperature, per seed and set, pooled over seeds and set beside
    eval/sampling.json's pooled τ of the same rule (argmax drafts, or drafts drawn from the
    drafter)."""
    from dflash.eval.vllm_stage import compare_sampled

    served = {
        "greedy": [
            {"temperature": 1.0, "top_p": 1.0, "top_k": 0,
             "seeds": [{"a": {"drafts": 10, "accepted": 5}, "b": {"drafts": 20, "accepted": 2}},
                       {"a": {"drafts": 10, "accepted": 7}, "b": {"drafts": 20, "accepted": 6}}]}
        ],
        "probabilistic": [
            {"temperature": 1.0, "top_p": 1.0, "top_k": 0,
             "seeds": [{"a": {"drafts": 4, "accepted": 4}, "b": {"drafts": 4, "accepted": 0}}]}
        ],
    }  # fmt: skip
    ours = {
        "runs": [
            {"temperature": 1.0, "methods": {
                "drafter": {"overall": {"tau_pooled": 1.3},
                            "sets": {"a": {"tau_pooled": 1.5}, "b": {"tau_pooled": 1.25}}},
                "drafter/probabilistic": {"overall": {"tau_pooled": 1.5},
                                          "sets": {"a": {"tau_pooled": 2.0}}},
            }}
        ]
    }  # fmt: skip
    greedy, drawn = compare_sampled(served, ours)
    assert greedy["draft_rule"] == "greedy" and greedy["seeds"] == 2
    assert greedy["sets"]["a"]["vllm_pooled"] == 1.6  # 1 + 12 / 20
    assert greedy["sets"]["a"]["per_seed"] == [1.5, 1.7]
    assert greedy["sets"]["b"]["vllm_pooled"] == 1.2  # 1 + 8 / 40
    assert greedy["sets"]["a"]["diff_pct_pooled"] == round(100 * (1.6 - 1.5) / 1.5, 2)
    assert greedy["vllm_pooled"] == 1.3333 and greedy["diff_pct_pooled"] == 2.56
    assert drawn["sets"]["a"]["vllm_pooled"] == 2.0 and drawn["sets"]["b"]["ours_pooled"] is None


def test_at_temperature_only_one_engine_per_draft_rule_serves_and_the_summary_says_so(
    monkeypatch, tmp_path
):
    """eval.vllm.greedy: false: no target-alone engine and no greedy pass, each draft rule's
    engine serves eval.sampling's temperatures only, beside eval/sampling.json; without a
    temperature the stage refuses, naming the keys."""
    from dflash.config import ConfigError, check_levers, validate
    from dflash.eval import vllm_stage

    config = validate({"eval": {"vllm": {"greedy": False}, "sampling": {
        "temperatures": [1.0], "seeds": 1, "draft_rules": ["greedy", "probabilistic"]}}})  # fmt: skip
    specs = [{"temperature": 1.0, "top_p": 1.0, "top_k": 0, "seeds": 1}]
    request = {"dtype": "bfloat16", "max_new_tokens": 8, "prompts": [], "sampling_prompts": []}
    monkeypatch.setattr(vllm_stage, "vllm_installed", lambda: True)
    monkeypatch.setattr(  # the run's prompts and target: eval_vllm's own tests read a real run
        vllm_stage, "base_request",
        lambda args, config: (dict(request), specs if config["eval"]["sampling"]["temperatures"] else []),
    )  # fmt: skip
    asked = []

    def serve(req, folder, name):
        asked.append((name, req))
        accepted = 6 if req.get("draft_sample_method") == "probabilistic" else 3
        seed = {"a": {"drafts": 10, "accepted": accepted}}
        run = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "seeds": [seed]}
        return {"vllm": "0.24.0", "startup_s": 50.0, "sampled": [run]}

    monkeypatch.setattr(vllm_stage, "_serve", serve)
    ours = tmp_path / "sampling.json"
    ours.write_text(json.dumps({"runs": [{"temperature": 1.0, "methods": {
        "drafter": {"overall": {"tau_pooled": 1.25}, "sets": {"a": {"tau_pooled": 1.25}}}}}]}))  # fmt: skip
    out = tmp_path / "vllm.json"
    args = SimpleNamespace(config=config, acceptance=None, sampling=ours, output=out)
    vllm_stage.run(args)
    assert [name for name, _ in asked] == ["target with the drafter", vllm_stage.PROBABILISTIC]
    assert not any("drafter" in req and req["drafter"] is None for _, req in asked)  # no alone
    assert all(req["prompts_alone"] is False and req["sampling"] == specs for _, req in asked)
    record = json.loads(out.read_text())
    assert record["greedy"] is False and "acceptance_length" not in record
    greedy, drawn = record["sampled"]
    assert greedy["vllm_pooled"] == 1.3 and greedy["ours_pooled"] == 1.25
    assert drawn["vllm_pooled"] == 1.6 and drawn["ours_pooled"] is None
    text = summary_section(record)
    assert "at temperature only" in text and "1.3 pooled against ours 1.25 (+4.0 %)" in text
    # the run record (and so `dflash compare`) reads it without greedy figures
    acceptance = {"tau_macro": 1.5, "tau_pooled": 1.4, "baselines": {}, "tokens_per_s": 1,
                  "speedup": 1, "teacher_forced_tau": None, "lossless": True, "n_prompts": 1}  # fmt: skip
    summary = eval_summary(acceptance, {"results": [], "lossless": True}, vllm=record)
    assert summary["quality"]["vllm"] == {
        "version": "0.24.0", "sampled_pooled": {"T=1.0 greedy": 1.3, "T=1.0 probabilistic": 1.6}
    }  # fmt: skip
    assert "vllm_speedup" not in summary["speed"]
    config["eval"]["sampling"]["temperatures"] = []
    with pytest.raises(UserError, match="eval.sampling.temperatures is empty"):
        vllm_stage.run(args)
    # and before any job, where the workflow checks its config (dflash.preflight)
    with pytest.raises(ConfigError, match="eval.sampling.temperatures is empty"):
        check_levers(validate({"eval": {"vllm": {"greedy": False}}}))
    check_levers(validate({"eval": {"vllm": {"greedy": False, "enabled": False}}}))
