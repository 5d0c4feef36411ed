"""Validation: the strict rule, trial plans, the Polygraphy comparator glue and reports."""

from .strict import CONTRACTS, ComparisonReport, compare_outputs, contract

__all__ = ["CONTRACTS", "ComparisonReport", "compare_outputs", "contract"]
