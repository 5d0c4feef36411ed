"""User-facing errors: one line that names the problem and the fix.

The CLI prints ``KKError`` messages without a traceback; anything else is a bug.
"""


class KKError(ValueError):
    """A problem with the user's input or environment, explained in one line."""


MAX_ERROR_CHARS = 500  # a recorded failure stays one readable line in a report, a manifest or a table


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message; its type's name when the message is empty."""
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


def error_summary(exc: BaseException, limit: int = MAX_ERROR_CHARS) -> str:
    """``Type: first line of the message``, at most ``limit`` characters: how every caught failure is recorded
    (validation reports, build statuses, fresh-process probes, bench rows)."""
    lines = str(exc).strip().splitlines()
    text = f"{type(exc).__name__}: {lines[0] if lines else ''}".rstrip(": ")
    return text if len(text) <= limit else text[: limit - 3] + "..."
