# Target resolution and the data stages: expand -> regenerate (sharded) -> tokenize.


rule target:
    """Turn the configured target (GGUF wheel, hub id or rehearsal) into a plain HF directory,
    under resources/ (an input of every run that names this target, not an output of one).
    """
    output:
        model=directory(f"{TARGET_DIR}/hf"),
        info=f"{TARGET_DIR}/target.json",
        manifest=f"{TARGET_DIR}/manifest.json",
    log:
        f"{RES}/logs/target/{TARGET_KEY}.log",
    params:
        **triggers("target", {"target.random_init.config": random_init_config_hash()}),
        config=stage_config("target"),
    shell:
        "python -m dflash target --config {params.config:q} --out {output.model}"
        " --info {output.info} --manifest {output.manifest} > {log} 2>&1"


rule expand_dataset:
    """Merge, normalise, dedupe, shuffle and split the configured chat sources."""
    output:
        train=f"{R}/data/expanded/train.parquet",
        eval=f"{R}/data/expanded/eval.parquet",
        report=f"{R}/data/expanded/report.json",
        manifest=f"{R}/manifests/expand_dataset.json",
    log:
        f"{R}/logs/expand_dataset.log",
    params:
        **triggers("expand_dataset", {"data.sources": local_source_hashes()}),
        config=stage_config("expand_dataset"),
    shell:
        "python -m dflash expand --config {params.config:q} --train {output.train}"
        " --eval {output.eval} --report {output.report} --manifest {output.manifest} > {log} 2>&1"


SHARDS = config["data"]["regenerate"]["shards"]


rule regenerate_shard:
    """Rewrite assistant turns of one shard with the target's greedy output (resumable)."""
    input:
        rows=f"{R}/data/expanded/{{split}}.parquet",
        target=target_input(),
    output:
        shard=f"{R}/data/regenerated/{{split}}.shard{{shard}}-of-{SHARDS}.parquet",
        manifest=f"{R}/manifests/regenerate_{{split}}_{{shard}}.json",
    log:
        f"{R}/logs/regenerate_{{split}}_{{shard}}.log",
    # shards of both splits (train, eval) run side by side, each on a GPU of its own
    # (dflash.gpus), sharing the cores; on a GPU host a shard's work is on its GPU, so half the
    # cores stay free for the jobs beside it: the compile warmup must run during regeneration (on
    # one H200 it waited 171 s for the cores after it, when the two splits' shards held them all)
    threads: max(1, workflow.cores // SHARDS // (4 if HAS_GPU else 1))
    resources:
        gpu=1 if HAS_GPU else 0,
    params:
        **triggers("regenerate_shard", {"target.path": target_fingerprint()}),
        config=stage_config("regenerate_shard"),
        target=passed(TARGET),
        workdir=lambda wildcards, output: f"{R}/work/regenerate/{wildcards.split}",
        shards=passed(SHARDS),
    shell:
        "OMP_NUM_THREADS={threads} python -m dflash regenerate --config {params.config:q}"
        " --target {params.target} --input {input.rows} --output {output.shard}"
        " --workdir {params.workdir} --shard {wildcards.shard} --shards {params.shards}"
        " --manifest {output.manifest} > {log} 2>&1"


rule regenerate:
    """Merge the shards back into the expanded split's row order, checking every row is there."""
    input:
        rows=f"{R}/data/expanded/{{split}}.parquet",
        shards=expand(
            f"{R}/data/regenerated/{{{{split}}}}.shard{{shard}}-of-{SHARDS}.parquet",
            shard=range(SHARDS),
        ),
    output:
        rows=f"{R}/data/regenerated/{{split}}.parquet",
        manifest=f"{R}/manifests/regenerate_{{split}}.json",
    log:
        f"{R}/logs/regenerate_{{split}}.log",
    params:
        **triggers("regenerate"),
    shell:
        "python -m dflash merge-shards --input {input.rows}"
        " --shard-files {input.shards} --output {output.rows} --manifest {output.manifest}"
        " > {log} 2>&1"


rule tokenize:
    """Render with the target's chat template; loss mask on assistant content + end of turn."""
    input:
        rows=lambda wc: regenerated(wc.split),
        target=target_input(),
    output:
        rows=f"{R}/data/tokenized/{{split}}.parquet",
        report=f"{R}/data/tokenized/{{split}}.report.json",
        manifest=f"{R}/manifests/tokenize_{{split}}.json",
    log:
        f"{R}/logs/tokenize_{{split}}.log",
    threads: config["data"]["num_proc"]
    params:
        **triggers("tokenize", {"target.path": target_fingerprint()}),
        config=stage_config("tokenize"),
        target=passed(TARGET),
    shell:
        "python -m dflash tokenize --config {params.config:q} --target {params.target}"
        " --input {input.rows} --output {output.rows} --manifest {output.manifest} > {log} 2>&1"
