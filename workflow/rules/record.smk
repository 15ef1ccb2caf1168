# The run record (results/MANIFEST.json): every declared output's sha256 plus what the numbers
# depend on. `verify` re-hashes against it; `dflash compare` diffs two of them.
from pathlib import Path

from dflash.manifest import PACKAGE_ROOT
from dflash.record import git_state, source_files


rule record:
    """results/MANIFEST.json: sha256 of every artefact plus code, environment, config, data,
    topology, throughput per role and τ."""
    input:
        # not the target's folder (see target_input): its stage manifest
        outputs=declared_outputs(folders=False),
        inputs=RECORDED_INPUTS.values(),
    output:
        report(
            f"{R}/MANIFEST.json", category="Run record", caption="../report/record.rst"
        ),
    log:
        f"{R}/logs/record.log",
    params:
        **triggers(
            "record",
            {
                "source": source_files(Path(workflow.basedir)),
                "git": json.dumps(git_state(PACKAGE_ROOT.parent), sort_keys=True),
            },
        ),
        results=lambda wildcards, output: os.path.dirname(output[0]),
        # relative to the working directory: moving the checkout (the working directory inside
        # it) reruns nothing; what the workflow files hold is a trigger
        workflow_dir=passed(os.path.relpath(workflow.basedir)),
        config=stage_config("record"),
        artefacts=passed(declared_outputs()),
        inputs=passed(
            [f"--input={k}={os.path.dirname(v)}" for k, v in RECORDED_INPUTS.items()]
        ),
        # the whole config but for INERT keys, every package and workflow file, the commit
    shell:
        "python -m dflash record --config {params.config:q} --results {params.results}"
        " --workflow-dir {params.workflow_dir:q} --output {output}"
        " {params.inputs:q} {params.artefacts} > {log} 2>&1"


rule verify:
    """Re-hash every artefact against results/MANIFEST.json (always runs; fails on a mismatch).
    No input on purpose: Snakemake would first bring the record up to date, re-recording a
    corrupted file instead of catching it."""
    log:
        f"{R}/logs/verify.log",
    params:
        results=R,
    # on the terminal too: what differs is the answer the user ran this for
    shell:
        "python -m dflash verify {params.results} 2>&1 | tee {log}"
