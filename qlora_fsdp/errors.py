"""The kinds of failure a run reports, each its own way: a user's mistake, a training run that cannot go on, and a
broken invariant of this code (a bug)."""


class UserError(Exception):
    """Bad input (flag, path, dataset row, model layout).

    The message names the problem and the fix. The CLI prints it as one line and exits with status 2
    instead of showing a traceback.
    """


class TrainingStopped(Exception):
    """Training cannot go on (a non-finite step, a signal with no checkpoint to save); the message names the step and
    what to try. The CLI prints it as one line and exits with status 3."""


class InternalError(Exception):
    """An invariant of this code failed (not something the flags or data can cause, as far as we know): the CLI shows
    the traceback, says it is a bug to report, and exits with status 1."""


BUG_REPORT = ("this is a bug in qlora-fsdp, not in your input: please report it with the traceback above, your "
              "command line and the output of `pip freeze`")  # fmt: skip
"""The line printed after an InternalError's traceback."""
