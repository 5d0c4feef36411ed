"""Validation: the strict rule, trial plans, the Polygraphy comparator glue and reports."""

from .polygraphy_glue import CallableRunner, StrictCompareFunc, TrialDataLoader, model_input_metadata
from .strict import CONTRACTS, DEFAULT_CONTRACT, ComparisonReport, compare_outputs, contract
from .trials import ALL_VALID, DEFAULT_PADDING_RATIO, MODES, PADDED, Trial, trial_plan
from .validator import CandidateValidation, TrialRecord, ValidationReport, validate_candidates

__all__ = [
    "ALL_VALID", "CONTRACTS", "DEFAULT_CONTRACT", "DEFAULT_PADDING_RATIO", "CallableRunner", "CandidateValidation", "ComparisonReport", "MODES", "PADDED",
    "StrictCompareFunc", "Trial", "TrialDataLoader", "TrialRecord", "ValidationReport", "compare_outputs",
    "contract", "model_input_metadata", "trial_plan", "validate_candidates",
]
