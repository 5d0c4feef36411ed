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


def get_backend(key: str) -> Backend:
    return importlib.import_module(BACKEND_MODULES[key]).BACKEND


__all__ = ["Backend", "BuildContext", "CandidateResult", "Runner", "BACKEND_MODULES", "get_backend"]
