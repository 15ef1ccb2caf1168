"""Training under torchrun with real gloo processes: routing, determinism, resume, failure."""

import json
import os
import random
import re
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import polars as pl
import pytest
from conftest import alone_on_this_host

from dflash.compare import compare
from dflash.data.batching import bucket_bounds, plan_epoch
from dflash.io import sha256_file
from dflash.record import train_summary
from dflash.train import launch as launch_command
from dflash.train.checkpoint import PATTERN
from dflash.train.topology import Topology

pytestmark = pytest.mark.slow

DATA = {"buckets": [32, 64], "max_length": 96, "token_budget": 128, "max_batch_size": 2}
CONFIG = {
    "seed": 0,
    "target": {"mask_token_id": 3},
    "drafter": {"num_layers": 1, "block_size": 8, "max_anchors": 4},
    "compile": {"enabled": False},
    "data": DATA,
    "train": {
        "epochs": 2,
        "checkpoint_every": 1,
        # Enough for the corrupt-checkpoint test (it resumes from 4 steps before the end);
        # every step's 45 MB checkpoint would make the suite write gigabytes.
        "keep_checkpoints": 5,
        "lr": 1e-3,
        "timeout_s": 20,
    },
}


@pytest.fixture(scope="module")
def data(tiny_workflow, tmp_path_factory) -> Path:
    """11 rows (the tiny workflow's 8 tokenized rows, 3 of them twice): 9 batches per epoch, an
    odd count, so that 2 drafters leave an epoch's last batch out (Topology.usable)."""
    tokenized = tiny_workflow.results / "data/tokenized"
    rows = pl.concat([pl.read_parquet(tokenized / f"{s}.parquet") for s in ("train", "eval")])
    path = tmp_path_factory.mktemp("data") / "train.parquet"
    pl.concat([rows] * (11 // rows.height + 1)).head(11).write_parquet(path)
    lengths = pl.read_parquet(path)["length"].to_list()
    bounds = bucket_bounds(DATA["buckets"], DATA["max_length"])
    for epoch in range(2):  # odd: 2 drafters leave a batch out
        assert len(plan_epoch(lengths, bounds, DATA["token_budget"], 2, 0, epoch)) % 2 == 1
    return path


def config(targets: int, drafters: int, **train) -> dict:
    c = json.loads(json.dumps(CONFIG))
    c["train"] |= {"topology": {"targets": targets, "drafters": drafters}} | train
    return c


def launch(cfg: dict, data: Path, target: Path, out: Path, torchrun: bool = True, env=None):
    """`dflash train` under the train rule's torchrun command for one node (its own session, so
    the test can kill the whole run)."""
    topo = cfg["train"]["topology"]
    world = topo["targets"] + topo["drafters"]
    train = {"nnodes": 1, "rdzv_endpoint": None} | cfg["train"]
    launcher = launch_command.torchrun(train, world) if torchrun else [sys.executable]
    cmd = [*launcher, "-m", "dflash", "train"]
    cmd += ["--config", json.dumps(cfg), "--target", str(target), "--data", str(data)]
    cmd += ["--out", str(out / "drafter"), "--metrics", str(out / "metrics.jsonl")]
    cmd += ["--summary", str(out / "summary.json"), "--checkpoints", str(out / "ckpt")]
    env = os.environ | {"OMP_NUM_THREADS": "1"} | (env or {})
    return subprocess.Popen(
        cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env,
        start_new_session=True,
    )  # fmt: skip


def finish(run) -> str:
    err = run.communicate(timeout=600)[1]
    assert run.returncode == 0, err[-4000:]
    return err


def run_dir(out: Path) -> Path:
    """The one run folder under the checkpoints (named by the run's contract)."""
    (folder,) = (out / "ckpt").glob("run-*")
    return folder


def weights(out: Path) -> str:
    return sha256_file(out / "drafter/model.safetensors")


def steps(out: Path) -> list[dict]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [
        {k: r[k] for k in ("step", "epoch", "batch", "loss", "tau")} for r in map(json.loads, lines)
    ]


# First in the file: its quiet run waits for the other worker's current test to end, and early in
# the session that is a short one, not the second full run (it waited 230 s for that in CI, when it
# came after this module's `runs`); it needs no module fixture but the data.
@pytest.mark.quiet_host
def test_a_busy_host_is_named_as_the_cause_of_slower_training(data, target_dir, tmp_path):
    """The same colocated run with other processes busy on every CPU: same weights, lower
    throughput, and compare blames the host, from what the training itself sampled. The quiet
    run is made here, alone on the machine, not taken from the module's runs; the busy run goes
    beside the other xdist worker's tests, as beside another user's jobs."""
    quiet, busy = tmp_path / "quiet", tmp_path / "busy"
    quiet.mkdir()
    busy.mkdir()
    with alone_on_this_host():
        finish(launch(config(0, 1), data, target_dir, quiet, torchrun=False))
    run = launch(config(0, 1), data, target_dir, busy, torchrun=False)
    deadline = time.time() + 300
    while not list(busy.glob("ckpt/run-*")):  # imports and loading done: training begins
        assert run.poll() is None and time.time() < deadline, run.stderr.read()[-3000:]
        time.sleep(0.05)
    # Each burner in its own session, as another user's job would be: the kernel shares CPUs
    # fairly between sessions (autogroup), so burners in the test's own session barely slow a
    # run that sits in a session of its own.
    burners = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
        for _ in range(2 * (os.cpu_count() or 1))
    ]
    try:
        finish(run)
    finally:
        for burner in burners:
            burner.kill()
            burner.wait()
    assert weights(busy) == weights(quiet)
    (verdict,) = compare(train_record(quiet), train_record(busy))["most_likely"]
    assert verdict["effect"] == "throughput" and verdict["change_pct"] < -5, verdict
    assert verdict["cause"] == "host", verdict
    assert verdict["summary"].startswith("CPU time used by other processes"), verdict


@pytest.fixture(scope="module")
def runs(data, target_dir, tmp_path_factory) -> dict:
    """One finished run per topology (targets, drafters); (0, 1) runs without torchrun."""
    done = {}
    for topo in [(1, 1), (1, 2), (2, 1), (0, 1), (0, 2)]:
        out = tmp_path_factory.mktemp(f"run-{topo[0]}-{topo[1]}")
        finish(launch(config(*topo), data, target_dir, out, torchrun=topo != (0, 1)))
        done[topo] = out
    return done


@pytest.mark.parametrize("topo", [(1, 1), (1, 2), (2, 1), (0, 1), (0, 2)])
def test_every_rank_handles_exactly_its_routed_batches(runs, data, topo):
    out, topology = runs[topo], Topology(*topo)
    lengths = pl.read_parquet(data)["length"].to_list()
    bounds = bucket_bounds(DATA["buckets"], DATA["max_length"])
    for rank in range(topology.world):
        events = [json.loads(x) for x in (run_dir(out) / f"telemetry/rank{rank}.jsonl").open()]
        for epoch in range(2):
            n = len(plan_epoch(lengths, bounds, DATA["token_budget"], 2, 0, epoch))
            got = [e for e in events if e["epoch"] == epoch]
            expected = [
                i for i in range(n - n % topo[1]) if i % topo[1] == rank - topo[1] * (rank >= topo[1])
            ] if topology.role(rank)[0] == "drafter" else [
                i for i in range(n - n % topo[1]) if i % topo[0] == rank - topo[1]
            ]  # fmt: skip
            assert [e["batch"] for e in got] == expected, (rank, epoch)
            for e in got:  # drafter d hears batch i from target i % T (itself when colocated)
                if "src" in e:
                    want = rank if topology.colocated else topo[1] + e["batch"] % topo[0]
                    assert e["src"] == want
                else:
                    assert e["dst"] == e["batch"] % topo[1]
                    assert 1 <= e["queue_depth"] <= 2


def test_weights_depend_on_the_drafter_count_only(runs):
    one = {weights(runs[t]) for t in [(1, 1), (2, 1), (0, 1)]}
    two = {weights(runs[t]) for t in [(1, 2), (0, 2)]}
    assert len(one) == 1 and len(two) == 1 and one != two


def test_distillation_trains_alike_from_a_separate_target_rank_and_a_colocated_one(
    runs, data, target_dir, tmp_path
):
    """With train.distill the target's output travels with the features to a drafter rank:
    the weights equal the colocated run's, and differ from the run without distillation."""
    outs = []
    for topo in [(1, 1), (0, 1)]:
        out = tmp_path / f"{topo[0]}-{topo[1]}"
        finish(launch(config(*topo, distill=0.5), data, target_dir, out, torchrun=topo != (0, 1)))
        outs.append(out)
    assert weights(outs[0]) == weights(outs[1]) != weights(runs[(1, 1)])
    contract = json.loads(next((run_dir(outs[0])).glob("step-*/meta.json")).read_text())
    assert contract["contract"]["train"]["distill"] == 0.5


def test_tensorboard_shows_every_step_of_the_run(runs):
    """Live curves: the run's event files hold the loss, τ and lr of every logged step."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    for topo in [(1, 1), (0, 1)]:
        board = EventAccumulator(str(run_dir(runs[topo]) / "tensorboard"))
        board.Reload()
        logged = steps(runs[topo])
        loss = board.Scalars("train/loss")
        assert [e.step for e in loss] == [r["step"] for r in logged]
        # event files hold float32
        assert [e.value for e in loss] == pytest.approx([r["loss"] for r in logged], rel=1e-6)
        assert {"train/tau_teacher_forced", "train/lr", "throughput/tokens_per_s"} <= set(
            board.Tags()["scalars"]
        )


# Loaded by the training process (sitecustomize on PYTHONPATH): its 6th target forward raises,
# after 5 steps were logged and checkpointed.
FAILING_TARGET = """
import dflash.train.features as features
queue = features.FeatureModel.queue
calls = []
def failing(self, *args, **kwargs):
    calls.append(1)
    if len(calls) == 6:
        raise RuntimeError("injected failure")
    return queue(self, *args, **kwargs)
features.FeatureModel.queue = failing
"""


def test_mlflow_true_without_a_tracking_uri_fails_before_training(data, target_dir, tmp_path):
    env = {"MLFLOW_TRACKING_URI": ""}
    run = launch(config(0, 1, mlflow=True), data, target_dir, tmp_path, torchrun=False, env=env)
    err = run.communicate(timeout=300)[1]
    assert run.returncode != 0
    assert "train.mlflow: true, but MLFLOW_TRACKING_URI is missing" in err
    assert not (tmp_path / "drafter").exists()


def wandb_records(path: Path):
    """The records of a W&B run file (`run-<id>.wandb`): a header, then LevelDB-log blocks of
    32 KiB whose chunks (crc32, length, type: 1 full, 2 first, 3 middle, 4 last) hold protobuf
    `Record`s."""
    from wandb.proto import wandb_internal_pb2

    data, pos, pending = path.read_bytes(), 7, b""
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if (left := 32768 - pos % 32768) < 7:  # a block's tail too short for a chunk header
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def wandb_run(folder: Path) -> dict:
    """What an offline W&B run folder holds: its id, name, config, logged steps, exit code."""
    (file,) = folder.glob("run-*.wandb")
    run = {"history": {}, "config": {}}
    for record in wandb_records(file):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run["id"], run["name"] = record.run.run_id, record.run.display_name
            run["project"] = record.run.project
            run["config"] |= {i.key: json.loads(i.value_json) for i in record.run.config.update}
        elif kind == "config":
            run["config"] |= {i.key: json.loads(i.value_json) for i in record.config.update}
        elif kind == "history":
            items = {
                i.key or "/".join(i.nested_key): json.loads(i.value_json)
                for i in record.history.item
            }
            run["history"][items["_step"]] = items
        elif kind == "exit":
            run["exit_code"] = record.exit.exit_code
    return run


def test_mlflow_and_wandb_log_every_step_and_a_resumed_run_continues_the_same_runs(
    runs, data, target_dir, tmp_path, monkeypatch
):
    """With MLFLOW_TRACKING_URI set (train.mlflow: auto) and WANDB_MODE=offline (train.wandb:
    auto), one training run logs to both, no network needed: its config and every step's curves.
    A run that fails is FAILED in MLflow and ends its W&B run with exit code 1; the rerun resumes
    into the same MLflow run (FINISHED at the end) and the same W&B run (same id), and between
    them the two attempts log every step an uninterrupted run logs."""
    import mlflow

    store = f"file://{tmp_path / 'mlruns'}"
    home = tmp_path / "wandb-home"  # W&B's settings, cache and artifacts: not the user's
    env = {"MLFLOW_TRACKING_URI": store, "MLFLOW_ALLOW_FILE_STORE": "true"}
    env |= {"WANDB_MODE": "offline", "WANDB_DIR": ""} | {
        f"WANDB_{k}_DIR": str(home / k) for k in ("CONFIG", "CACHE", "DATA", "ARTIFACT")
    }
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # this test's own client reads it too
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(FAILING_TARGET)
    path = os.pathsep.join(filter(None, [str(hook), os.environ.get("PYTHONPATH")]))
    out = tmp_path / "run"
    failed = launch(
        config(0, 1), data, target_dir, out, torchrun=False, env=env | {"PYTHONPATH": path}
    )
    err = failed.communicate(timeout=600)[1]
    assert failed.returncode != 0 and "injected failure" in err
    client = mlflow.MlflowClient(store)
    (experiment,) = [e for e in client.search_experiments() if e.name == "dflash"]
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.status == "FAILED"
    assert run.data.params["train.lr"] == "0.001" and run.info.run_name == run_dir(out).name
    before = [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")]
    assert before == [1, 2, 3, 4, 5]

    err = finish(launch(config(0, 1), data, target_dir, out, torchrun=False, env=env))
    assert "resumed from" in err
    logged = steps(out)
    # the resumed run logs what an uninterrupted one does
    assert logged == steps(runs[(0, 1)])

    (again,) = client.search_runs([experiment.experiment_id])
    assert again.info.run_id == run.info.run_id and again.info.status == "FINISHED"
    loss = client.get_metric_history(run.info.run_id, "train/loss")
    assert [m.step for m in loss] == [r["step"] for r in logged]
    assert [m.value for m in loss] == pytest.approx([r["loss"] for r in logged])

    first, second = (wandb_run(f) for f in sorted((run_dir(out) / "wandb").glob("offline-run-*")))
    assert first["id"] == second["id"] == (run_dir(out) / "wandb_run_id").read_text()
    assert first["name"] == run_dir(out).name and first["project"] == "dflash"
    assert first["config"]["train"]["lr"] == 0.001 and first["config"]["seed"] == 0
    assert (first["exit_code"], second["exit_code"]) == (1, 0)
    assert sorted(first["history"]) == [1, 2, 3, 4, 5]
    history = first["history"] | second["history"]
    assert sorted(history) == [r["step"] for r in logged]
    assert [history[r["step"]]["train/loss"] for r in logged] == pytest.approx(
        [r["loss"] for r in logged]
    )
    assert {"train/tau_teacher_forced", "train/lr", "acceptance_per_slot/01"} <= set(history[1])


def test_wandb_true_without_wandb_settings_fails_before_training(data, target_dir, tmp_path):
    env = {"WANDB_MODE": "", "WANDB_PROJECT": ""}
    run = launch(config(0, 1, wandb=True), data, target_dir, tmp_path, torchrun=False, env=env)
    err = run.communicate(timeout=300)[1]
    assert run.returncode != 0
    assert "train.wandb: true, but WANDB_PROJECT or WANDB_MODE is missing" in err
    assert not (tmp_path / "drafter").exists()


def test_same_topology_twice_gives_identical_weights(runs, data, target_dir, tmp_path):
    finish(launch(config(1, 2), data, target_dir, tmp_path))
    assert weights(tmp_path) == weights(runs[(1, 2)])
    assert steps(tmp_path) == steps(runs[(1, 2)])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def node_of(torchrun_stderr: str) -> tuple:
    """(node rank, node count, global ranks there), from the rendezvous result torchrun logs."""
    keys = ("group_rank", "group_world_size", "global_ranks")
    return tuple(
        json.loads(re.search(rf"\s{k}=(\S+)$", torchrun_stderr, flags=re.M).group(1)) for k in keys
    )


@pytest.mark.parametrize("topo", [(1, 1), (0, 2)])
def test_two_nodes_meeting_at_a_c10d_endpoint_train_the_single_node_weights(
    runs, data, target_dir, tmp_path, topo
):
    """Two torchruns on this host, each a node started with the train rule's per-node command,
    meet at a c10d endpoint on localhost. The ranks split over them (1+1: features cross nodes;
    0+2: the drafters' all-reduce does), and the steps and weights are the single-node run's."""
    cfg = config(*topo, nnodes=2, rdzv_endpoint=f"localhost:{free_port()}")
    env = {"LOGLEVEL": "INFO"}  # torchrun then logs each node's rendezvous result
    nodes = [launch(cfg, data, target_dir, tmp_path, env=env) for _ in range(2)]
    try:
        with ThreadPoolExecutor(len(nodes)) as pool:
            errs = list(pool.map(finish, nodes))  # both at once: neither blocks on a full pipe
    finally:
        for node in nodes:
            if node.poll() is None:
                os.killpg(node.pid, signal.SIGKILL)
    assert sorted(map(node_of, errs)) == [(0, 2, [0]), (1, 2, [1])]  # one rank per node
    assert steps(tmp_path) == steps(runs[topo])
    assert weights(tmp_path) == weights(runs[topo])


def test_telemetry_names_links_roles_and_the_bottleneck(runs):
    records = [json.loads(x) for x in (runs[(2, 1)] / "metrics.jsonl").open()]
    assert set().union(*(r["queue_depth"] for r in records)) == {"t0->d0", "t1->d0"}
    record = records[-1]
    assert len(record["drafters"]) == 1 and record["targets"][0]["tokens_per_s"] > 0
    assert set(record["time_s"]) == {"wait", "features", "forward", "backward", "optimizer"}
    summary = json.loads((runs[(2, 1)] / "summary.json").read_text())
    assert summary["bottleneck"] in {"targets", "drafters"} and summary["bottleneck_factor"] >= 1
    # the run's optimizer steps, not the steady ones its rates average (the first left out)
    assert summary["steps"] == records[-1]["step"] == summary["rate_steps"] + 1
    colocated = json.loads((runs[(0, 2)] / "summary.json").read_text())
    assert colocated["bottleneck"] == "colocated"


def train_record(out: Path) -> dict:
    """The training part of a run record, from one run's summary and metrics."""
    summary = json.loads((out / "summary.json").read_text())
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").open()]
    return {"_name": str(out), "train": train_summary(summary, metrics)}


def wait_for(out: Path, step: int, run, seconds: float = 300) -> None:
    """Until a checkpoint of `step` or later exists in some run folder under out/ckpt."""
    deadline = time.time() + seconds
    while all(
        int(m.group(1)) < step
        for m in (PATTERN.match(p.name) for p in out.glob("ckpt/run-*/step-*"))
        if m
    ):
        assert run.poll() is None, run.stderr.read()[-3000:]
        assert time.time() < deadline, f"checkpoint {step} never appeared"
        time.sleep(0.05)


def test_sigkill_then_rerun_gives_identical_weights(runs, data, target_dir, tmp_path):
    expected = steps(runs[(1, 1)])
    kill_at = random.randint(2, len(expected) - 2)
    run = launch(config(1, 1), data, target_dir, tmp_path)
    wait_for(tmp_path, kill_at, run)
    os.killpg(run.pid, signal.SIGKILL)
    run.wait()
    assert not (tmp_path / "drafter").exists()
    finish(launch(config(1, 1), data, target_dir, tmp_path))
    assert steps(tmp_path) == expected, f"killed after step {kill_at}"
    assert weights(tmp_path) == weights(runs[(1, 1)]), f"killed after step {kill_at}"


def test_dpace_trains_and_resumes_after_sigkill_to_the_uninterrupted_weights(
    data, target_dir, tmp_path
):
    """drafter.loss dpace (issue 57) through the real trainer: in the run's contract, and a run
    killed mid-way resumes to the uninterrupted run's steps and weights. (Muon's resume is
    tested in test_optim.py on a small drafter: on a CPU without bf16 units torch's Muon takes
    seconds a matrix, its Newton-Schulz iterations run in bf16.)"""
    levers = config(0, 1)
    levers["drafter"]["loss"] = "dpace"
    whole = tmp_path / "whole"
    finish(launch(levers, data, target_dir, whole, torchrun=False))
    expected = steps(whole)
    meta = json.loads(next(run_dir(whole).glob("step-*/meta.json")).read_text())
    assert meta["contract"]["loss"] == {"name": "dpace", "alpha": 0.5, "norm": "blocks"}
    kill_at = random.randint(2, len(expected) - 2)
    run = launch(levers, data, target_dir, tmp_path, torchrun=False)
    wait_for(tmp_path, kill_at, run)
    os.killpg(run.pid, signal.SIGKILL)
    run.wait()
    finish(launch(levers, data, target_dir, tmp_path, torchrun=False))
    assert steps(tmp_path) == expected, f"killed after step {kill_at}"
    assert weights(tmp_path) == weights(whole), f"killed after step {kill_at}"


def test_corrupt_newest_checkpoint_falls_back_and_other_target_counts_resume(
    runs, data, target_dir, tmp_path
):
    source = run_dir(runs[(1, 1)])
    newest = sorted(source.glob("step-*"))[-1]
    last = int(newest.name.split("-")[1])
    keep = [p for p in sorted(source.glob("step-*")) if int(p.name.split("-")[1]) <= last - 3]
    # Resume from the middle of the run, with 2 target ranks instead of 1: the same run folder,
    # because the contract does not name the target count.
    run = tmp_path / "ckpt" / source.name
    run.mkdir(parents=True)
    for folder in keep[-2:]:
        subprocess.run(["cp", "-r", str(folder), str(run)], check=True)
    state = run / keep[-1].name / "state.pt"
    blob = bytearray(state.read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    state.write_bytes(bytes(blob))
    err = finish(launch(config(2, 1), data, target_dir, tmp_path))
    assert f"checkpoint {run / keep[-1].name} is corrupt" in err
    assert f"resumed from {run / keep[-2].name}" in err
    assert weights(tmp_path) == weights(runs[(1, 1)])


def test_a_changed_run_starts_afresh_beside_the_old_one(runs, data, target_dir, tmp_path):
    """A config change (here gamma) must neither resume the old run nor touch its checkpoints."""
    subprocess.run(["cp", "-r", str(runs[(1, 1)] / "ckpt"), str(tmp_path)], check=True)
    old = run_dir(tmp_path)
    before = {p: sha256_file(p) for p in old.rglob("*") if p.is_file()}
    changed = config(1, 1)
    changed["drafter"]["gamma"] = 2.0
    err = finish(launch(changed, data, target_dir, tmp_path))
    assert "new run: checkpoints in" in err and "gamma: checkpoint 4.0 != now 2.0" in err
    assert "resumed from" not in err
    assert {p: sha256_file(p) for p in old.rglob("*") if p.is_file()} == before
    assert len(list((tmp_path / "ckpt").glob("run-*"))) == 2
    assert weights(tmp_path) != weights(runs[(1, 1)])


def worker(run, rank: int) -> int:
    """The pid of the torchrun worker with RANK=rank (a child of the torchrun process)."""
    for pid in map(int, filter(str.isdigit, os.listdir("/proc"))):
        try:
            if int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1]) != run.pid:
                continue
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except (OSError, ProcessLookupError):
            continue
        if f"RANK={rank}".encode() in env:  # exact entry: not LOCAL_RANK or GROUP_RANK
            return pid
    raise AssertionError(f"no worker with RANK={rank}")


def test_killing_one_rank_fails_the_whole_run_fast(data, target_dir, tmp_path):
    run = launch(config(1, 2, timeout_s=10), data, target_dir, tmp_path)
    wait_for(tmp_path, 2, run)
    os.kill(worker(run, 2), signal.SIGKILL)  # the target
    started = time.time()
    err = run.communicate(timeout=120)[1]
    assert run.returncode != 0
    assert time.time() - started < 60
    assert "rank      : 2" in err and "SIGKILL" in err


def test_a_silent_peer_times_out_with_a_message_naming_it(data, target_dir, tmp_path):
    # cold: SIGSTOP cannot be passed on to a command forked from the fork server (conftest.py)
    cold = {"DFLASH_FORK_SERVER": ""}
    run = launch(config(1, 1, timeout_s=5), data, target_dir, tmp_path, env=cold)
    wait_for(tmp_path, 2, run)
    target = worker(run, 1)
    os.kill(target, signal.SIGSTOP)  # alive but silent
    started = time.time()
    # a hung run fails the test instead of hanging it
    watchdog = threading.Timer(120, os.killpg, (run.pid, signal.SIGKILL))
    watchdog.start()
    try:
        seen = []
        for line in run.stderr:  # until the drafter names the silent peer
            seen.append(line)
            if "nothing for 5 s" in line:
                break
        # The run has failed by now. Woken, the peer obeys the SIGTERM torchrun's agent sends
        # it; stopped, it would get SIGKILL only after the agent's 30 s grace, whatever
        # TORCH_ELASTIC_SHUTDOWN_TIMEOUT or --shutdown-timeout say (torch 2.13; measured on
        # GPUs: the whole run exits 41.6 s after a 10 s timeout, bench/fail_fast.py).
        os.kill(target, signal.SIGCONT)
        err = "".join(seen) + run.communicate()[1]
    finally:
        watchdog.cancel()
        if Path(f"/proc/{target}").exists():
            os.kill(target, signal.SIGKILL)
    assert run.returncode != 0
    assert time.time() - started < 60
    assert "rank 0 (drafter 0): receiving batch" in err
    assert "from rank 1 (target 0): nothing for 5 s (train.timeout_s)" in err


# Loaded by every process of the run (sitecustomize on PYTHONPATH): the target rank (RANK 1)
# takes 4 s, twice train.timeout_s, for each of its 2nd to 4th batches, as a target on a CPU
# without bf16 units did (the wait for the first batch has the startup bound).
SLOW_TARGET = """
import os
if os.environ.get("RANK") == "1":
    import time
    import dflash.train.loop as loop
    features = loop.FeatureModel.__call__
    calls = []
    def slow(self, *args):
        calls.append(1)
        if 2 <= len(calls) <= 4:
            time.sleep(4)
        return features(self, *args)
    loop.FeatureModel.__call__ = slow
"""


def test_a_slow_but_alive_target_is_waited_for(runs, data, target_dir, tmp_path):
    """A peer slower than train.timeout_s keeps its heartbeat: the drafter warns, waits, and the
    run ends with the steps and weights of the run at full speed (a frozen one fails: the test
    above)."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(SLOW_TARGET)
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(hook), os.environ.get("PYTHONPATH")]))}
    # train.timeout_s is no part of the run's contract: the same run as runs[(1, 1)]
    err = finish(launch(config(1, 1, timeout_s=2), data, target_dir, tmp_path, env=env))
    assert (
        "from rank 1 (target 0): nothing for 2 s (train.timeout_s), but rank 1 (target 0) is alive"
        in err
    )
    assert steps(tmp_path) == steps(runs[(1, 1)])
    assert weights(tmp_path) == weights(runs[(1, 1)])


def edit_contract(run: Path, **changes) -> None:
    """Rewrite every checkpoint's contract (with valid SHA256SUMS), as other code or a hand
    would."""
    for folder in run.glob("step-*"):
        meta = json.loads((folder / "meta.json").read_text())
        meta["contract"] |= changes
        (folder / "meta.json").write_text(json.dumps(meta))
        sums = "".join(f"{sha256_file(folder / n)}  {n}\n" for n in ("state.pt", "meta.json"))
        (folder / "SHA256SUMS").write_text(sums)


def test_checkpoints_of_other_training_code_are_never_resumed(runs, data, target_dir, tmp_path):
    """After a code change the rerun trains afresh (to the same weights as a fresh run) instead of
    resuming, or re-exporting, the old run's checkpoints."""
    subprocess.run(["cp", "-r", str(runs[(1, 1)] / "ckpt"), str(tmp_path)], check=True)
    old = run_dir(tmp_path)
    other = old.with_name("run-000000000000")  # as other code names its run
    old.rename(other)
    edit_contract(other, code="0" * 64)
    err = finish(launch(config(1, 1), data, target_dir, tmp_path))
    assert "code: checkpoint '0000000000000000" in err and "resumed from" not in err
    assert steps(tmp_path) == steps(runs[(1, 1)])
    assert weights(tmp_path) == weights(runs[(1, 1)])


def test_a_hand_edited_contract_is_refused(runs, data, target_dir, tmp_path):
    subprocess.run(["cp", "-r", str(runs[(1, 1)] / "ckpt"), str(tmp_path)], check=True)
    edit_contract(run_dir(tmp_path), seed=7)
    run = launch(config(1, 1), data, target_dir, tmp_path)
    err = run.communicate(timeout=300)[1]
    assert run.returncode != 0, err[-3000:]
    assert "seed: checkpoint 7 != now 0" in err and "move the checkpoint folder away" in err


def test_a_run_from_an_exported_drafter_starts_from_its_weights(
    trained_drafter, data, target_dir, tmp_path
):
    """drafter.init: <folder>, here the tiny workflow's trained drafter copied out of results/:
    before its first step the drafter rank holds the export's weights (bf16, in fp32 master
    weights), not random ones, and the sha256 of the export's files is in the run's contract."""
    import shutil

    import torch
    from safetensors.torch import load_file

    from dflash.config import validate
    from dflash.train import comm
    from dflash.train.batches import Batches
    from dflash.train.trainer import Trainer

    init = tmp_path / "run-1"
    shutil.copytree(trained_drafter, init)
    cfg = config(0, 1)
    cfg["drafter"]["init"] = str(init)
    cfg = validate(cfg)
    ctx = comm.init(Topology(0, 1), "cpu", 20, 20)
    trainer = Trainer(ctx, cfg, target_dir, Batches(cfg, data), tmp_path / "ckpt")
    exported = load_file(init / "model.safetensors")
    state = trainer.drafter.state_dict()
    assert state.keys() == exported.keys()
    assert [k for k in state if not torch.equal(state[k], exported[k].float())] == []
    files = ("config.json", "model.safetensors")
    assert trainer.contract["init"] == {name: sha256_file(init / name) for name in files}


def test_an_exported_drafter_that_does_not_fit_is_refused_before_training(
    trained_drafter, data, target_dir, tmp_path
):
    """One error line naming the folder and each differing key with both values; no traceback,
    no checkpoint, no drafter."""
    import shutil

    init = tmp_path / "other"
    shutil.copytree(trained_drafter, init)
    hf = json.loads((init / "config.json").read_text())
    hf["block_size"], hf["hidden_size"] = 16, 64
    hf["dflash_config"]["target_layer_ids"] = [2, 20]
    (init / "config.json").write_text(json.dumps(hf))
    cfg = config(0, 1)
    cfg["drafter"]["init"] = str(init)
    run = launch(cfg, data, target_dir, tmp_path, torchrun=False)
    err = run.communicate(timeout=300)[1]
    assert run.returncode != 0
    (line,) = [x for x in err.splitlines() if "error" in x]
    prefix = "dflash train: error: rank 0 (drafter 0): drafter.init:"
    assert line.startswith(f"{prefix} {init} does not fit this run: ")
    assert "block_size: init 16, run 8 (drafter.block_size)" in line, line
    assert "target_layer_ids: init [2, 20], run [15] (drafter.target_layer_ids)" in line, line
    assert "hidden_size: init 64, run 576 (the target)" in line, line
    assert "Traceback" not in err
    assert not (tmp_path / "drafter").exists() and not list(tmp_path.glob("ckpt/run-*"))
