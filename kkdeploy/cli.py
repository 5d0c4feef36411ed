"""The ``kkdeploy`` command line: one subcommand per module in ``kkdeploy.commands``."""

from __future__ import annotations

import argparse
import sys

from .errors import KKError


class Parser(argparse.ArgumentParser):
    """argparse with options spelled out and its errors on one line.

    Why: argparse takes any unambiguous prefix of an option by default, so ``kkdeploy loadtest --out DIR`` was read
    as ``--output-device DIR`` and refused with a usage block about that option's choices (a new user's run on the
    GPU). Options must be written in full; a mistake is one line naming it and where the options are listed."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def parse_args(self, args=None, namespace=None):
        namespace, extras = self.parse_known_args(args, namespace)
        if extras:  # named by the subcommand they were given to, not by the top-level parser
            chosen = next((action.choices.get(getattr(namespace, "command", None)) for action in self._actions
                           if isinstance(action, argparse._SubParsersAction)), None)
            (chosen or self).error(f"unrecognized arguments: {' '.join(extras)}")
        return namespace

    def error(self, message: str):
        hint = ("options are written in full; " if message.startswith("unrecognized arguments") else "")
        self.exit(2, f"{self.prog}: error: {message} ({hint}`{self.prog} --help` lists what it takes)\n")


def build_parser() -> argparse.ArgumentParser:
    from . import commands

    parser = Parser(prog="kkdeploy", description="Export, build, validate and ship verified KernelKraft engines.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in commands.MODULES:
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        return int(args.func(args) or 0)
    except KKError as exc:
        from .console import err_console

        err_console.print(f"[bold red]error:[/] {exc}", soft_wrap=True)
        return 2
    except ModuleNotFoundError as exc:  # a dependency missing from this environment: name it, no traceback
        from .console import err_console

        package = (exc.name or "?").split(".")[0]
        err_console.print(f"[bold red]error:[/] kkdeploy needs the Python package {package!r}, which is not "
                          f"installed here; install it (pip install {package}) or the project's requirements "
                          f"(pip install -e .)", soft_wrap=True)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def exit_without_teardown(code: int) -> None:
    """End the process the way the interpreter would, less its teardown of every module and object.

    Why: after a GPU build the interpreter spent 2.1 s tearing down torch, Inductor and the CUDA context (H200, shape
    6, docs/results.md) after everything the command does was done. What the interpreter's exit does that
    matters runs here, in its order: the threads' exit hooks and the join of every non-daemon thread
    (``threading._shutdown``: thread pools finish their work), the ``atexit`` handlers (Inductor's compile workers,
    ``weakref.finalize`` such as temporary directories, multiprocessing's children, logging), and a flush of stdout
    and stderr. Then ``os._exit``. Where ``threading._shutdown`` does not exist (another Python), the normal exit."""
    import atexit
    import os
    import threading

    shutdown = getattr(threading, "_shutdown", None)
    if shutdown is None:
        sys.exit(code)
    shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # a closed or broken pipe: nothing more can be said on it
            pass
    os._exit(code)


def entry() -> None:
    """The ``kkdeploy`` command (console script and ``python -m kkdeploy``): ``main`` then a quick exit. In-process
    callers (tests, notebooks) call ``main`` and keep their interpreter."""
    exit_without_teardown(main())


if __name__ == "__main__":
    entry()
