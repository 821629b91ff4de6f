"""After training: merge, export and generate, and the options of their scripts."""
