"""Errors a user can act on.

Everything the library refuses because of its input raises ``InputError``: the
message names the problem and the allowed range, so the CLI and the app can show
it as is.
"""


class InputError(ValueError):
    """A request was invalid; the message says what is allowed."""


class ModelLoadError(RuntimeError):
    """A model could not be loaded; the message says why in one line."""
