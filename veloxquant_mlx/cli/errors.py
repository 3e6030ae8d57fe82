"""The one error type of the command line: what the user got wrong, printed as one ``error:`` line."""


class CLIError(Exception):
    """A user-facing error: printed as one line."""
