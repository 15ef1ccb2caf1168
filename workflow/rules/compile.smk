# One-thread torch.compile warmup of the drafter step for every bucket shape. The shapes follow
# from the config (compiled training pads each batch to its bucket's shape), so the warmup needs
# only the target's config and runs beside regeneration. The cache folder is deliberately not a
# declared output: Snakemake deletes declared outputs of failed jobs, and a lost cache costs every
# later training start minutes of recompilation.


rule warmup_compile:
    """Compile the drafter training step for each (batch, bucket length) into the shared cache."""
    input:
        target=target_input(),
    output:
        record=f"{R}/compile/warmup.json",
        manifest=f"{R}/manifests/warmup_compile.json",
    log:
        f"{R}/logs/warmup_compile.log",
    resources:
        gpu=1 if HAS_GPU else 0,
    params:
        config=config_json(
            "results",
            # the drafter's shapes, not where its weights start: a new init compiles nothing
            *(f"drafter.{key}" for key in config["drafter"] if key != "init"),
            "compile",
            "target.mask_token_id",
            "data.buckets",
            "data.max_length",
            "data.token_budget",
            "data.max_batch_size",
            "train.distill",
        ),
        cache=COMPILE_CACHE,
        target=TARGET,
        target_files=target_fingerprint(),
        code=code_hash("dflash.train.warmup"),
        env=ENV_HASH,
    shell:
        "python -m dflash warmup --config {params.config:q} --target {params.target}"
        " --record {output.record} --cache-dir {params.cache}"
        " --manifest {output.manifest}"
        " > {log} 2>&1"
