"""The data workflow on the tiny config: real Snakemake, real target, real ShareGPT rows."""

import json
import shlex
import shutil
from pathlib import Path

import polars as pl
import pytest
from conftest import OVER, TESTS, Workflow, jobs_in

from dflash.io import sha256_file, sha256_tree
from dflash.train import launch

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow

DATA_RULES = {"expand_dataset", "regenerate_shard", "regenerate", "tokenize", "length_stats"}


def output_hashes(results: Path) -> dict[str, str]:
    skip = ("logs/", "work/")
    return {
        p.relative_to(results).as_posix(): sha256_file(p)
        for p in sorted(results.rglob("*"))
        if p.is_file() and not p.relative_to(results).as_posix().startswith(skip)
    }


def test_outputs_and_manifests(tiny_workflow):
    results = tiny_workflow.results
    report = json.loads((results / "data/expanded/report.json").read_text())
    # the conversation that opens with the assistant loses that turn and then has no answer
    assert report["sources"]["local"]["dropped"] == {"malformed_json": 1, "no_assistant": 1}
    assert report["sources"]["sharegpt"]["rows_read"] == 2000
    assert report["train_rows"] == 6 and report["eval_rows"] == 2

    train = pl.read_parquet(results / "data/tokenized/train.parquet")
    assert train.columns == ["id", "input_ids", "loss_mask", "length", "trainable"]
    assert train["length"].max() <= 96

    stats = json.loads((results / "data/stats/stats.json").read_text())
    assert stats["rows"] == train.height
    # rows by domain (ShareGPT's classified): the report's training rows, then the statistics'
    assert sum(report["domains"]["train"].values()) == report["train_rows"]
    by_domain = {d: s["rows"] for d, s in stats["domains"].items()}
    assert sum(by_domain.values()) == stats["rows"]
    assert all(n <= report["domains"]["train"][d] for d, n in by_domain.items())
    assert (results / "data/stats/stats.png").read_bytes()[:4] == b"\x89PNG"

    # the stages' manifests, and the target rule's beside its conversion under resources/
    manifests = [*(results / "manifests").glob("*.json"), tiny_workflow.target / "manifest.json"]
    for manifest in manifests:
        m = json.loads(manifest.read_text())
        for name, files in m["output_sha256"].items():
            base = Path(tiny_workflow.workdir / m["outputs"][name])
            for rel, digest in files.items():
                path = base if base.is_file() else base / rel
                assert sha256_file(path) == digest, f"{manifest.name}: {path}"
    target = json.loads((tiny_workflow.target / "target.json").read_text())
    assert target["mask_token_id"] == 3 and target["num_hidden_layers"] == 30


def test_touch_reruns_nothing(tiny_workflow):
    for path in tiny_workflow.workdir.rglob("*"):
        if path.is_file():
            path.touch()
    assert tiny_workflow.planned_jobs("stats") == {}


def edited_config(flow, name, **data):
    import yaml

    config = yaml.safe_load((flow.workdir / "tiny.yaml").read_text())
    for key, value in data.items():
        section = config["data"]
        *parents, leaf = key.split("__")
        for parent in parents:
            section = section[parent]
        section[leaf] = value
    (flow.workdir / name).write_text(yaml.safe_dump(config))
    return name


def test_a_config_file_given_on_the_command_line_replaces_the_embedded_default(tiny_workflow):
    """A recipe is complete by itself: a key it leaves out takes the schema's default, never the
    CPU default's value (config/config.yaml caps data.train_rows at 256)."""
    import yaml

    flow = tiny_workflow
    config = yaml.safe_load((flow.workdir / "tiny.yaml").read_text())
    del config["data"]["train_rows"]
    (flow.workdir / "uncapped.yaml").write_text(yaml.safe_dump(config))
    out = flow.run("-n", "-p", "-f", "expand_dataset", *OVER, config="uncapped.yaml").stdout
    assert '"train_rows": null' in out and '"train_rows": 256' not in out


def test_a_template_source_reaches_expand_with_its_braces(tiny_workflow):
    """A prompt set's template ("{instruction}") is not taken for a Snakemake wildcard: the
    workflow plans, and expand reads the template and the mixture exactly as configured."""
    import shlex

    import yaml

    flow = tiny_workflow
    config = yaml.safe_load((flow.workdir / "tiny.yaml").read_text())
    template = {"user": "Q: {instruction}", "assistant": "{output}"}
    prompts = {"name": "prompts", "path": "local.jsonl", "domain": "math", "template": template}
    config["data"]["sources"].append(prompts)
    config["data"]["domain_rows"] = {"chat": 3}
    (flow.workdir / "template.yaml").write_text(yaml.safe_dump(config))
    out = flow.run("-n", "-p", "-f", "all", *OVER, config="template.yaml").stdout
    line = next(x for x in out.splitlines() if "python -m dflash expand" in x)
    data = json.loads(shlex.split(line)[shlex.split(line).index("--config") + 1])["data"]
    assert data["sources"][-1]["template"] == template and data["domain_rows"] == {"chat": 3}


def test_a_local_targets_defaults_are_chosen_or_refused_before_any_job(tiny_workflow, target_dir):
    """target.path has no rule that would check it: the workflow checks it when it starts. With
    target.mask_token_id null, the first special token SmolLM2's chat template never emits is
    chosen and said (it listed <|endoftext|>, <|im_start|>, <|im_end|> to pick from); an id the
    template emits is refused, and so are layer ids outside the target's 30 layers."""
    import yaml

    flow = tiny_workflow
    config = yaml.safe_load((flow.workdir / "tiny.yaml").read_text())
    config["target"] = {"path": str(target_dir), "mask_token_id": None}
    (flow.workdir / "local-target.yaml").write_text(yaml.safe_dump(config))
    elsewhere = ("--config", "results=results-local-target")  # not over the tiny run
    done = flow.run("-n", "train", *elsewhere, config="local-target.yaml")
    said = done.stderr + done.stdout
    assert "target.mask_token_id: null -> 3, the first unused special token '<repo_name>'" in said
    assert "drafter.target_layer_ids: null -> [15] (of its 30 layers)" in said
    assert "train" in jobs_in(done.stdout)
    config["target"]["mask_token_id"] = 2
    (flow.workdir / "local-target.yaml").write_text(yaml.safe_dump(config))
    done = flow.run("-n", "train", *elsewhere, config="local-target.yaml", check=False)
    assert done.returncode != 0
    assert "target.mask_token_id: 2 '<|im_end|>' is a token the chat" in done.stderr + done.stdout
    config["target"]["mask_token_id"] = 3
    config["drafter"]["target_layer_ids"] = [30]
    (flow.workdir / "local-target.yaml").write_text(yaml.safe_dump(config))
    done = flow.run("-n", "train", *elsewhere, config="local-target.yaml", check=False)
    said = done.stderr + done.stdout
    assert done.returncode != 0 and "drafter.target_layer_ids: [30] outside the 30 layers" in said
    assert "valid ids are 0..29" in said
    config["drafter"]["target_layer_ids"] = None
    # a drafter to start from that was made for another target is refused as early
    from dflash.model.drafter import Drafter, DrafterConfig, save_drafter

    other = DrafterConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, vocab_size=49152, block_size=8,
        num_target_layers=30, target_layer_ids=[15], mask_token_id=3,
    )  # fmt: skip
    save_drafter(Drafter(other), flow.workdir / "drafters" / "other-target")
    config["drafter"]["init"] = "drafters/other-target"
    (flow.workdir / "local-target.yaml").write_text(yaml.safe_dump(config))
    done = flow.run("-n", "train", *elsewhere, config="local-target.yaml", check=False)
    assert done.returncode != 0
    assert "hidden_size: init 32, run 576 (the target)" in done.stderr + done.stdout


def test_the_own_model_example_plans_the_whole_run_once_it_names_a_real_model(
    tiny_workflow, target_dir
):
    """config/my-model.yaml, with target.path at a real model directory, its mask token set and
    its data source at a real file, plans every rule of `all` (it is not run: GPU-sized)."""
    import yaml

    flow = tiny_workflow
    config = yaml.safe_load((REPO / "config" / "my-model.yaml").read_text())
    config["target"] |= {"path": str(target_dir), "mask_token_id": 3}
    config["data"]["sources"][0]["path"] = "local.jsonl"
    (flow.workdir / "my-model.yaml").write_text(yaml.safe_dump(config))
    planned = flow.planned_jobs(
        "all", "--config", "results=results-my-model", config="my-model.yaml"
    )
    assert {
        "expand_dataset",
        "regenerate",
        "tokenize",
        "train",
        "eval_acceptance",
        "eval_ddtree",
    } <= (planned.keys())
    assert "record" in planned and "target" not in planned  # a local target needs no rule


def mermaid_edges(text: str) -> set[tuple[str, str]]:
    """(from rule, to rule) of a Mermaid flowchart, with Snakemake's `idN[name]` nodes or bare
    names."""
    import re

    names = dict(re.findall(r"(id\d+)\[(\w+)\]", text))
    edges = re.findall(r"^\s*(\w+) --> (\w+)\s*$", text, flags=re.M)
    return {(names.get(a, a), names.get(b, b)) for a, b in edges}


def test_the_documented_graph_commands_run_and_the_rule_graph_is_current(tiny_workflow):
    """docs/workflow.md's DAG command gives a graphviz graph, and its Mermaid picture of the rules
    is the one `snakemake all --rulegraph mermaid-js` draws."""
    flow = tiny_workflow
    dag = flow.run("stats", "--dag").stdout
    assert dag.lstrip().startswith("digraph") and dag.count("->") >= 5
    # README's two pictures of the jobs: with graphviz (which it says how to install) and without
    readme = (REPO / "README.md").read_text()
    assert "--dag | dot -Tsvg > dag.svg" in readme and "apt-get install graphviz" in readme
    assert "all --dag mermaid-js > dag.mmd" in readme
    jobs = flow.run("stats", "--dag", "mermaid-js").stdout
    assert "flowchart TB" in jobs and len(mermaid_edges(jobs)) >= 5
    drawn = mermaid_edges(flow.run("all", "--rulegraph", "mermaid-js").stdout)
    doc = (REPO / "docs" / "workflow.md").read_text()
    block = doc.split("```mermaid", 1)[1].split("```", 1)[0]
    assert drawn and mermaid_edges(block) == drawn


def planned_resources(out: str) -> dict[str, dict[str, str]]:
    """Rule -> its resources as a dry run prints them (`resources: a=1, b=x`)."""
    plan, rule = {}, None
    for line in out.splitlines():
        if line.startswith(("rule ", "localrule ")):
            rule = line.split()[1].rstrip(":")
        elif line.strip().startswith("resources:") and rule:
            pairs = line.split("resources:", 1)[1].split(", ")
            plan[rule] = dict(p.strip().split("=", 1) for p in pairs)
    return plan


def test_the_slurm_profile_sends_every_gpu_rule_to_gpus(tiny_workflow):
    """With the real SLURM executor plugin, a dry run of the SLURM profile (on this host, which
    has no GPU) asks GPUs for exactly the rules that use one, through the `gpu` resource: the
    plugin rejects GPUs in slurm_extra."""
    flow = tiny_workflow
    profile = flow.repo / "workflow" / "profiles" / "slurm"
    out = flow.run("-n", "-F", "all", "--workflow-profile", str(profile)).stdout
    plan = planned_resources(out)
    gpu_rules = {"regenerate_shard", "warmup_compile", "train", "eval_acceptance", "eval_ddtree"}
    gpu_rules |= {"eval_sampling"}  # tiny.yaml evaluates at temperature 1 too
    assert gpu_rules <= plan.keys() and "target" in plan
    for rule, res in plan.items():
        assert "--gres" not in res.get("slurm_extra", "") and "--gpus" not in res.get(
            "slurm_extra", ""
        ), rule
        if rule in gpu_rules:
            assert res["slurm_partition"] == "gpu" and int(res["gpu"]) >= 1, (rule, res)
        else:
            assert res["slurm_partition"] == "cpu" and res.get("gpu", "0") == "0", (rule, res)
    assert plan["train"]["gpu"] == "2"  # tiny.yaml: 1 target + 1 drafter


def test_every_rule_that_asks_for_a_gpu_goes_to_the_slurm_gpu_partition():
    """Every rule whose resources name `gpu` (eval_vllm included, which the dry run above does
    not plan without vLLM) has a gpu-partition entry in the SLURM profile: else its sbatch job
    would ask for a GPU on the cpu partition."""
    import yaml

    asking, rule = set(), None
    for path in sorted((REPO / "workflow" / "rules").glob("*.smk")):
        for line in path.read_text().splitlines():
            if line.startswith("rule "):
                rule = line.split()[1].rstrip(":")
            elif line.strip().startswith("gpu=") and rule:
                asking.add(rule)
    assert {"regenerate_shard", "train", "eval_acceptance", "eval_vllm"} <= asking
    profile = yaml.safe_load((REPO / "workflow/profiles/slurm/config.yaml").read_text())
    sent = {r for r, res in profile["set-resources"].items() if res["slurm_partition"] == "gpu"}
    assert asking <= sent, asking - sent


FROM_REGENERATION = {"regenerate_shard", "regenerate", "tokenize", "length_stats", "stats"}


def test_param_changes_rerun_only_what_depends_on_them(tiny_workflow):
    flow = tiny_workflow
    name = edited_config(flow, "len.yaml", max_length=80)
    # regeneration reads it too: a turn whose prompt fills max_length is not generated
    assert set(flow.planned_jobs("stats", *OVER, config=name)) == FROM_REGENERATION
    name = edited_config(flow, "bucket.yaml", token_budget=512)
    assert set(flow.planned_jobs("stats", *OVER, config=name)) == {"length_stats", "stats"}
    name = edited_config(flow, "noregen.yaml", regenerate__enabled=False)
    # tokenize then reads the expanded rows directly; no regeneration job is planned
    assert set(flow.planned_jobs("stats", *OVER, config=name)) == {
        "tokenize",
        "length_stats",
        "stats",
    }
    name = edited_config(flow, "regen.yaml", regenerate__max_new_tokens=8)
    assert set(flow.planned_jobs("stats", *OVER, config=name)) == FROM_REGENERATION


def test_module_edit_reruns_the_stages_that_import_it(tiny_workflow):
    flow = tiny_workflow
    for module, expected, first in (
        # expand imports it: everything after expand reruns
        ("normalize.py", DATA_RULES, "expand_dataset"),
        ("stats.py", {"length_stats"}, "length_stats"),  # only the stats rule imports it
    ):
        path = flow.repo / "dflash" / "data" / module
        original = path.read_text()
        try:
            path.write_text(original + "\n# an edit\n")
            dry = flow.run("-n", "stats").stdout
            assert set(jobs_in(dry)) - {"stats"} == expected, module
            # the reason names the file, before and after
            why = reasons(dry)[first]
            assert why.count(f"code dflash/data/{module} ") == 2, why
        finally:
            path.write_text(original)
    assert flow.planned_jobs("stats") == {}


def data_stage_hashes(flow) -> dict[str, str]:
    """sha256 of what `stats` builds: the target (under resources/, keyed target/...), the data,
    and the manifests of those stages (every output of theirs is under data/)."""
    results, built = flow.results, ("data/",)

    def by_data_stage(rel: str) -> bool:
        if rel.startswith("manifests/"):
            outputs = json.loads((results / rel).read_text())["outputs"].values()
            return all(Path(o).relative_to("results").as_posix().startswith(built) for o in outputs)
        return rel.startswith(built)

    target = {f"target/{rel}": h for rel, h in sha256_tree(flow.target).items()}
    return target | {rel: h for rel, h in output_hashes(results).items() if by_data_stage(rel)}


def test_deleting_results_converts_nothing_again(tiny_workflow, tmp_path):
    """The converted target is a reference input under resources/: after `rm -rf results` a dry
    run plans every data stage but no target rule, and the rerun reads the same conversion. The
    rerun makes the held-out split's tokenized rows only: its jobs are every rule that reads
    the target (regenerate_shard, tokenize), without the training split's twins of them."""
    work = tmp_path / "work"  # a copy of the run's folder, .snakemake included
    shutil.copytree(tiny_workflow.workdir, work, ignore=shutil.ignore_patterns("results-*"))
    flow = Workflow(tiny_workflow.repo, work)
    target = flow.target
    assert target.relative_to(work).parts[:2] == ("resources", "target")
    before = sha256_tree(target)
    shutil.rmtree(flow.results)
    planned = flow.planned_jobs("stats")
    assert "target" not in planned and DATA_RULES <= planned.keys()
    held_out = "results/data/tokenized/eval.parquet"
    done = flow.run(held_out)
    log = done.stdout + done.stderr
    assert "rule regenerate_shard:" in log and "rule tokenize:" in log and "rule target:" not in log
    manifest = json.loads((flow.results / "manifests/tokenize_eval.json").read_text())
    assert (work / manifest["inputs"]["target"]).parent == target
    assert sha256_tree(target) == before
    assert flow.planned_jobs(held_out) == {}


def test_a_second_run_from_scratch_builds_byte_identical_data(tiny_workflow, second_workflow):
    """The data stages are deterministic: the second run, in another folder and without the
    first one's resume state, writes the same bytes (test_record compares the two runs'
    records)."""
    first = data_stage_hashes(tiny_workflow)
    second = data_stage_hashes(second_workflow)
    assert {"target/hf/model.safetensors", "data/tokenized/train.parquet"} <= first.keys()
    assert {"target/manifest.json", "manifests/regenerate_train_1.json"} <= first.keys()
    assert "manifests/train.json" not in first
    assert first.keys() == second.keys()
    assert [k for k in first if first[k] != second[k]] == []


def test_train_rule_runs_torchrun_writes_the_drafter_and_reruns_alone_on_a_training_change(
    tiny_workflow,
):
    import yaml

    flow = tiny_workflow
    flow.run("train")
    drafter = flow.results / "drafter"
    config = json.loads((drafter / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["block_size"] == 8
    assert (drafter / "model.safetensors").stat().st_size > 0
    lines = (flow.results / "train/metrics.jsonl").read_text().splitlines()
    assert lines and json.loads(lines[-1])["step"] == len(lines)
    summary = json.loads((flow.results / "train/summary.json").read_text())
    topology = {"targets": 1, "drafters": 1, "target_shards": 1}
    assert summary["topology"] == topology  # torchrun, 2 processes
    assert summary["bottleneck"] in {"targets", "drafters"}
    assert flow.planned_jobs("train") == {}

    changed = yaml.safe_load((flow.workdir / "tiny.yaml").read_text())
    changed["train"] = {"lr": 5.0e-4}
    (flow.workdir / "lr.yaml").write_text(yaml.safe_dump(changed))
    # another config file over this run: told so (else refused, test_own_model)
    assert set(flow.planned_jobs("train", *OVER, config="lr.yaml")) == {"train"}


def test_a_drafter_to_start_from_reruns_training_alone_and_its_files_are_its_identity(
    tiny_workflow, trained_drafter
):
    """drafter.init at a copy of the run's drafter (outside results/): training reruns, nothing
    before it (no data stage, no compile warmup); the train manifest hashes the init's files;
    new weights in them rerun training, a touch does not. drafter.init at results/drafter itself
    is refused before any job."""
    import yaml
    from safetensors.torch import load_file, save_file

    flow = tiny_workflow
    trained = sha256_file(trained_drafter / "model.safetensors")
    init = flow.workdir / "drafters" / "run-1"
    shutil.copytree(trained_drafter, init)
    config = yaml.safe_load((flow.workdir / "tiny.yaml").read_text())
    config["drafter"]["init"] = "drafters/run-1"
    (flow.workdir / "init.yaml").write_text(yaml.safe_dump(config))
    assert flow.planned_jobs("train", *OVER, config="init.yaml") == {"train": 1}
    try:
        flow.run("train", *OVER, config="init.yaml")
        manifest = json.loads((flow.results / "manifests/train.json").read_text())
        assert manifest["inputs"]["init"] == "drafters/run-1"
        weights = init / "model.safetensors"
        assert manifest["input_sha256"]["init"]["model.safetensors"] == sha256_file(weights)
        for path in init.iterdir():
            path.touch()
        assert flow.planned_jobs("train", *OVER, config="init.yaml") == {}
        state = load_file(weights)
        save_file({k: v * 2 for k, v in state.items()}, weights, metadata={"format": "pt"})
        assert flow.planned_jobs("train", *OVER, config="init.yaml") == {"train": 1}
    finally:
        flow.run("train", *OVER)  # the random start again: its checkpoint is exported again
    assert sha256_file(trained_drafter / "model.safetensors") == trained

    config["drafter"]["init"] = "results/drafter"
    (flow.workdir / "own.yaml").write_text(yaml.safe_dump(config))
    done = flow.run("-n", "train", config="own.yaml", check=False)
    assert done.returncode != 0
    assert "is the drafter this run writes" in done.stderr + done.stdout
    assert "copy it out of results/ first" in done.stderr + done.stdout


class _Resources(dict):
    """A job's resources as the SLURM plugin reads them: `.get(name)` and `.name`."""

    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


def sbatch_line(resources: dict[str, str], threads: int) -> list[str]:
    """The sbatch call the installed SLURM plugin builds for a job of these (dry-run) resources,
    as its executor builds it: its own get_submit_command, then the GPU options."""
    from types import SimpleNamespace

    from snakemake_executor_plugin_slurm.submit_string import get_submit_command
    from snakemake_executor_plugin_slurm.utils import set_gres_string
    from snakemake_executor_plugin_slurm.validation import validate_slurm_extra

    job = SimpleNamespace(
        resources=_Resources({k: int(v) if v.isdigit() else v for k, v in resources.items()}),
        threads=threads,
    )
    validate_slurm_extra(job)
    params = {"run_uuid": "r", "slurm_logfile": "l", "comment_str": "rule_train", "workdir": "."}
    call = get_submit_command(job, params | {"account": "-A a", "partition": "-p gpu"})
    return shlex.split(call + set_gres_string(job))


@pytest.mark.parametrize("nnodes", [1, 2])
def test_the_slurm_train_job_asks_one_task_per_node_with_its_gpus_and_cores(tmp_path, nnodes):
    """The sbatch line of the train job under the SLURM profile: `nnodes` nodes, one task on
    each (torchrun starts the ranks), all the topology's GPUs and the profile's 64 cores for that
    task. Plugin 2.8 turned `tasks` of a GPU job into --ntasks-per-gpu: 2 tasks of 64 cores here,
    8 on the profile's 8-GPU node. On several nodes the job runs its shell without the plugin's
    own one-task srun (`mpi`), and that shell's srun starts on each node the torchrun that
    test_distributed runs as two nodes on one host, with the node's cores."""
    import yaml

    config = yaml.safe_load((TESTS / "data/tiny.yaml").read_text())  # 1 target + 1 drafter
    config["train"] |= {"nnodes": nnodes, "rdzv_endpoint": "node1:29500"}
    (tmp_path / "nodes.yaml").write_text(yaml.safe_dump(config))
    shutil.copy(TESTS / "data/local.jsonl", tmp_path)  # the workflow hashes local sources
    profile = REPO / "workflow" / "profiles" / "slurm"
    flow = Workflow(REPO, tmp_path)
    out = flow.run(
        "-n", "-p", "train", "--workflow-profile", str(profile), config="nodes.yaml", cores=2
    )
    resources = planned_resources(out.stdout)["train"]
    line = sbatch_line(resources, threads=2)
    options = dict(o.split("=", 1) if "=" in o else (o, "") for o in line if o.startswith("--"))
    assert options["--nodes"] == str(nnodes) and options["--ntasks-per-node"] == "1"
    assert options.get("--ntasks", str(nnodes)) == str(nnodes)
    assert "--ntasks-per-gpu" not in options and "--cpus-per-gpu" not in options
    assert options["--gpus"] == "2" and options["--cpus-per-task"] == "64"
    assert "--exclusive" in options
    assert ("mpi" in resources) == (nnodes > 1)
    if nnodes > 1:
        (train,) = [line for line in out.stdout.splitlines() if " -m dflash train " in line]
        node = shlex.join(launch.command(config["train"], 2, python="python", cpus=2))
        assert node.startswith("srun --nodes 2 --ntasks-per-node 1 --cpus-per-task 2 ")
        assert f" OMP_NUM_THREADS=2 {node} -m dflash train " in train


def test_all_ends_with_a_lossless_evaluation_and_a_summary(tiny_workflow):
    import yaml

    from dflash.eval.report import PLOTS

    flow = tiny_workflow
    flow.run("all")
    acc = json.loads((flow.results / "eval/acceptance.json").read_text())
    assert acc["lossless"] == 1.0 and acc["n_prompts"] == 2 and acc["block_size"] == 8
    assert set(acc["baselines"]) == {"target", "lookup", "untrained", "drafter+lookup"}
    assert acc["baselines"]["drafter+lookup"]["lossless"] == 1.0  # the lookup branch is exact too
    assert acc["baselines"]["target"]["tau_macro"] == 1.0  # no drafts: one token per forward
    assert len(acc["reference_sha256"]) == 64  # the text every method was judged on
    assert 1.0 <= acc["tau_macro"] <= 8.0 and acc["teacher_forced_tau"] >= 1.0
    sim = acc["tau_sim"]  # the held-out prompts' regenerated rows, walked as decoding walks
    assert sim["rows"] == 2 and 1.0 <= sim["tau_sim"] <= 8.0 and sim["gap_pct"] is not None
    assert sim["matching_rows"]["rows"] + sim["diverged_rows"] == 2
    prompts = acc["per_prompt"]  # which prompts each method wins, and on the reference's text
    assert len(prompts["ids"]) == 2 and set(prompts["methods"]) == {
        "lookup",
        "untrained",
        "drafter",
        "drafter+lookup",
    }
    drafter = prompts["methods"]["drafter"]
    assert all(drafter["same"])  # float32: every method decodes the target's own tokens
    assert abs(sum(drafter["tau"]) / 2 - acc["tau_macro"]) < 1e-2
    # what else the machine did while each method's clock ran (a tiny method may take no sample)
    hosts = [acc["host"], *(b["host"] for b in acc["baselines"].values())]
    assert all(h["cpus"] >= 1 and h["other_cpu_samples"] >= 0 for h in hosts)
    # the same fixed steps timed after every method (on a CPU, the live sessions only)
    verify = f"verify_{acc['block_size']}_ms"
    assert acc["clock_probe"]["live"][verify] > 0 and "fixed" not in acc["clock_probe"]
    # every eval prompt searched for in the training rows (dflash/eval/overlap.py)
    overlap = acc["train_overlap"]
    assert sum(s["prompts"] for s in overlap.values()) == acc["n_prompts"]
    metrics = [
        json.loads(x) for x in (flow.results / "train/metrics.jsonl").read_text().splitlines()
    ]
    assert "tau_sim" in metrics[-1]  # logged at the last step
    # on the first answers, capped as decoding caps them, training's last tau_sim is the
    # evaluation's own prediction for the same drafter and rows (up to a flipped near tie:
    # training reads its features in bf16, the evaluation in fp32)
    assert metrics[-1]["tau_sim_first"] == pytest.approx(sim["tau_sim"], rel=0.05)
    tree = json.loads((flow.results / "eval/ddtree.json").read_text())
    assert [r["budget"] for r in tree["results"]] == [7, 4, 16] and tree["lossless"] == 1.0
    assert tree["target_host"]["cpus"] >= 1 and all(r["host"]["cpus"] >= 1 for r in tree["results"])
    assert tree["clock_probe"]["live"][verify] > 0
    summary = (flow.results / "summary.md").read_text()
    # the drafter's speedup on the prompts both stages decoded alike, stage against stage
    assert "**Clock check:** on the 2 prompts both stages decoded to the same text" in summary
    assert f"τ = {acc['tau_macro']:.3f} (macro" in summary
    assert f"{acc['tau_pooled']:.3f} pooled" in summary and "tau_sim" in summary
    assert "| drafter + lookup branch |" in summary
    assert "**Per prompt**" in summary and "of 2 prompts" in summary  # where lookup wins
    assert "**Eval prompts in the training data:**" in summary
    assert "s after the process started" in summary
    assert {p.name for p in (flow.results / "report").glob("*.png")} == {f"{n}.png" for n in PLOTS}
    # tiny.yaml evaluates at temperature 1 too: every method, both draft rules, two seeds
    sampled = json.loads((flow.results / "eval/sampling.json").read_text())
    (run,) = sampled["runs"]
    assert run["label"] == "T=1" and {"drafter", "drafter/probabilistic", "lookup"} <= set(
        run["methods"]
    )
    seeds = run["methods"]["drafter"]["seeds"]["tau_macro"]
    assert len(seeds) == 2 and all(1.0 <= t <= 8 for t in seeds)
    assert run["methods"]["drafter"]["overall"]["greedy_macro"] >= 1.0
    assert "**At temperature**" in summary and "tau_sim at T=1" in summary
    # what argmax drafts could reach at T = 1, per set, and the drafter's share of it
    ceiling, drafter = run["argmax_ceiling"], run["methods"]["drafter"]
    assert 1.0 <= ceiling["tau_macro"] <= 16 and set(ceiling["sets"]) == set(drafter["sets"])
    assert ceiling["drafter_share"] == pytest.approx(
        drafter["overall"]["tau_macro"] / ceiling["tau_macro"], abs=1e-3
    )
    assert "**Argmax drafts' ceiling at T=1:**" in summary
    quality = json.loads((flow.results / "MANIFEST.json").read_text())["eval"]["quality"]
    assert (
        quality["sampled_tau_macro"]["T=1"]["drafter"]
        == (run["methods"]["drafter"]["overall"]["tau_macro"])
    )

    changed = yaml.safe_load((flow.workdir / "tiny.yaml").read_text())
    changed["eval"]["max_new_tokens"] = 6
    (flow.workdir / "eval.yaml").write_text(yaml.safe_dump(changed))
    planned = set(flow.planned_jobs("all", config="eval.yaml")) - {"all"}
    # eval_sampling compares with the greedy τ of the same prompts: it reads both evaluations
    assert planned == {"eval_acceptance", "eval_ddtree", "eval_sampling", "report", "record"}


def reasons(out: str) -> dict[str, str]:
    """Rule -> the reason a dry run gives for its (last) job."""
    found, rule = {}, None
    for line in out.splitlines():
        if line.startswith(("rule ", "localrule ")):
            rule = line.split()[1].rstrip(":")
        elif line.strip().startswith("reason:") and rule:
            found[rule] = line.split("reason:", 1)[1].strip()
    return found


def test_reruns_are_as_narrow_as_the_change_and_the_reason_names_it(tiny_workflow):
    """Keys no output depends on (trackers, checkpoint cadence, timeouts, parallelism) rerun
    nothing, not even the record; a DDTree-only key reruns the tree evaluation and what reads it,
    never eval_acceptance; the dry run's reason names the key and its two values."""
    import yaml

    flow = tiny_workflow
    flow.run("all")
    config = yaml.safe_load((flow.workdir / "tiny.yaml").read_text())
    config["train"] |= {"tensorboard": False, "checkpoint_every": 3, "timeout_s": 120}
    config["data"]["num_proc"] = 2
    (flow.workdir / "inert.yaml").write_text(yaml.safe_dump(config))
    assert flow.planned_jobs("all", config="inert.yaml") == {}

    config["eval"]["ddtree"]["budgets"] = [4, 8]
    (flow.workdir / "tree.yaml").write_text(yaml.safe_dump(config))
    out = flow.run("-n", "all", config="tree.yaml").stdout
    assert set(jobs_in(out)) == {
        "eval_ddtree", "eval_sampling", "report", "record", "all"
    }  # fmt: skip
    why = reasons(out)["eval_ddtree"]
    assert "before: 'eval.ddtree.budgets=[4, 16]' now: 'eval.ddtree.budgets=[4, 8]'" in why
    assert len(why) < 300, why  # the key, not the config subset


def test_baselines_the_ddtree_subset_and_the_eval_dtype_are_configurable(tiny_workflow, tmp_path):
    """eval.baselines leaves the untrained drafter out (the summary does without it),
    eval.ddtree.max_prompts decodes trees and chain on the first prompts of each set only, and
    eval.dtype bfloat16 decodes (and is reported) in bf16."""
    import subprocess
    import sys

    import yaml

    from dflash.eval.report import summary_text

    flow = tiny_workflow
    flow.run("all")
    config = yaml.safe_load((flow.workdir / "tiny.yaml").read_text())
    # one prompt: bf16 runs 50-170x slower on a CPU without bf16 units (this test took
    # 694 s on a loaded 2-core EPYC with two prompts)
    config["eval"] |= {"baselines": ["lookup"], "with_lookup": False, "max_prompts": 1}
    config["eval"]["ddtree"] = {"budgets": [4], "max_prompts": 1, "with_lookup": True}
    config["eval"]["dtype"] = "bfloat16"  # as a serving engine decodes: near ties forgiven
    r = flow.results
    common = ["--config", json.dumps(config), "--target", str(flow.target / "hf")]
    common += ["--drafter", str(r / "drafter"), "--held-out", str(r / "data/expanded/eval.parquet")]
    for cmd, extra in (
        ("eval", ["--tokenized", str(r / "data/tokenized/eval.parquet")]),
        ("ddtree", []),
    ):
        out = ["--output", str(tmp_path / f"{cmd}.json")]
        done = subprocess.run(
            [sys.executable, "-m", "dflash", cmd, *common, *extra, *out],
            capture_output=True, text=True, cwd=flow.workdir, env=flow.env(),
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
    acc = json.loads((tmp_path / "eval.json").read_text())
    assert set(acc["baselines"]) == {"target", "lookup"} and acc["n_prompts"] == 1
    assert acc["dtype"] == "bfloat16" and isinstance(acc["near_ties"], dict)
    tree = json.loads((tmp_path / "ddtree.json").read_text())
    assert tree["n_prompts"] == 1 and [r["budget"] for r in tree["results"]] == [7, 4, 4]
    assert [r["method"] for r in tree["results"]] == ["chain", "tree-4", "tree-4+lookup"]
    assert [r["lookup"] for r in tree["results"]] == [False, False, True]
    assert tree["lossless"] == 1.0
    text = summary_text(
        *(json.loads((r / f).read_text()) for f in ("data/stats/stats.json", "train/summary.json")),
        [json.loads(x) for x in (r / "train/metrics.jsonl").read_text().splitlines()],
        acc,
        tree,
    )
    assert "prompt lookup" in text and "untrained" not in text and "(bfloat16; " in text
    assert "4 nodes + lookup τ" in text and "drafter + lookup" not in text
