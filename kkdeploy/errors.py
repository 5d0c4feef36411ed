"""User-facing errors: one line that names the problem and the fix.

The CLI prints ``KKError`` messages without a traceback; anything else is a bug.
"""


class KKError(ValueError):
    """A problem with the user's input or environment, explained in one line."""
