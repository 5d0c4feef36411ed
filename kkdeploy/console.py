"""Terminal output shared by the commands: a rich console, progress bars and tables."""

from __future__ import annotations

from contextlib import contextmanager

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

import sys

# Logs and pipes get 120 columns so tables stay readable; a terminal keeps its own width.
console = Console(highlight=False, width=None if sys.stdout.isatty() else 120)
err_console = Console(stderr=True, highlight=False, width=None if sys.stderr.isatty() else 120)


@contextmanager
def progress_bar(description: str, total: int | None):
    """A progress bar on stderr; ``advance()`` moves it, ``describe(text)`` relabels it."""
    progress = Progress(
        SpinnerColumn(), TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
        TimeElapsedColumn(), console=err_console, transient=False,
    )
    with progress:
        task = progress.add_task(description, total=total)

        class Handle:
            def advance(self, n: int = 1):
                progress.advance(task, n)

            def describe(self, text: str):
                progress.update(task, description=text)

        yield Handle()


def table(title: str, columns: list[str], rows: list[list]) -> Table:
    t = Table(title=title, title_justify="left")
    for i, c in enumerate(columns):
        t.add_column(c, no_wrap=(i == 0), overflow="fold")
    for row in rows:
        t.add_row(*[str(v) for v in row])
    return t
