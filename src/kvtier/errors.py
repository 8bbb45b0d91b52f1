"""Exceptions that carry a message for the user."""


class UserError(Exception):
    """Bad input from the user (unknown model, unparsable size, malformed file): one line, exit 2."""


class ConfigError(UserError, ValueError):
    """A bad setting or tier spec: a user error (one line, exit 2) and a ValueError to library callers."""
