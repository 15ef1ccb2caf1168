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
        config=config_json("target", "cache_dir"),
        model_config=random_init_config_hash(),
        code=code_hash("dflash.model.convert", "dflash.model.random_target"),
        env=ENV_HASH,
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
        config=config_json(
            "seed",
            "cache_dir",
            "data.sources",
            "data.on_bad_row",
            "data.max_turns",
            "data.max_chars",
            "data.domain_rows",
            "data.train_rows",
            "data.train_fraction",
            "data.regenerate.samples",
            "data.eval_rows",
        ),
        local_sources=local_source_hashes(),
        code=code_hash("dflash.data.expand"),
        env=ENV_HASH,
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
        # cache_dir: the file hashes of the target (dflash/filehash.py) that resuming checks
        config=config_json(
            "data.regenerate",
            "data.max_length",
            "data.chat_template_kwargs",
            "cache_dir",
            # the streams of sampled answers start from the run's seed; greedy ones do not
            *(["seed"] if config["data"]["regenerate"]["temperature"] > 0 else []),
        ),
        target=TARGET,
        target_files=target_fingerprint(),
        workdir=f"{R}/work/regenerate/{{split}}",
        shards=SHARDS,
        code=code_hash("dflash.data.regenerate"),
        env=ENV_HASH,
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
        code=code_hash("dflash.data.regenerate"),
        env=ENV_HASH,
    shell:
        "python -m dflash merge-shards --config '{{}}' --input {input.rows}"
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
        config=config_json(
            "data.max_length", "data.num_proc", "data.chat_template_kwargs"
        ),
        target=TARGET,
        target_files=target_fingerprint(),
        code=code_hash("dflash.data.tokenization"),
        env=ENV_HASH,
    shell:
        "python -m dflash tokenize --config {params.config:q} --target {params.target}"
        " --input {input.rows} --output {output.rows} --manifest {output.manifest} > {log} 2>&1"
