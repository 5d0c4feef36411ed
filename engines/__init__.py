"""Candidate builders and runners, one module per backend (loaded lazily by name)."""

from __future__ import annotations

import importlib

from .base import Backend, BuildContext, CandidateResult, Runner

# backend key -> module in this package; each module defines BACKEND (a Backend instance)
BACKEND_MODULES = {
    "trt": "engines.trt",
    "ort": "engines.ort",
    "torch_graph": "engines.torch_graph",
    "inductor": "engines.inductor",
    "torch_compile": "engines.torch_compile",
}


def backend_module(key: str) -> str:
    """The importable spec of a backend key: ``module`` (its ``BACKEND``) or ``module:ATTRIBUTE``."""
    return BACKEND_MODULES[key]


def import_backend(spec: str) -> Backend:
    module, _, attribute = spec.partition(":")
    return getattr(importlib.import_module(module), attribute or "BACKEND")


def get_backend(key: str) -> Backend:
    return import_backend(backend_module(key))


__all__ = ["Backend", "BuildContext", "CandidateResult", "Runner", "BACKEND_MODULES", "backend_module", "get_backend",
           "import_backend"]
