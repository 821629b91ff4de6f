"""Developer scripts; a package so tests can import `scripts.make_tiny_model` from the repo root."""
