"""Every option of a run: typed sections, the objectives' settings, and the help text read from them."""
