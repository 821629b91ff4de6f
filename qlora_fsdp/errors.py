"""The one exception type users see: a problem they can fix, printed as a single line."""


class UserError(Exception):
    """Bad input (flag, path, dataset row, model layout).

    The message names the problem and the fix. The CLI prints it as one line and exits with status 2
    instead of showing a traceback.
    """
