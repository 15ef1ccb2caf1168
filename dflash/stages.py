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
)
