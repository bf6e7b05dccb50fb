"""The training loop a worker runs: the trainer, its averaging strategy, recipe and optimizer,
checkpoints, loggers and metrics, drift, and stop and NaN handling."""
