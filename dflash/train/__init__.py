"""Training: distributed roles, batching, optimiser and schedule, checkpoints, metrics."""

# What training runs (the loop module and all it imports): the train rule's code param and part
# of the resume contract. Here, not in loop.py, so the Snakefile and `dflash compare` read them
# without importing torch.
TRAINING_CODE = ("dflash.train.loop",)
# The config keys training reads: the train rule passes exactly these (its rerun trigger).
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
