# One-thread torch.compile warmup of the drafter step for every bucket shape. The cache folder is
# deliberately not a declared output: Snakemake deletes declared outputs of failed jobs, and a
# lost cache costs every later training start minutes of recompilation.


rule warmup_compile:
    """Compile the drafter training step for each (batch, bucket length) into the shared cache."""
    input:
        stats=f"{R}/data/stats/stats.json",
        target=target_input(),
    output:
        record=f"{R}/compile/warmup.json",
        manifest=f"{R}/manifests/warmup_compile.json",
    log:
        f"{R}/logs/warmup_compile.log",
    resources:
        gpu=1 if HAS_GPU else 0,
    params:
        config=config_json("results", "drafter", "compile", "target.mask_token_id"),
        cache=COMPILE_CACHE,
        target=target_fingerprint(),
        code=code_hash("dflash.model.warmup"),
        env=ENV_HASH,
    shell:
        "{DFLASH} warmup --config {params.config:q} --target {TARGET}"
        " --stats {input.stats} --record {output.record} --cache-dir {params.cache}"
        " --manifest {output.manifest}"
        " > {log} 2>&1"
