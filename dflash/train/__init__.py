"""Training: distributed roles, batching, optimiser and schedule, checkpoints, metrics."""
