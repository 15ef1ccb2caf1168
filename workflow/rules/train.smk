# Drafter training under torchrun: `train.topology` gives the processes (targets send features,
# drafters train with DDP; targets 0 = colocated). Checkpoints live outside the declared outputs:
# Snakemake deletes declared outputs of a failed job, and a rerun of this rule resumes from the
# newest valid checkpoint.

from dflash.train import launch

TOPOLOGY = config["train"]["topology"]
WORLD = TOPOLOGY["targets"] + TOPOLOGY["drafters"]
NODES = config["train"]["nnodes"]
# Under SLURM (workflow/profiles/slurm), one task per node holds that node's GPUs and cores and
# runs torchrun, which starts the ranks. On several nodes `mpi` makes the plugin run this rule's
# shell in the batch script itself (not in its own one-task, one-node srun), so that the shell's
# srun can start a torchrun on every node; the plugin then wants `tasks`, one per node.
SLURM_TASKS = {"mpi": "srun", "tasks": NODES} if NODES > 1 else {}


rule train:
    """Train the drafter; write it in the public DFlash HF layout, per-step metrics and a summary."""
    input:
        unpack(held_out_rows),
        data=f"{R}/data/tokenized/train.parquet",
        target=target_input(),
        warmup=f"{R}/compile/warmup.json",
    output:
        drafter=DRAFTER_FILES,
        metrics=f"{R}/train/metrics.jsonl",
        summary=f"{R}/train/summary.json",
        manifest=f"{R}/manifests/train.json",
    log:
        f"{R}/logs/train.log",
    threads: workflow.cores
    resources:
        **SLURM_TASKS,
        gpu=WORLD if HAS_GPU else 0,
        nodes=NODES,
        # the SLURM plugin (2.8) turns `tasks` of a GPU job into --ntasks-per-gpu: 0 keeps it out
        tasks_per_gpu=0,
    params:
        **triggers(
            "train",
            {
                "target.path": target_fingerprint(),
                "drafter.init": init_identity_param(),
            },
        ),
        config=stage_config("train"),
        # torchrun on one node; srun starting one torchrun per node on `train.nnodes`, each
        # with the node's cores. Computed from threads, so no rerun trigger of its own
        # (train.nnodes and the topology reach the rule through `config`)
        launch=lambda wildcards, threads: shlex.join(
            launch.command(config["train"], WORLD, python="python", cpus=threads)
        ),
        # the cores of a node shared by the ranks it runs (a thread count is no rerun trigger)
        omp_threads=lambda wildcards, threads: max(
            1, threads // launch.procs_per_node(config["train"], WORLD)
        ),
        # the drafter's folder (derived from the output, so no rerun trigger of its own)
        drafter=lambda wildcards, output: os.path.dirname(output.drafter[0]),
        checkpoints=passed(f"{R}/checkpoints"),
        held_out=lambda wildcards, input: (
            f"--held-out {input.held_out}" if "held_out" in input.keys() else ""
        ),
        target=passed(TARGET),
        cache=passed(COMPILE_CACHE),
    shell:
        "TORCHINDUCTOR_CACHE_DIR={params.cache}/inductor TRITON_CACHE_DIR={params.cache}/triton"
        " OMP_NUM_THREADS={params.omp_threads}"
        " {params.launch} -m dflash train"
        " --config {params.config:q} --target {params.target} --data {input.data}"
        " --out {params.drafter} --metrics {output.metrics} --summary {output.summary}"
        " {params.held_out} --checkpoints {params.checkpoints} --manifest {output.manifest}"
        " > {log} 2>&1"
