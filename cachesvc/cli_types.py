"""Types shared by the CLI's command modules."""


class CliError(Exception):
    """A user-facing error: printed as one line, exit status 2."""
