"""bench/paired.py: two runs' evaluations paired prompt by prompt (a lever against the recipe)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

PATH = Path(__file__).resolve().parents[1] / "bench/paired.py"
spec = importlib.util.spec_from_file_location("paired", PATH)
paired = importlib.util.module_from_spec(spec)
spec.loader.exec_module(paired)

IDS = ["h1", "h2", "h3", "81", "81#turn2"]
SETS = ["held_out", "held_out", "held_out", "mt_bench", "mt_bench"]


def run(folder: Path, taus, same=None, ids=IDS) -> Path:
    per_prompt = {
        "ids": ids,
        "sets": SETS[: len(ids)],
        "methods": {"drafter": {"tau": taus, "same": same or [True] * len(ids)}},
    }
    (folder / "eval").mkdir(parents=True)
    (folder / "eval/acceptance.json").write_text(json.dumps({"per_prompt": per_prompt}))
    return folder


def test_differences_are_paired_by_prompt_with_their_error(tmp_path, capsys):
    a = run(tmp_path / "recipe", [3.0, 2.0, 4.0, 2.0, 5.0])
    b = run(tmp_path / "dpace", [3.5, 2.0, 4.5, 2.5, 4.0])
    paired.main([str(a), str(b), "--json", str(tmp_path / "p.json")])
    rows = json.loads((tmp_path / "p.json").read_text())["drafter"]
    held = rows["held_out"]
    assert (held["n"], held["a"], held["b"], held["diff"]) == (3, 3.0, 3.3333, 0.3333)
    assert held["se"] == pytest.approx(0.1667, abs=1e-4)  # sd 0.2887 over 3 prompts
    assert (held["wins"], held["losses"]) == (2, 0)
    assert rows["mt_bench first turns"]["diff"] == 0.5
    assert (
        rows["mt_bench second turns"]["diff"] == -1.0
        and rows["mt_bench second turns"]["se"] is None
    )
    assert rows["all"]["n"] == 5 and rows["all"]["diff"] == pytest.approx(0.1, abs=1e-9)
    assert "| held_out | 3 | 3.000 | 3.333 | +0.333 | 0.167 | 2 / 0 |" in capsys.readouterr().out


def test_same_keeps_the_prompts_both_runs_decoded_as_the_target_and_ids_pair_whatever_the_order(
    tmp_path,
):
    a = run(tmp_path / "a", [3.0, 2.0, 4.0, 2.0, 5.0], same=[True, False, True, True, True])
    b = run(tmp_path / "b", [4.0, 3.0, 2.0, 2.0, 5.0][::-1], ids=IDS[::-1])
    b_record = json.loads((b / "eval/acceptance.json").read_text())
    b_record["per_prompt"]["sets"] = SETS[::-1]
    (b / "eval/acceptance.json").write_text(json.dumps(b_record))
    rows = paired.paired(paired.prompts(a, "drafter"), paired.prompts(b, "drafter"), same=True)
    # h1: 3 -> 4, h3: 4 -> 2; h2 left out (run a did not decode the target's text there)
    assert rows["held_out"]["n"] == 2 and rows["held_out"]["diff"] == -0.5
    assert rows["all"]["n"] == 4
