"""The engine: one rank's training loop, evaluation and generation, checkpoints and export, metrics, profiling."""
