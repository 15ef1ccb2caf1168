"""`dflash compare` on small hand-made records: what counts as a cause, and how much."""

from dflash.compare import compare, render


def record(**parts) -> dict:
    base = {
        "_name": "run",
        "code": {"files": {"dflash/train/loop.py": "a", "dflash/compare/causes.py": "a"}},
        "stages": {"train": {"code_files": ["dflash/train/loop.py"]}},
        "environment": {"torch": "2.13.0", "packages": {"torch": "2.13.0"}},
        "config": {"compile": {"enabled": True}, "train": {"lr": 1e-3}},
        "topology": {"targets": 1, "drafters": 1},
        "train": {"throughput": {"tokens_per_s": 1000.0}},
    }
    return base | parts


def test_an_edit_no_stage_ran_ranks_below_a_training_config_change():
    b = record(
        code={"files": {"dflash/train/loop.py": "a", "dflash/compare/causes.py": "b"}},
        config={"compile": {"enabled": False}, "train": {"lr": 1e-3}},
        train={"throughput": {"tokens_per_s": 600.0}},
    )
    result = compare(record(), b)
    assert [c["kind"] for c in result["causes"]] == ["config", "code"]
    assert "compile.enabled: True → False" in render(result)  # not "1 → 0 (-100 %)"


def test_what_one_side_did_not_record_is_not_a_cause():
    older = record()
    del older["environment"], older["topology"]  # a results folder from an older version
    assert compare(older, record())["causes"] == []


def host(other_cpu: float, samples: int = 600, **gpu) -> dict:
    return {"cpus": 2, "other_cpu_fraction": other_cpu, "other_cpu_samples": samples,
            "gpu_throttle": [], **gpu}  # fmt: skip


def throughput(tokens_per_s: float, host_record: dict) -> dict:
    return {"throughput": {"tokens_per_s": tokens_per_s, "host": host_record}}


def test_a_busier_host_explains_a_slowdown_and_noise_or_a_quieter_host_does_not():
    a = record(train=throughput(1000.0, host(0.05)))
    assert compare(a, record(train=throughput(1010.0, host(0.2))))["causes"] == []
    (verdict,) = compare(a, record(train=throughput(480.0, host(0.8))))["most_likely"]
    assert verdict["cause"] == "host"
    assert verdict["summary"] == "CPU time used by other processes 5% → 80%"
    # B is slower with an edited training module, on a host quieter than A's: the code is blamed
    busy = record(train=throughput(1000.0, host(0.8)))
    edited = record(
        code={"files": {"dflash/train/loop.py": "b", "dflash/compare/causes.py": "a"}},
        train=throughput(500.0, host(0.05)),
    )
    assert [c["kind"] for c in compare(busy, edited)["causes"]] == ["code", "host"]


def test_a_few_seconds_of_cpu_samples_are_no_evidence_of_a_busier_host():
    """A run of a few steps samples the CPUs one to three times: whatever else started then is
    not the host's load (two 3-step test runs read 0 % and 43 % on one machine). The busier run
    needs 5 samples; a quiet one may be short."""
    quiet = record(train=throughput(1000.0, host(0.0, samples=2)))
    assert compare(quiet, record(train=throughput(600.0, host(0.43, samples=3))))["causes"] == []
    (verdict,) = compare(quiet, record(train=throughput(600.0, host(0.43, samples=11))))[
        "most_likely"
    ]
    assert verdict["summary"] == "CPU time used by other processes 0% → 43%"


def test_gpu_throttling_and_a_foreign_process_are_host_causes():
    a = record(train=throughput(1000.0, host(0.05, gpu_sm_clock_fraction=0.98)))
    a["train"]["throughput"]["host"]["gpu_foreign_processes_max"] = 0
    hot = host(0.05, gpu_sm_clock_fraction=0.7, gpu_throttle=["thermal (hardware)"])
    hot["gpu_foreign_processes_max"] = 1
    (cause,) = compare(a, record(train=throughput(700.0, hot)))["causes"]
    assert cause["kind"] == "host"
    assert cause["details"] == [
        "GPU SM clock 98% → 70% of its maximum (median)",
        "GPU throttling none → thermal (hardware)",
        "other processes on the GPUs 0 → 1",
    ]


def evaluated(tau: float, reference: str, dtype: str = "bfloat16") -> dict:
    quality = {"tau_macro": {"drafter": tau}, "reference_sha256": reference, "dtype": dtype}
    return {"quality": quality}


def test_a_tau_change_on_other_reference_text_says_so():
    """Two bf16 evaluations whose target decoded different text judged on different prompts'
    continuations: the τ effect names it; with the same reference text it does not."""
    a = record(eval=evaluated(3.0, "aa"))

    def tau_effect(b):
        (effect,) = [e for e in compare(a, b)["effects"] if e["metric"] == "tau"]
        return effect

    tau = tau_effect(record(eval=evaluated(2.8, "bb")))
    assert tau["change_pct"] == -6.7
    assert any("target's own greedy output differs" in e for e in tau["evidence"])
    same = tau_effect(record(eval=evaluated(2.8, "aa")))
    assert not any("greedy output" in e for e in same["evidence"])


def test_a_cold_compile_cache_is_named_and_a_warm_jitter_is_not():
    warm = record(train={"throughput": {"tokens_per_s": 1000.0, "compile_s": 4.0}})
    cold = record(train={"throughput": {"tokens_per_s": 1000.0, "compile_s": 59.0}})
    (effect,) = [e for e in compare(warm, cold)["effects"] if e["metric"] == "compile"]
    assert (effect["a"], effect["b"]) == (4.0, 59.0)
    assert len(effect["evidence"]) == 1  # no startup seconds recorded
    assert "compile cache cold" in effect["evidence"][0]
    for r, seconds in ((warm, 12.0), (cold, 70.0)):
        r["train"]["throughput"]["startup_s"] = seconds
    (effect,) = [e for e in compare(warm, cold)["effects"] if e["metric"] == "compile"]
    assert effect["evidence"][1] == "first step 12 s → 70 s after the process started"
    assert "compile cache" in render(compare(warm, cold))
    jitter = record(train={"throughput": {"tokens_per_s": 1000.0, "compile_s": 6.0}})
    assert not [e for e in compare(warm, jitter)["effects"] if e["metric"] == "compile"]
