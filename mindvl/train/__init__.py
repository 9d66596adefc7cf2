"""Training: the loop, phases, optimiser, parallelism and metrics."""
