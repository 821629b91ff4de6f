"""Training: the trainer that builds a run, the step loop, the optimizer, evaluation and metrics."""
