"""A target sharded across target ranks (train.topology.target_shards): routing, the checks that
name the key, features equal to the whole target's at 2 and 4 gloo ranks, and a training run."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from dflash.errors import UserError
from dflash.train.shard import check_shardable
from dflash.train.topology import Topology

# 4 layers, 4 query / 4 key-value heads of 16 and an MLP of 128: divisible by 2 and 4 shards.
SMALL = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=4,
    head_dim=16,
    max_position_embeddings=256,
)
MODELS = {
    # grouped queries: 8 query heads of 8 on 4 key-value heads (2 per shard at 4 shards)
    "llama": (LlamaConfig, LlamaForCausalLM, {"num_attention_heads": 8, "head_dim": 8}),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {}),
}


def save_target(kind: str, path: Path, **fields) -> Path:
    config, cls, extra = MODELS[kind]
    torch.manual_seed(0)
    cls(config(**(SMALL | extra | fields))).save_pretrained(path)
    return path


def test_sharded_groups_route_batch_i_to_group_i_mod_groups_and_its_leader_sends():
    topo = Topology(targets=4, drafters=2, target_shards=2)
    assert topo.world == 6 and topo.target_groups == 2
    assert [topo.group_ranks(g) for g in range(2)] == [[2, 3], [4, 5]]
    assert [topo.source_rank(i) for i in range(4)] == [2, 4, 2, 4]  # leaders only
    assert [topo.dest_rank(i) for i in range(4)] == [0, 1, 0, 1]
    # both ranks of a group compute the same batches; drafters are unchanged
    assert topo.batches(2, 9) == topo.batches(3, 9) == [0, 2, 4, 6]
    assert topo.batches(4, 9) == topo.batches(5, 9) == [1, 3, 5, 7]
    assert topo.batches(1, 9) == [1, 3, 5, 7]
    assert topo.leader(3) == 2 and topo.leader(4) == 4 and topo.leader(0) == 0
    assert Topology(2, 1).as_dict() == {"targets": 2, "drafters": 1, "target_shards": 1}
    unsharded = Topology(targets=3, drafters=2)
    assert [unsharded.source_rank(i) for i in range(4)] == [2, 3, 4, 2]


def test_target_shards_are_checked_against_the_topology_and_the_target():
    with pytest.raises(UserError, match=r"targets \(3\) must be a multiple of .*target_shards"):
        Topology(targets=3, drafters=1, target_shards=2)
    with pytest.raises(UserError, match=r"target_shards=2 needs separate target ranks"):
        Topology(targets=0, drafters=2, target_shards=2)
    fine = Qwen3Config(**SMALL)
    check_shardable(fine, 4)
    with pytest.raises(UserError, match=r"target_shards=3: .*num_attention_heads 4, "):
        check_shardable(fine, 3)
    with pytest.raises(UserError, match=r"target_shards=2: .*num_key_value_heads 1 not divisible"):
        check_shardable(Qwen3Config(**(SMALL | {"num_key_value_heads": 1})), 2)
    window = LlamaConfig(**SMALL)
    window.model_type = "mistral"
    window.sliding_window = 8
    with pytest.raises(UserError, match=r"target_shards=2: a mistral target cannot be sharded"):
        check_shardable(window, 2)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def compare_features(rank: int, world: int, port: int, paths: dict, compile_kind: str | None):
    """A gloo rank: each target sharded over the world against the whole target, in fp32."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor

    from dflash.model.target import TargetFeatures, load_target
    from dflash.train.shard import load_sharded

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    mesh = DeviceMesh.from_group(dist.new_group(list(range(world))), "cpu")
    cpu = torch.device("cpu")
    ids = torch.randint(0, SMALL["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(1))
    left = torch.ones_like(ids)
    left[0, :5] = 0  # not right-padding: transformers' forward, with its mask
    try:
        for kind, path in paths.items():
            for with_output in (False, True):
                layers = [0, 2]
                whole = TargetFeatures(load_target(path), layers, with_output=with_output)
                sharded = load_sharded(path, mesh, layers, cpu, torch.float32, with_output)
                q = sharded.decoder.layers[0].self_attn.q_proj.weight
                assert isinstance(q, DTensor) and q.to_local().shape[0] == 64 // world
                assert sharded.lm_head is None
                for mask in (None, left):
                    got, want = sharded(ids, mask), whole(ids, mask)
                    valid = torch.ones_like(ids, dtype=torch.bool) if mask is None else mask.bool()
                    diff = (got - want)[valid].abs().max().item()
                    assert diff <= 1e-5, (kind, world, with_output, mask is not None, diff)
                if kind == compile_kind and not with_output:
                    torch._dynamo.reset()
                    assert sharded.compile_layers()
                    diff = (sharded(ids) - whole(ids)).abs().max().item()
                    assert diff <= 1e-5, (kind, world, "compiled", diff)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_sharded_features_equal_the_whole_targets(world, tmp_path):
    """Llama (grouped queries) and Qwen3 (q/k norms), narrow and with the output appended,
    written out and through transformers' forward; the compiled layer at 2 ranks."""
    paths = {kind: save_target(kind, tmp_path / kind) for kind in MODELS}
    compile_kind = "qwen3" if world == 2 else None
    torch.multiprocessing.spawn(
        compare_features, args=(world, free_port(), paths, compile_kind), nprocs=world
    )


def held_out_rank(rank: int, port: int, target: Path, held_out: Path):
    """Drafter 0 (rank 0) receives the held-out slice's features from target group 0 (ranks 1
    and 2, sharded): equal to a whole target's, in bf16."""
    from types import SimpleNamespace

    import torch.distributed as dist

    from dflash.model.target import TargetFeatures, load_target
    from dflash.train import comm
    from dflash.train.features import FeatureModel, HeldOut, held_out_rows, send_held_out

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=3)
    group = dist.new_group([1, 2])
    topo, cpu = Topology(targets=2, drafters=1, target_shards=2), torch.device("cpu")
    ctx = comm.Dist(topo, rank, cpu, target_group=group if rank else None)
    config = {
        "train": {"distill": 0, "tau_sim": {"rows": 2}},
        "compile": {"enabled": False, "target": False},
    }
    layers = [1, 2]
    try:
        if rank:
            model = FeatureModel.load(target, layers, cpu, config, ctx.target_mesh())
            send_held_out(ctx, model, held_out, 2)
            return
        dcfg = SimpleNamespace(target_layer_ids=layers, hidden_size=SMALL["hidden_size"])
        got = HeldOut.load(ctx, config, target, dcfg, held_out)
        whole = TargetFeatures(load_target(target), layers)
        for (feats, ids, _), (row, _) in zip(got.rows, held_out_rows(held_out, 2), strict=True):
            assert ids.tolist() == row
            want = whole(torch.tensor([row])).to(torch.bfloat16)
            torch.testing.assert_close(feats, want, atol=1e-2, rtol=1e-2)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_the_held_out_features_of_a_sharded_target_come_from_its_first_group(tmp_path):
    target = save_target("qwen3", tmp_path / "target")
    held_out = token_rows(tmp_path / "eval.parquet", 2, seed=1)
    torch.multiprocessing.spawn(held_out_rank, args=(free_port(), target, held_out), nprocs=3)


def token_rows(path: Path, n: int, seed: int) -> Path:
    """Tokenized rows as `tokenize` writes them: ids, a loss mask on the second half, length."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        length = int(torch.randint(20, 90, (1,), generator=g))
        ids = torch.randint(4, SMALL["vocab_size"], (length,), generator=g).tolist()
        mask = [0] * (length // 2) + [1] * (length - length // 2)
        rows.append({"input_ids": ids, "loss_mask": mask, "length": length})
    pl.DataFrame(rows).write_parquet(path)
    return path


def train(tmp: Path, topology: dict, target: Path, data: Path, held_out: Path) -> list[dict]:
    config = {
        "seed": 0,
        "target": {"mask_token_id": 3},
        "drafter": {"num_layers": 1, "block_size": 8, "max_anchors": 4},
        "compile": {"enabled": False},
        "data": {"buckets": [32, 64], "max_length": 96, "token_budget": 128, "max_batch_size": 2},
        "train": {
            "epochs": 1,
            "lr": 1e-3,
            "timeout_s": 30,
            "topology": topology,
            "tau_sim": {"every": 2, "rows": 2, "max_new_tokens": 8},
        },
    }
    world = topology["targets"] + topology["drafters"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1"]
    cmd += ["--nproc-per-node", str(world), "-m", "dflash", "train", "--config", json.dumps(config)]
    cmd += ["--target", str(target), "--data", str(data), "--held-out", str(held_out)]
    cmd += ["--out", str(tmp / "drafter"), "--metrics", str(tmp / "metrics.jsonl")]
    cmd += ["--summary", str(tmp / "summary.json"), "--checkpoints", str(tmp / "ckpt")]
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return [json.loads(line) for line in (tmp / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_training_from_a_target_sharded_over_two_ranks_matches_a_whole_target(tmp_path):
    """targets 2, drafters 1, target_shards 2: both shards compute every batch, the leader sends
    it, and tau_sim's held-out features come from the group too; the run logs what a whole
    target on one rank gives (features differ by rounding only, then travel in bf16)."""
    target = save_target("qwen3", tmp_path / "target")
    data = token_rows(tmp_path / "train.parquet", 9, seed=0)
    held_out = token_rows(tmp_path / "eval.parquet", 2, seed=1)
    sharded = train(tmp_path / "sharded", {"targets": 2, "drafters": 1, "target_shards": 2},
                    target, data, held_out)  # fmt: skip
    whole = train(tmp_path / "whole", {"targets": 1, "drafters": 1}, target, data, held_out)
    assert [r["batch"] for r in sharded] == [r["batch"] for r in whole] and len(whole) >= 4
    for a, b in zip(sharded, whole, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4)
    # logged, from features target group 0 sent (an untrained drafter's τ: 1)
    assert [r.get("tau_sim") for r in sharded] == [r.get("tau_sim") for r in whole]
    assert sum("tau_sim" in r for r in sharded) >= 2
    (run,) = (tmp_path / "sharded/ckpt").glob("run-*")
    events = {r: [json.loads(x) for x in (run / f"telemetry/rank{r}.jsonl").open()] for r in (1, 2)}
    assert [e["batch"] for e in events[1]] == [e["batch"] for e in events[2]]
    assert all(e["dst"] == 0 for e in events[1]) and not any("dst" in e for e in events[2])
    summary = json.loads((tmp_path / "sharded/summary.json").read_text())
    assert summary["topology"] == {"targets": 2, "drafters": 1, "target_shards": 2}
