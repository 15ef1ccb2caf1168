# Length statistics of the tokenized training data: the bucket table batching will use.


rule length_stats:
    """Count, mean, percentiles, histogram, bucket table, drift against a previous run; the
    summaries per domain of the expanded rows."""
    input:
        rows=f"{R}/data/tokenized/train.parquet",
        domains=f"{R}/data/expanded/train.parquet",
    output:
        json=f"{R}/data/stats/stats.json",
        plot=report(
            f"{R}/data/stats/stats.png", category="Data", caption="../report/stats.rst"
        ),
        manifest=f"{R}/manifests/length_stats.json",
    log:
        f"{R}/logs/length_stats.log",
    params:
        **triggers("length_stats", {"data.previous_stats": previous_stats_hash()}),
        config=stage_config("length_stats"),
    shell:
        "python -m dflash stats --config {params.config:q} --input {input.rows}"
        " --domains {input.domains} --json {output.json} --plot {output.plot}"
        " --manifest {output.manifest} > {log} 2>&1"
