"""Validation: the strict rule, trial plans, the Polygraphy comparator glue and reports.

The names below load on first use (PEP 562): the rule and the trial plans need only torch, and a served artifact
(``kkdeploy.load``, the Triton model) uses them on machines without Polygraphy, which only the build's
validator needs.
"""

from __future__ import annotations

import importlib

_HOMES = {
    "polygraphy_glue": ("CallableRunner", "StrictCompareFunc", "TrialDataLoader", "model_input_metadata"),
    "strict": ("CONTRACTS", "DEFAULT_CONTRACT", "ComparisonReport", "compare_outputs", "contract"),
    "trials": ("ALL_VALID", "DEFAULT_PADDING_RATIO", "MODES", "PADDED", "Trial", "trial_plan"),
    "validator": ("CandidateValidation", "TrialRecord", "ValidationReport", "validate_candidates"),
}
_HOME_OF = {name: module for module, names in _HOMES.items() for name in names}

__all__ = sorted(_HOME_OF)


def __getattr__(name: str):
    module = _HOME_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
