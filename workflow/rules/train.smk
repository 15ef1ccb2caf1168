# Drafter training. For now one process with a colocated target (`dflash train`); the multi-GPU
# torchrun launch with target and drafter roles replaces this command (issue 4). Checkpoints live
# outside the declared outputs: Snakemake deletes declared outputs of a failed job, and a rerun
# of this rule resumes from the newest valid checkpoint.


rule train:
    """Train the drafter; write it in the public DFlash HF layout plus per-step metrics."""
    input:
        data=f"{R}/data/tokenized/train.parquet",
        target=target_dir(),
        warmup=f"{R}/compile/warmup.json",
    output:
        drafter=directory(f"{R}/drafter"),
        metrics=f"{R}/train/metrics.jsonl",
    log:
        f"{R}/logs/train.log",
    threads: workflow.cores
    resources:
        gpu=1 if HAS_GPU else 0,
    params:
        config=config_json(
            "seed",
            "target.mask_token_id",
            "drafter",
            "compile",
            "train",
            "data.buckets",
            "data.max_length",
            "data.token_budget",
            "data.max_batch_size",
        ),
        checkpoints=f"{R}/checkpoints",
        cache=COMPILE_CACHE,
        code=code_hash("model", "train", "data/batching.py"),
        env=ENV_HASH,
    shell:
        "TORCHINDUCTOR_CACHE_DIR={params.cache}/inductor TRITON_CACHE_DIR={params.cache}/triton"
        " OMP_NUM_THREADS={threads} {DFLASH} train --config {params.config:q}"
        " --target {input.target} --data {input.data} --out {output.drafter}"
        " --metrics {output.metrics} --checkpoints {params.checkpoints} > {log} 2>&1"
