"""The ``kkdeploy`` command line: one subcommand per module in ``kkdeploy.commands``."""

from __future__ import annotations

import argparse
import sys

from .errors import KKError


def build_parser() -> argparse.ArgumentParser:
    from . import commands

    parser = argparse.ArgumentParser(
        prog="kkdeploy", description="Export, build, validate and ship verified KernelKraft engines."
    )
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


if __name__ == "__main__":
    sys.exit(main())
