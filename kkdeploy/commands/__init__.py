"""Subcommands; each module has ``register(subparsers)`` and sets ``func``."""

from . import check, shapes

MODULES = [shapes, check]
