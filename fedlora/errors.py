"""Errors users see. One class, so the CLI can print them as one line without a traceback."""


class ConfigError(ValueError):
    """A bad option or input: the message names the field and what is allowed."""
