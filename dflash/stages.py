"""What a stage reads, declared apart from the stage itself, so that the Snakefile and
`dflash compare` know it without importing the stage (or torch).

Training: the code it runs (the loop module and all it imports; the train rule's code param and
part of the resume contract) and the config keys it reads (the train rule passes exactly these:
its rerun trigger).
"""

TRAINING_CODE = ("dflash.train.loop",)
TRAINING_CONFIG = (
    "seed",
    "target.mask_token_id",
    "drafter",
    "compile",
    "train",
    "data.buckets",
    "data.max_length",
    "data.token_budget",
    "data.max_batch_size",
    # the mode the training answers were made in, recorded in the drafter's config.json
    "data.regenerate.temperature",
    "data.regenerate.top_p",
    "data.regenerate.top_k",
    "data.chat_template_kwargs",
    # tau_sim at train.tau_sim.temperatures takes the evaluation's top-p and top-k
    "eval.sampling.top_p",
    "eval.sampling.top_k",
)
