"""Saving and resuming: final artifacts, sharded DCP checkpoints, resume rules, the manifest."""
