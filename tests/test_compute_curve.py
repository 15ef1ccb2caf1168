"""`dflash-train compute-curve`: τ against training tokens over several runs' results folders."""

import json

from dflash.cli import main


def fake_run(folder, rows, steps, tau_sims, tau, lookup):
    """A results folder as training, the evaluation and expand leave it: two drafters, 1,000 and
    500 tokens a step, tau_sim logged at the given steps."""
    (folder / "train").mkdir(parents=True)
    lines = []
    for step in range(1, steps + 1):
        line = {
            "step": step,
            "loss": 5.0,
            "drafters": [{"tokens": 1000, "wall_s": 0.5}, {"tokens": 500, "wall_s": 0.25}],
        }
        if step in tau_sims:
            line |= {"tau_sim": tau_sims[step], "tau_sim_first": tau_sims[step] - 0.1}
        lines.append(json.dumps(line))
    (folder / "train/metrics.jsonl").write_text("\n".join(lines) + "\n")
    (folder / "eval").mkdir()
    acceptance = {
        "tau_macro": tau,
        "sets": {"held_out": {"tau_macro": tau + 0.25}, "gsm8k": {"tau_macro": tau - 0.25}},
        "baselines": {"lookup": {"tau_macro": lookup}},
    }
    (folder / "eval/acceptance.json").write_text(json.dumps(acceptance))
    (folder / "data/expanded").mkdir(parents=True)
    (folder / "data/expanded/report.json").write_text(json.dumps({"train_rows": rows}))
    return folder


def test_two_data_sizes_give_a_table_a_plot_and_the_curves(tmp_path, capsys):
    quarter = fake_run(tmp_path / "quarter", 4832, 4, {2: 2.0, 4: 2.5}, 2.6, 2.8)
    whole = fake_run(tmp_path / "whole", 19328, 8, {4: 2.7, 8: 3.4}, 3.3, 2.8)
    out = tmp_path / "curve"
    assert main(["compute-curve", str(quarter), str(whole), "--out", str(out)]) == 0
    record = json.loads((out / "compute_curve.json").read_text())
    a, b = record["runs"]
    assert a["name"] == "quarter" and a["train_rows"] == 4832 and a["steps"] == 4
    # tokens seen by each logged step: 1,500 a step, both drafters
    assert [(p["step"], p["tokens"], p["tau_sim"]) for p in a["curve"]] == [
        (2, 3000, 2.0),
        (4, 6000, 2.5),
    ]
    assert b["tokens"] == 12000 and b["train_s"] == 4.0  # each step's slowest drafter
    assert b["tau"] == 3.3 and b["tau_sets"] == {"held_out": 3.55, "gsm8k": 3.05}
    assert b["lookup_tau"] == 2.8
    table = (out / "compute_curve.md").read_text()
    assert "| quarter | 4,832 | 4 | 0.0 | 2 | 2.500 | 2.400 | 2.600 | 2.350 | 2.850 | 2.800 |" in (
        table
    )
    assert "| 8 | 0.01 | 3.400 | 3.300 |" in table  # the whole run's curve
    assert (out / "compute_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| whole | 19,328 |" in capsys.readouterr().out


def test_a_folder_without_metrics_is_named(tmp_path, capsys):
    assert main(["compute-curve", str(tmp_path), "--out", str(tmp_path / "o")]) == 1
    assert f"{tmp_path} has no train/metrics.jsonl" in capsys.readouterr().err


def test_a_run_still_training_is_read_from_its_live_metrics(tmp_path):
    run = fake_run(tmp_path / "live", 10, 2, {2: 1.5}, 1.0, 1.0)
    live = run / "checkpoints/run-abc/metrics.live.jsonl"
    live.parent.mkdir(parents=True)
    (run / "train/metrics.jsonl").rename(live)
    out = tmp_path / "o"
    assert main(["compute-curve", str(run), "--name", "going", "--out", str(out)]) == 0
    (going,) = json.loads((out / "compute_curve.json").read_text())["runs"]
    assert going["name"] == "going" and going["curve"][0]["tau_sim"] == 1.5
