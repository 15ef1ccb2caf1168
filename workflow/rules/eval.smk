# Evaluation: real speculative decoding of the exported drafter (not training state), its
# baselines, DDTree, and the report a person reads first (results/summary.md).


# the evaluation at temperature, where eval.sampling names temperatures
WITH_SAMPLING = bool(config["eval"]["sampling"]["temperatures"])
# vLLM serves the drafter where it is installed on a GPU host (eval.vllm.enabled: auto), or always
WITH_VLLM = config["eval"]["vllm"]["enabled"] is True or (
    config["eval"]["vllm"]["enabled"] == "auto"
    and HAS_GPU
    and importlib.util.find_spec("vllm") is not None
)
# SGLang likewise, where its engine processes can import it (from eval.sglang.site where given)
WITH_SGLANG = config["eval"]["sglang"]["enabled"] is True or (
    config["eval"]["sglang"]["enabled"] == "auto"
    and HAS_GPU
    and sglang_installed(config["eval"]["sglang"]["site"])
)


rule eval_acceptance:
    """τ (pooled, macro), histogram, per-position rates, speedup, lossless check; baselines."""
    input:
        **eval_inputs(),
        tokenized=f"{R}/data/tokenized/eval.parquet",
        # eval prompts found in the training rows are reported (dflash/eval/overlap.py)
        train=f"{R}/data/expanded/train.parquet",
    output:
        acceptance=report(f"{R}/eval/acceptance.json", category="Evaluation"),
        manifest=f"{R}/manifests/eval_acceptance.json",
    log:
        f"{R}/logs/eval_acceptance.log",
    threads: workflow.cores
    resources:
        gpu=1 if HAS_GPU else 0,
    params:
        **triggers("eval_acceptance", eval_files()),
        config=stage_config("eval_acceptance"),
        drafter=lambda wildcards, input: os.path.dirname(input.drafter[0]),
        target=passed(TARGET),
    shell:
        "OMP_NUM_THREADS={threads} python -m dflash eval --config {params.config:q}"
        " --target {params.target} --drafter {params.drafter} --held-out {input.held_out}"
        " --tokenized {input.tokenized} --train {input.train} --output {output.acceptance}"
        " --manifest {output.manifest} > {log} 2>&1"


rule eval_ddtree:
    """Tree drafting from the same drafter: τ and speedup by node budget."""
    input:
        **eval_inputs(),
    output:
        ddtree=report(f"{R}/eval/ddtree.json", category="Evaluation"),
        manifest=f"{R}/manifests/eval_ddtree.json",
    log:
        f"{R}/logs/eval_ddtree.log",
    threads: workflow.cores
    resources:
        gpu=1 if HAS_GPU else 0,
    params:
        **triggers("eval_ddtree", eval_files()),
        config=stage_config("eval_ddtree"),
        drafter=lambda wildcards, input: os.path.dirname(input.drafter[0]),
        target=passed(TARGET),
    shell:
        "OMP_NUM_THREADS={threads} python -m dflash ddtree --config {params.config:q}"
        " --target {params.target} --drafter {params.drafter} --held-out {input.held_out}"
        " --output {output.ddtree} --manifest {output.manifest} > {log} 2>&1"


rule eval_sampling:
    """The evaluation's methods again at each temperature of eval.sampling (speculative
    sampling as the engines serve), beside the greedy τ of the same prompts; tau_sim there.
    """
    input:
        **eval_inputs(),
        tokenized=f"{R}/data/tokenized/eval.parquet",
        acceptance=f"{R}/eval/acceptance.json",
        ddtree=[f"{R}/eval/ddtree.json"] if config["eval"]["sampling"]["ddtree"] else [],
    output:
        sampling=report(f"{R}/eval/sampling.json", category="Evaluation"),
        manifest=f"{R}/manifests/eval_sampling.json",
    log:
        f"{R}/logs/eval_sampling.log",
    threads: workflow.cores
    resources:
        gpu=1 if HAS_GPU else 0,
    params:
        **triggers("eval_sampling", eval_files()),
        config=stage_config("eval_sampling"),
        drafter=lambda wildcards, input: os.path.dirname(input.drafter[0]),
        ddtree=lambda wildcards, input: (
            f" --ddtree {input.ddtree[0]}" if input.ddtree else ""
        ),
        target=passed(TARGET),
    shell:
        "OMP_NUM_THREADS={threads} python -m dflash sample-eval --config {params.config:q}"
        " --target {params.target} --drafter {params.drafter} --held-out {input.held_out}"
        " --tokenized {input.tokenized} --acceptance {input.acceptance}{params.ddtree}"
        " --output {output.sampling} --manifest {output.manifest} > {log} 2>&1"


rule eval_vllm:
    """vLLM's DFlash method serving the run's target and drafter on the same prompts: its own
    acceptance length per prompt and tokens/s, beside the target alone in vLLM and our τ.
    """
    input:
        **eval_inputs(),
        acceptance=f"{R}/eval/acceptance.json",
        sampling=[f"{R}/eval/sampling.json"] if WITH_SAMPLING else [],
    output:
        vllm=report(f"{R}/eval/vllm.json", category="Evaluation"),
        manifest=f"{R}/manifests/eval_vllm.json",
    log:
        f"{R}/logs/eval_vllm.log",
    threads: workflow.cores
    resources:
        gpu=1 if HAS_GPU else 0,
    params:
        **triggers("eval_vllm", eval_files()),
        config=stage_config("eval_vllm"),
        drafter=lambda wildcards, input: os.path.dirname(input.drafter[0]),
        target=passed(TARGET),
        sampling=lambda wildcards, input: (
            f" --sampling {input.sampling[0]}" if input.sampling else ""
        ),
    shell:
        "python -m dflash eval-vllm --config {params.config:q} --target {params.target}"
        " --drafter {params.drafter} --held-out {input.held_out}"
        " --acceptance {input.acceptance}{params.sampling} --output {output.vllm}"
        " --manifest {output.manifest} > {log} 2>&1"


rule eval_sglang:
    """SGLang's DFLASH worker serving the run's target and drafter on the same prompts: its
    acceptance length per prompt (from meta_info) and tokens/s, beside the target alone in SGLang
    and our τ.
    """
    input:
        **eval_inputs(),
        acceptance=f"{R}/eval/acceptance.json",
        sampling=[f"{R}/eval/sampling.json"] if WITH_SAMPLING else [],
    output:
        sglang=report(f"{R}/eval/sglang.json", category="Evaluation"),
        manifest=f"{R}/manifests/eval_sglang.json",
    log:
        f"{R}/logs/eval_sglang.log",
    threads: workflow.cores
    resources:
        gpu=1 if HAS_GPU else 0,
    params:
        **triggers("eval_sglang", eval_files()),
        config=stage_config("eval_sglang"),
        drafter=lambda wildcards, input: os.path.dirname(input.drafter[0]),
        target=passed(TARGET),
        sampling=lambda wildcards, input: (
            f" --sampling {input.sampling[0]}" if input.sampling else ""
        ),
    shell:
        "python -m dflash eval-sglang --config {params.config:q} --target {params.target}"
        " --drafter {params.drafter} --held-out {input.held_out}"
        " --acceptance {input.acceptance}{params.sampling} --output {output.sglang}"
        " --manifest {output.manifest} > {log} 2>&1"


rule report:
    """results/summary.md plus the plots of `snakemake --report`."""
    input:
        stats=f"{R}/data/stats/stats.json",
        metrics=f"{R}/train/metrics.jsonl",
        train_summary=f"{R}/train/summary.json",
        acceptance=f"{R}/eval/acceptance.json",
        ddtree=f"{R}/eval/ddtree.json",
        vllm=[f"{R}/eval/vllm.json"] if WITH_VLLM else [],
        sglang=[f"{R}/eval/sglang.json"] if WITH_SGLANG else [],
        sampling=[f"{R}/eval/sampling.json"] if WITH_SAMPLING else [],
        tokenized=f"{R}/data/tokenized/train.report.json",
    output:
        summary=report(f"{R}/summary.md", category="Summary"),
        plots=[report(f"{R}/report/{name}.png", category="Plots") for name in PLOTS],
        manifest=f"{R}/manifests/report.json",
    log:
        f"{R}/logs/report.log",
    params:
        **triggers("report"),
        plots=lambda wildcards, output: os.path.dirname(output.plots[0]),
        vllm=lambda wildcards, input: f" --vllm {input.vllm[0]}" if input.vllm else "",
        sglang=lambda wildcards, input: (
            f" --sglang {input.sglang[0]}" if input.sglang else ""
        ),
        sampling=lambda wildcards, input: (
            f" --sampling {input.sampling[0]}" if input.sampling else ""
        ),
        # the summary names the drafter and the target to serve it with
        drafter=DRAFTER,
        serve_target=SERVE_TARGET,
    shell:
        "python -m dflash report --stats {input.stats} --metrics {input.metrics}"
        " --train-summary {input.train_summary} --acceptance {input.acceptance}"
        " --ddtree {input.ddtree}{params.vllm}{params.sglang}{params.sampling}"
        " --tokenized {input.tokenized}"
        " --drafter {params.drafter:q} --serve-target {params.serve_target:q}"
        " --summary {output.summary} --plots {params.plots}"
        " --manifest {output.manifest} > {log} 2>&1"
