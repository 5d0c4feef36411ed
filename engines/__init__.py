"""Candidate builders and runners, one module per backend.

Each backend module registers its ``BackendDescriptor`` (``engines.registry``) when it is imported, and this
package imports every one of them, in the order their ``--backends`` names are listed. Importing a backend
module is cheap: its optional libraries (onnxruntime, tensorrt, triton) are imported only when it builds or
loads something.
"""

from __future__ import annotations

import importlib

from . import registry
from .base import Backend, BuildContext, CandidateResult, Runner
from . import trt, ort, torch_graph, inductor, torch_compile, layer_graph  # noqa: E402,F401  each registers its descriptor


def backend_module(key: str) -> str:
    """The importable spec of a backend key: ``module`` (its ``BACKEND``) or ``module:ATTRIBUTE``."""
    return registry.descriptor(key).module


def import_backend(spec: str) -> Backend:
    module, _, attribute = spec.partition(":")
    return getattr(importlib.import_module(module), attribute or "BACKEND")


def get_backend(key: str) -> Backend:
    return import_backend(backend_module(key))


def __getattr__(name: str):
    if name == "BACKEND_MODULES":  # backend key -> importable spec, derived from the registry when read
        return registry.backend_modules()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["Backend", "BuildContext", "CandidateResult", "Runner", "BACKEND_MODULES", "backend_module", "get_backend",
           "import_backend", "registry"]
