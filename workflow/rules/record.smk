# The run record (results/MANIFEST.json): every declared output's sha256 plus what the numbers
# depend on. `verify` re-hashes against it; `dflash compare` diffs two of them.
from pathlib import Path

from snakemake.io import is_flagged

from dflash.manifest import PACKAGE_ROOT
from dflash.record import git_state, source_files


def recorded_rules():
    """The rules whose outputs this config produces."""
    names = ["expand_dataset", "tokenize", "length_stats", "warmup_compile", "train"]
    names += ["eval_acceptance", "eval_ddtree", "report"]
    if not config["target"]["path"]:
        names.append("target")
    if config["data"]["regenerate"]["enabled"]:
        names += ["regenerate_shard", "regenerate"]
    return names


def declared_outputs(folders=True):
    """Every output those rules declare, wildcards filled in (logs and working state are not
    outputs and are not recorded); without directory() outputs if not `folders`."""
    paths = set()
    for name in recorded_rules():
        for pattern in workflow.get_rule(name).output:
            if folders or not is_flagged(pattern, "directory"):
                # both splits: the eval rules read the eval split even when data.eval_rows is 0
                paths.update(
                    expand(str(pattern), split=["train", "eval"], shard=range(SHARDS))
                )
    return sorted(paths)


rule record:
    """results/MANIFEST.json: sha256 of every artefact plus code, environment, config, data,
    topology, throughput per role and τ."""
    input:
        # not the target's folder (see target_input); its stage manifest is among these
        declared_outputs(folders=False),
    output:
        report(
            f"{R}/MANIFEST.json", category="Run record", caption="../report/record.rst"
        ),
    log:
        f"{R}/logs/record.log",
    params:
        config=json.dumps(config, sort_keys=True),
        code=source_files(Path(workflow.basedir)),
        git=git_state(PACKAGE_ROOT.parent),
        env=ENV_HASH,
        artefacts=declared_outputs(),
    shell:
        "{DFLASH} record --config {params.config:q} --results {R}"
        " --workflow-dir {workflow.basedir} --output {output} {params.artefacts} > {log} 2>&1"


rule verify:
    """Re-hash every artefact against results/MANIFEST.json (always runs; fails on a mismatch).
    No input on purpose: Snakemake would first bring the record up to date, re-recording a
    corrupted file instead of catching it."""
    shell:
        "{DFLASH} verify {R}"
