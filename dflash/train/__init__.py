"""Training: distributed roles, batching, optimiser and schedule, checkpoints, metrics.
What it runs and reads is declared in `dflash.stages`."""
