"""Errors a user can fix: shown as a message, never as a traceback."""


class UserError(ValueError):
    """Bad input or an unavailable resource; the message names the problem and what to do."""
