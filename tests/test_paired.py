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


def test_runs_at_temperature_are_paired_by_prompt_over_the_mean_of_their_seeds(tmp_path, capsys):
    def sampled(name: str, seeds: list[list[float]]) -> Path:
        per_prompt = {"ids": IDS[:3], "sets": SETS[:3], "drafter": seeds}
        runs = [{"label": "T=1", "temperature": 1.0, "per_prompt": per_prompt}]
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps({"runs": runs}))
        return path

    a = sampled("greedy-data", [[1.0, 1.2], [1.4, 1.4], [1.0, 1.0]])
    b = sampled("sampled-data", [[1.3, 1.5], [1.2, 1.2], [1.2, 1.4]])
    paired.main([str(a), str(b), "--json", str(tmp_path / "p.json")])
    rows = json.loads((tmp_path / "p.json").read_text())["drafter at T=1"]
    # per prompt, the mean over seeds: 1.1 -> 1.4, 1.4 -> 1.2, 1.0 -> 1.3
    assert rows["held_out"]["n"] == 3 and rows["held_out"]["diff"] == pytest.approx(
        0.1333, abs=1e-4
    )
    assert (rows["held_out"]["wins"], rows["held_out"]["losses"]) == (2, 1)
    assert "drafter at T=1: sampled-data.json - greedy-data.json" in capsys.readouterr().out
