"""results/summary.md opens with what the user got: where the drafter is, the vLLM and SGLang
command lines for it, and a warning when its figures mean nothing (a degenerate target)."""

import json
import shlex

from dflash.data.tokenization import repetitive
from dflash.eval.handover import degenerate_warning, handover_text, serve_commands


def test_the_serve_commands_name_the_drafter_and_the_blocks_tokens():
    vllm, sglang = serve_commands("/models/my target", "results/drafter", 16)
    words = shlex.split(vllm)
    assert words[:3] == ["vllm", "serve", "/models/my target"]
    spec = json.loads(words[words.index("--speculative-config") + 1])
    assert spec == {"method": "dflash", "model": "results/drafter", "num_speculative_tokens": 15}
    words = shlex.split(sglang)
    assert words[words.index("--speculative-draft-model-path") + 1] == "results/drafter"
    assert words[words.index("--speculative-num-draft-tokens") + 1] == "16"
    assert "--speculative-algorithm" in words and "DFLASH" in words
    # SGLang 0.5.17 loads the drafter's class natively (run so on an H100, 2026-12-07)
    assert "--trust-remote-code" not in words


def test_the_opening_says_where_the_drafter_is_and_warns_only_when_degenerate():
    healthy = {"rows_out": 40, "repetitive_rows": 1}
    lines = handover_text("t", "results/drafter", 16, 2.4, healthy)
    assert lines[0].startswith("**Your drafter:** `results/drafter`")
    assert not any("Warning" in line for line in lines)
    degenerate = {"rows_out": 40, "repetitive_rows": 40}
    lines = handover_text("t", "results/drafter", 16, 15.5, degenerate)
    assert lines[0].startswith("**Warning: these figures mean nothing.**")
    assert "40 of 40 training rows loop over a few tokens" in lines[0]
    assert "τ 15.5 of 16" in lines[0]


def test_a_tau_near_the_block_size_warns_even_without_the_data_report():
    assert degenerate_warning(None, 7.5, 8) is not None
    assert degenerate_warning(None, 3.5, 16) is None


def test_a_loop_is_told_from_an_answer():
    mask = [0, 0] + [1] * 12
    assert repetitive([1, 2] + [7] * 12, mask)  # one token
    assert repetitive([1, 2] + [5, 9] * 6, mask)  # "lessnesslessness"
    assert not repetitive([1, 2] + list(range(12)), mask)
    assert not repetitive([1, 2, 7, 7], [0, 0, 1, 1])  # too short to say
