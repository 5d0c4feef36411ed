"""Validate candidates against the PyTorch reference, every element of every trial (design.md §4-§5).

The reference and each candidate run as Polygraphy runners (``CallableRunner``), one
``Comparator.run`` per trial and runner, compared by ``Comparator.compare_accuracy`` with our
``StrictCompareFunc``. A candidate that raises is recorded as failed for that mask mode with the
exception text; it never stops the validation of the others.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Mapping, Sequence

import torch

from kkdeploy.artifacts import json_safe, write_json
from kkdeploy.config import TransformerConfig, dtype_name
from kkdeploy.errors import KKError, error_summary
from kkdeploy.inputs import DEFAULT_SEED, DEFAULT_TRIALS
from kkdeploy.status import FAILED, PASSED, PASSED_ALL_VALID_ONLY

from .polygraphy_glue import (
    CallableRunner,
    StrictCompareFunc,
    compare_runs,
    model_input_metadata,
    quiet_polygraphy,
    run_one,
)
from .strict import ComparisonReport, contract as contract_tolerances
from .trials import ALL_VALID, DEFAULT_PADDING_RATIO, MODES, PADDED, check_plan_args, trial_plan

@dataclass
class TrialRecord:
    """One candidate on one trial: the strict report, or the error that stopped it."""

    mode: str
    index: int
    seed: int
    report: ComparisonReport | None = None
    error: str | None = None
    seconds: float | None = None  # the candidate's inference time (Polygraphy's runtime)

    @property
    def passed(self) -> bool:
        return self.error is None and self.report is not None and self.report.passed

    def to_dict(self) -> dict:
        return {
            "mode": self.mode, "index": self.index, "seed": self.seed, "passed": self.passed,
            "error": self.error, "seconds": self.seconds,
            "report": None if self.report is None else self.report.to_dict(),
        }


@dataclass
class CandidateValidation:
    """Every trial of one candidate, and the verdict derived from them."""

    name: str
    trials_per_mode: int
    modes: tuple[str, ...]
    all_valid_only: bool = False
    records: list[TrialRecord] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)  # mode -> why it was not (fully) run

    def mode_records(self, mode: str) -> list[TrialRecord]:
        return [r for r in self.records if r.mode == mode]

    def mode_error(self, mode: str) -> str | None:
        return next((r.error for r in self.mode_records(mode) if r.error), None)

    def failed_elements(self, mode: str) -> int:
        return sum(r.report.failed for r in self.mode_records(mode) if r.report is not None)

    def mode_passed(self, mode: str) -> bool:
        """Every trial of the mode ran, none raised, none had a failed element."""
        records = self.mode_records(mode)
        return len(records) == self.trials_per_mode and all(r.passed for r in records)

    @property
    def max_abs(self) -> float:
        values = [r.report.max_abs for r in self.records if r.report is not None]
        return max(values) if values else float("nan")

    @property
    def max_rel(self) -> float:
        values = [r.report.max_rel for r in self.records if r.report is not None]
        return max(values) if values else float("nan")

    @property
    def status(self) -> str:
        if ALL_VALID not in self.modes or not self.mode_passed(ALL_VALID):
            return FAILED
        if PADDED in self.modes and not self.all_valid_only and self.mode_passed(PADDED):
            return PASSED
        return PASSED_ALL_VALID_ONLY

    def describe_mode(self, mode: str) -> str:
        if mode in self.skipped and not self.mode_records(mode):
            return f"{mode}: not run ({self.skipped[mode]})"
        records = self.mode_records(mode)
        error = self.mode_error(mode)
        if error:
            return f"{mode}: raised {error}"
        failing = [r for r in records if r.report is not None and not r.report.passed]
        if not failing:
            worst = max((r.report.max_abs for r in records if r.report is not None), default=0.0)
            return f"{mode}: {len(records)} trials, 0 failed elements (max abs {worst:.3g})"
        worst_record = max(failing, key=lambda r: (r.report.failed, r.report.max_abs))
        rep = worst_record.report
        stopped = f"; {self.skipped[mode]}" if mode in self.skipped else ""
        return (f"{mode}: {self.failed_elements(mode)} failed elements in {len(failing)}/{len(records)} trials "
                f"(worst: trial {worst_record.index} seed {worst_record.seed}, max abs {rep.max_abs:.3g} at "
                f"{rep.worst_index}, ref {rep.worst_reference:.6g} vs {rep.worst_candidate:.6g}; "
                f"{rep.failing_feature_count} failing features{stopped})")

    @property
    def reason(self) -> str:
        parts = [self.describe_mode(m) for m in self.modes]
        if PADDED not in self.modes:
            parts.append("padded: not requested")
        return f"{self.status}: " + "; ".join(parts)

    def to_dict(self) -> dict:
        return {
            "name": self.name, "status": self.status, "reason": self.reason, "all_valid_only": self.all_valid_only,
            "failed_elements": {m: self.failed_elements(m) for m in self.modes},
            "errors": {m: self.mode_error(m) for m in self.modes if self.mode_error(m)},
            "skipped": dict(self.skipped), "max_abs": self.max_abs, "max_rel": self.max_rel,
            "trials": [r.to_dict() for r in self.records],
        }


@dataclass
class ValidationReport:
    """``validation.json``: the protocol, and every candidate's per-trial strict reports."""

    config: TransformerConfig
    dtype: torch.dtype
    device: torch.device
    contract: str
    atol: float
    rtol: float
    seed: int
    trials: int
    padding_ratio: float
    modes: tuple[str, ...]
    candidates: dict[str, CandidateValidation] = field(default_factory=dict)
    reference_seconds: list[float] = field(default_factory=list)
    seconds: float = 0.0

    summary_columns = ["candidate", "status", "failed elements", "max abs error"]

    def status(self, name: str) -> str:
        return self._candidate(name).status

    def reason(self, name: str) -> str:
        return self._candidate(name).reason

    def passed(self) -> list[str]:
        """Names that may ship (fully, or for all-valid calls only)."""
        return [n for n, c in self.candidates.items() if c.status in (PASSED, PASSED_ALL_VALID_ONLY)]

    def _candidate(self, name: str) -> CandidateValidation:
        try:
            return self.candidates[name]
        except KeyError:
            raise KKError(f"no candidate named {name!r} was validated; have {sorted(self.candidates)}") from None

    def summary_rows(self) -> list[list[str]]:
        """One row per candidate for the build summary table (columns: ``summary_columns``)."""
        rows = []
        for name, cand in self.candidates.items():
            failed = ", ".join(
                f"{m} raised" if cand.mode_error(m)
                else f"{m} {cand.failed_elements(m)}" if cand.mode_records(m) else f"{m} -"
                for m in self.modes
            )
            max_abs = cand.max_abs
            rows.append([name, cand.status, failed, "-" if math.isnan(max_abs) else f"{max_abs:.3g}"])
        return rows

    def to_dict(self) -> dict:
        return json_safe({
            "format": "kkdeploy-validation/1",
            "config": self.config.to_dict(), "dtype": dtype_name(self.dtype), "device": str(self.device),
            "contract": self.contract, "atol": self.atol, "rtol": self.rtol,
            "rule": "finite(ref) and finite(out) and (|out-ref| <= atol or |out-ref| <= rtol*|ref|)",
            "seed": self.seed, "trials": self.trials, "padding_ratio": self.padding_ratio,
            "modes": list(self.modes), "seconds": round(self.seconds, 3),
            "reference_seconds": self.reference_seconds,
            "statuses": {n: c.status for n, c in self.candidates.items()},
            "candidates": {n: c.to_dict() for n, c in self.candidates.items()},
        })

    def write_json(self, path) -> Path:
        return write_json(path, self.to_dict())


def validate_candidates(
    reference: Callable,
    candidates: Mapping[str, Callable],
    config: TransformerConfig,
    dtype: torch.dtype,
    device,
    *,
    seed: int = DEFAULT_SEED,
    trials: int = DEFAULT_TRIALS,
    padding_ratio: float = DEFAULT_PADDING_RATIO,
    contract: str = "strict",
    modes: Sequence[str] = MODES,
    all_valid_only: Iterable[str] = (),
    progress=None,
    stop_after_failure: bool = False,
) -> ValidationReport:
    """Run the reference and every candidate on the trial plan and compare every element.

    ``candidates`` maps a name to ``fn(x, mask) -> y``. Names in ``all_valid_only`` are validated on
    all-valid trials only (they serve all-valid calls; padded calls go to the fallback).
    ``progress`` (optional) gets ``advance()`` after each trial and ``describe(text)`` before it.
    ``stop_after_failure``: a candidate stops at its first failing trial of a mode (after a failing all-valid
    trial, everything), for a build that only has to decide. Its verdict is the same; its count of failed
    elements covers the trials it ran. On shape 6 three candidates that fail every trial took ~1.5 s of eager
    calls (H200) that decided nothing. A benchmark, which reports the failures, runs every trial.
    """
    atol, rtol = contract_tolerances(contract)
    modes = check_plan_args(trials, padding_ratio, modes)
    if ALL_VALID not in modes:
        raise KKError("validation needs the all-valid trials (the organizer's); add 'all-valid' to modes")
    all_valid_only = set(all_valid_only)
    unknown = sorted(all_valid_only - set(candidates))
    if unknown:
        raise KKError(f"all_valid_only names unknown candidates {unknown}; have {sorted(candidates)}")
    if "reference" in candidates:
        raise KKError("'reference' is reserved for the PyTorch reference; rename that candidate")
    device = torch.device(device)
    metadata = model_input_metadata(config, dtype)
    report = ValidationReport(config=config, dtype=dtype, device=device, contract=contract, atol=atol, rtol=rtol,
                              seed=seed, trials=trials, padding_ratio=padding_ratio, modes=modes)
    reference_runner = CallableRunner(reference, "reference", metadata)
    runners = {}
    for name, fn in candidates.items():
        report.candidates[name] = CandidateValidation(name=name, trials_per_mode=trials, modes=modes,
                                                      all_valid_only=name in all_valid_only)
        if name in all_valid_only and PADDED in modes:
            report.candidates[name].skipped[PADDED] = "all-valid-only candidate"
        runners[name] = CallableRunner(fn, name, metadata)

    start = time.perf_counter()
    with quiet_polygraphy(), torch.inference_mode():
        for trial in trial_plan(config, dtype, device, seed=seed, trials=trials, padding_ratio=padding_ratio,
                                modes=modes):
            if progress is not None and hasattr(progress, "describe"):
                progress.describe(f"validate {trial.describe()}")
            feed = trial.feed_dict()
            reference_results = run_one(reference_runner, feed)
            report.reference_seconds.append(reference_results[0][1][0].runtime)
            for name, runner in runners.items():
                cand = report.candidates[name]
                if trial.mode in cand.skipped:
                    continue
                record = TrialRecord(mode=trial.mode, index=trial.index, seed=trial.seed)
                cand.records.append(record)
                try:
                    candidate_results = run_one(runner, feed)
                    record.seconds = candidate_results[0][1][0].runtime
                    _check_output(reference_results, candidate_results)
                    compare = StrictCompareFunc(atol, rtol, reference_side=0)
                    compare_runs(reference_results, candidate_results, compare)
                    record.report = compare.reports[-1]["y"]
                    if stop_after_failure and not record.passed:
                        why = f"stopped after {trial.describe()} failed (the verdict was decided)"
                        stopped = modes[modes.index(trial.mode):] if trial.mode == ALL_VALID else (trial.mode,)
                        for mode in stopped:
                            cand.skipped.setdefault(mode, why)
                except Exception as exc:  # a broken candidate is a failed candidate, never a crash
                    record.error = error_summary(exc)
                    cand.skipped[trial.mode] = f"stopped after {trial.describe()} raised"
                finally:
                    candidate_results = None  # free the output before the next candidate runs
            reference_results = None
            if progress is not None:
                progress.advance()
    report.seconds = time.perf_counter() - start
    return report


def _check_output(reference_results, candidate_results) -> None:
    """The output contract beyond values: same shape, same dtype, same device type."""
    ref = reference_results[0][1][0]["y"]
    out = candidate_results[0][1][0]["y"]
    if tuple(out.shape) != tuple(ref.shape):
        raise ValueError(f"output shape {list(out.shape)} differs from the reference's {list(ref.shape)}")
    if out.dtype != ref.dtype:
        raise TypeError(f"output dtype {dtype_name(out.dtype)} differs from the reference's {dtype_name(ref.dtype)}")
    if out.device.type != ref.device.type:
        raise ValueError(f"output is on {out.device} but the reference's is on {ref.device}")
