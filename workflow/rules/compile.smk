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
        **triggers("warmup_compile", {"target.path": target_fingerprint()}),
        config=stage_config("warmup_compile"),
        cache=passed(COMPILE_CACHE),
        target=passed(TARGET),
    shell:
        "python -m dflash warmup --config {params.config:q} --target {params.target}"
        " --record {output.record} --cache-dir {params.cache}"
        " --manifest {output.manifest}"
        " > {log} 2>&1"
