"""Exceptions that carry a message for the user."""


class UserError(Exception):
    """Bad input from the user (unknown model, unparsable size, malformed file): one line, exit 2."""
