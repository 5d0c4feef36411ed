"""Subcommands: every module here with ``register(subparsers)`` becomes ``kkdeploy <name>``."""

import importlib
import pkgutil

_ORDER = ["shapes", "env", "check", "export", "prove", "build", "run", "inspect", "bench", "triton_repo", "serve", "loadtest"]


def _discover():
    names = [m.name for m in pkgutil.iter_modules(__path__) if m.name != "common"]
    names.sort(key=lambda n: (_ORDER.index(n) if n in _ORDER else len(_ORDER), n))
    modules = [importlib.import_module(f"{__name__}.{n}") for n in names]
    return [m for m in modules if hasattr(m, "register")]


MODULES = _discover()
