"""Beside training: merge, export and generate after it, plan a run before it, and the options of their scripts."""
