"""The summary's per-prompt line, on a hand-made `per_prompt` record of eval/acceptance.json, and
its first-step seconds."""

from dflash.eval.clock import busy_clocks, clock_caveats, probe_spread, same_prompt_speedups
from dflash.eval.fastest import fastest_text
from dflash.eval.report import _precision, _startup, per_prompt_text


def record(ids, sets, drafter, lookup, same=None) -> dict:
    same = same or [True] * len(ids)
    return {
        "per_prompt": {
            "ids": ids,
            "sets": sets,
            "methods": {
                "drafter": {"tau": drafter, "tokens": [9] * len(ids), "same": same},
                "lookup": {"tau": lookup, "tokens": [9] * len(ids), "same": [True] * len(ids)},
            },
        }
    }


def test_names_the_turns_where_lookup_wins_and_its_largest_leads():
    acc = record(
        ["a", "81", "81#turn2", "82", "82#turn2", "82#turn3", "b"],
        ["held_out", "mt_bench", "mt_bench", "mt_bench", "mt_bench", "mt_bench", "held_out"],
        drafter=[3.0, 2.0, 3.0, 2.5, 4.0, 5.0, None],  # b: no verify round, no τ
        lookup=[1.5, 1.5, 15.0, 2.0, 6.0, 2.0, 1.0],
        same=[True, True, True, True, False, True, True],  # 82#turn2: the drafter's text parted
    )
    text = per_prompt_text(acc)
    assert "lookup is ahead on 2 of 6 prompts (on 1 of them both decoded" in text
    # held-out prompts have one turn: only the set with later turns is split by turn
    assert "mt_bench τ macro drafter vs lookup, first turns: 2.25 vs 1.75 (2)" in text
    assert "later turns: 4.00 vs 7.67 (3)" in text and "held_out τ" not in text
    assert text.endswith("largest leads: 81#turn2 (15.00 vs 3.00), 82#turn2 (6.00 vs 4.00).")


def test_says_nothing_without_a_lookup_baseline_or_per_prompt_record():
    assert per_prompt_text({}) is None
    acc = record(["a"], ["held_out"], [2.0], [1.0])
    del acc["per_prompt"]["methods"]["lookup"]
    assert per_prompt_text(acc) is None
    one = per_prompt_text(record(["a"], ["held_out"], [2.0], [1.0]))
    assert "ahead on 0 of 1 prompts" in one and "largest leads" not in one


def test_first_step_seconds_say_where_they_went():
    # as read back from JSON: keys sorted, the text keeps the phases' order
    split = {"compile": 14.1, "imports": 6.2, "resume_and_live_view": 1.1, "setup": 9.4}
    text = _startup({"startup_s": 30.8, "compile_s": 14.1, "startup_split_s": split})
    assert text == (
        "; first step 31 s after the process started (imports 6.2 s, setup 9.4 s, "
        "resume and live view 1.1 s, compile 14.1 s)"
    )
    # a summary from before the split still reads
    old = _startup({"startup_s": 30.8, "compile_s": 14.1})
    assert old == "; first step 31 s after the process started, 14 s of it compiling"
    assert _startup({}) == ""


def test_a_clock_beside_other_work_is_named_in_the_summary():
    quiet = {"cpus": 16, "other_cpu_fraction": 0.01, "gpu_foreign_processes_max": 0}
    busy_cpu = {"cpus": 16, "other_cpu_fraction": 0.4}
    shared_gpu = {"cpus": 16, "other_cpu_fraction": 0.0, "gpu_foreign_processes_max": 1}
    acceptance = {"host": quiet, "baselines": {"target": {"host": quiet}, "lookup": {}}}
    ddtree = {"target_host": quiet, "results": [{"method": "chain", "host": quiet}]}
    assert busy_clocks(acceptance, ddtree) == ""  # quiet, or not sampled: nothing to say
    acceptance["baselines"]["lookup"]["host"] = busy_cpu
    ddtree["results"][0]["host"] = shared_gpu
    text = busy_clocks(acceptance, ddtree)
    assert text.startswith("**Clock caveat:**")
    assert "lookup (other processes used 40% of the 16 CPUs)" in text
    assert "DDTree chain (" in text and "1 other processes on the GPUs" in text
    assert "drafter (" not in text and "target (" not in text
    # methods that took turns under one host record are named together, the record once
    acceptance["host"] = acceptance["baselines"]["target"]["host"] = busy_cpu
    text = busy_clocks(acceptance, ddtree)
    assert "drafter, target, lookup (other processes used 40% of the 16 CPUs)" in text
    assert text.count("40%") == 1


def test_the_same_fixed_step_timed_differently_in_two_stages_is_named_in_the_summary():
    def probe(verify, drafter, fixed=2.6):
        out = {"live": {"verify_1_ms": 1.7, "verify_16_ms": verify, "drafter_round_ms": drafter}}
        return out | {"fixed": {"verify_16_ms": fixed, "drafter_round_ms": 0.3}}

    acceptance = {"block_size": 16, "clock_probe": probe(2.7, 0.31)}
    ddtree = {"clock_probe": probe(2.6, 0.3)}
    assert probe_spread(acceptance, ddtree) == ""  # within PROBE_TOLERANCE
    assert probe_spread({"block_size": 16}, {}) == ""  # records from before the probe
    acceptance["clock_probe"] = probe(4.9, 0.31, fixed=4.8)
    ddtree["clock_probe"] = probe(2.6, 0.3, fixed=2.55)
    text = probe_spread(acceptance, ddtree)
    assert text.startswith("**Clock caveat:** the same 16-token verify forward took 4.90 ms")
    assert "in the acceptance stage but 2.60 ms in DDTree's stage" in text
    assert "(on sessions of a fixed small cache: 4.80 and 2.55 ms)" in text
    assert "drafter round" not in text and "1-token" not in text  # those agreed
    quiet = {**ddtree, "results": [], "target_host": None}
    assert clock_caveats({**acceptance, "baselines": {}}, quiet) == [text]
    # probes from a CPU (no fixed-cache part) are recorded, not judged: too few repetitions
    cpu = {"live": acceptance["clock_probe"]["live"]}
    assert probe_spread({**acceptance, "clock_probe": cpu}, ddtree) == ""


def per_prompt(ids, target_s, method, method_s, texts=None):
    texts = texts or ["t"] * len(ids)
    return {
        "ids": ids,
        "sets": ["held_out"] * len(ids),
        "target": {"seconds": target_s, "text": ["r"] * len(ids)},
        "methods": {method: {"seconds": method_s, "text": texts}},
    }


def test_the_drafters_speedup_on_the_same_prompts_is_compared_across_the_stages():
    """The summary says whether the drafter's speedup agrees between the two stages on the
    prompts both decoded to the same text, each against its own stage's target clock."""
    acceptance = {"per_prompt": per_prompt(["a", "b", "c"], [2, 2, 9], "drafter", [1, 1, 1])}
    ddtree = {"per_prompt": per_prompt(["b", "a"], [2.1, 2.0], "chain", [1.0, 1.02])}
    text = same_prompt_speedups(acceptance, ddtree)
    assert text == (
        "**Clock check:** on the 2 prompts both stages decoded to the same text, the drafter's "
        "speedup over the target alone is 2.00x in the acceptance stage and 2.03x as DDTree's "
        "chain; they agree within 5%."
    )
    ddtree["per_prompt"]["methods"]["chain"]["seconds"] = [0.5, 0.5]  # twice as fast there
    assert "4.10x as DDTree's chain; they differ by more than 5%" in (
        same_prompt_speedups(acceptance, ddtree)
    )
    # On a CPU (probes without a fixed-cache part) a disagreement also says how much the same
    # fixed step varied between the stages' processes: context, whichever way it points.
    probe = {"verify_1_ms": 50.0, "verify_16_ms": 100.0, "drafter_round_ms": 30.0}
    acceptance["clock_probe"] = {"live": probe}
    ddtree["clock_probe"] = {"live": probe | {"verify_16_ms": 130.0}}
    assert same_prompt_speedups(acceptance, ddtree).endswith(
        "4.10x as DDTree's chain; they differ by more than 5%: the two stages' clocks disagree "
        "(on this CPU the machine itself was not steady: the same 16-token verify forward took "
        "100.0 ms in the acceptance stage and 130.0 ms in DDTree's stage)."
    )
    ddtree["clock_probe"] = {"live": probe | {"verify_16_ms": 105.0}}  # within 10 %: no context
    assert same_prompt_speedups(acceptance, ddtree).endswith("the two stages' clocks disagree.")
    ddtree["clock_probe"] = {"live": probe | {"verify_16_ms": 130.0}, "fixed": probe}  # a GPU
    assert same_prompt_speedups(acceptance, ddtree).endswith("the two stages' clocks disagree.")
    acceptance["clock_probe"] = {"live": probe, "fixed": probe}
    assert same_prompt_speedups(acceptance, ddtree).endswith("the two stages' clocks disagree.")
    ddtree["per_prompt"]["methods"]["chain"]["seconds"] = [1.0, 1.0]  # 2.05x: agree, no context
    assert same_prompt_speedups(acceptance, ddtree).endswith("they agree within 5%.")
    ddtree["per_prompt"]["methods"]["chain"]["seconds"] = [0.5, 0.5]
    ddtree["per_prompt"]["methods"]["chain"]["text"] = ["x", "t"]  # b decoded differently
    assert "on the 1 prompts" in same_prompt_speedups(acceptance, ddtree)
    ddtree["per_prompt"]["sets"] = ["mt_bench", "mt_bench"]  # the same ids in another set
    assert same_prompt_speedups(acceptance, ddtree) == ""
    assert same_prompt_speedups(acceptance, {}) == ""  # records without per-prompt clocks


def test_the_summary_counts_the_near_ties_that_only_float32_forgave():
    """A bf16 divergence past the margin that the target's float32 gap forgave is counted apart:
    a reader sees how often the judging forward's own rounding mattered."""
    tie = {"prompt": "a", "position": 3, "reference": 1, "speculative": 2, "gap": 0.25}
    rechecked = tie | {"prompt": "b", "gap": 1.0, "gap_float32": 0.12}
    acc = {"dtype": "bfloat16", "near_ties": {"drafter": [tie, rechecked], "lookup": [tie]}}
    assert _precision(acc) == (
        " (bfloat16; 3 outputs part from the target's own at a near tie,"
        " 1 of them by the target's float32 gap, rounding)"
    )
    acc["near_ties"] = {"drafter": [tie]}
    assert "float32 gap" not in _precision(acc) and "1 outputs part" in _precision(acc)
    assert _precision({"dtype": "float32"}) == " (float32: outputs equal token for token)"


def test_the_fastest_method_is_named_overall_and_per_set_with_who_serves_it():
    """The 2-epoch recipe drafter's H100 figures (2026-12-06): prompt lookup led the chain on every
    set; on a set where the chain leads, it is named alone."""
    sets = {"gsm8k": 763.95, "mt_bench": 676.34}
    target = {"gsm8k": 573.74, "mt_bench": 573.81}
    lookup = {"gsm8k": 1199.0, "mt_bench": 500.0}
    branch = {"gsm8k": 900.0, "mt_bench": 600.0}
    acceptance = {
        "speedup": 1.201,
        "sets": {k: {"tokens_per_s": v} for k, v in sets.items()},
        "baselines": {"lookup": {"speedup": 2.007}, "drafter+lookup": {"speedup": 1.497},
                      "untrained": {"speedup": 0.9}, "target": {"speedup": 1.0}},
        "baseline_sets": {name: {k: {"tokens_per_s": v} for k, v in rates.items()}
                          for name, rates in (("target", target), ("lookup", lookup),
                                              ("drafter+lookup", branch))},
    }  # fmt: skip
    text = fastest_text(acceptance)
    assert "prompt lookup, 2.01x over all prompts (the chain 1.20x, the drafter + lookup branch " \
        "1.50x); it is nearest to vLLM's `ngram` method." in text  # fmt: skip
    assert "gsm8k prompt lookup 2.09x (the chain 1.33x)" in text
    assert "mt_bench the chain 1.18x." in text and "untrained" not in text
    # the chain alone beside the target: nothing to choose between
    alone = {**acceptance, "baselines": {"target": {"speedup": 1.0}}}
    assert fastest_text(alone) is None
