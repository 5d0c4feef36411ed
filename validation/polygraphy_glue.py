"""Polygraphy glue: any ``fn(x, mask) -> torch.Tensor`` as a runner, the trial plan as a data loader,
and a compare function that applies the strict rule with the *reference* as the denominator.

Why our own pieces (checked on Polygraphy 0.53.6):
* ``polygraphy.backend.pyt.PytRunner`` returns a tuple from ``infer_impl`` and never sets
  ``inference_time``, so ``Comparator.run`` cannot use it; ``CallableRunner`` returns an OrderedDict.
* ``CompareFunc.simple(check_error_stat="elemwise")`` divides by the *second* runner's output and
  flags an element only when abs > atol AND rel > rtol. That equals design.md §5 only when the
  reference runs second; ``StrictCompareFunc`` takes the reference side explicitly instead.
* Polygraphy passes torch tensors through untouched (``util.array`` handles them natively), and
  ``Comparator.run`` deep-copies outputs only when a run has more than one iteration. The validator
  therefore runs one trial per ``Comparator.run``: memory stays at one input and two outputs, and
  nothing is copied.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Callable, Iterable

import torch
from polygraphy.backend.base import BaseRunner
from polygraphy.common import TensorMetadata
from polygraphy.comparator import Comparator
from polygraphy.logger import G_LOGGER

from kkdeploy.config import TransformerConfig

from .strict import ComparisonReport, compare_outputs
from .trials import Trial

OUTPUT_NAME = "y"


def model_input_metadata(config: TransformerConfig, dtype: torch.dtype) -> TensorMetadata:
    """The model's two inputs as Polygraphy ``TensorMetadata`` (torch dtypes are accepted as is)."""
    b, s, d = config.batch_size, config.seq_len, config.d_model
    return TensorMetadata().add("x", dtype, (b, s, d)).add("valid_token_mask", torch.bool, (b, s))


class CallableRunner(BaseRunner):
    """A Polygraphy runner around ``fn(x, mask) -> torch.Tensor`` (the reference or a candidate).

    ``inference_time`` is wall time of the call, with the device synchronized on CUDA so an
    asynchronous launch is not mistaken for a finished inference.
    """

    def __init__(self, fn: Callable, name: str, input_metadata: TensorMetadata):
        super().__init__(name=name)
        self.fn = fn
        self.input_metadata = input_metadata

    def activate_impl(self):
        pass

    def deactivate_impl(self):
        pass

    def get_input_metadata_impl(self):
        return self.input_metadata

    def infer_impl(self, feed_dict):
        x = feed_dict["x"]
        mask = feed_dict.get("valid_token_mask")
        cuda = isinstance(x, torch.Tensor) and x.is_cuda
        if cuda:
            torch.cuda.synchronize(x.device)
        start = time.perf_counter()
        y = self.fn(x, mask)
        if cuda:
            torch.cuda.synchronize(x.device)
        self.inference_time = time.perf_counter() - start
        if not isinstance(y, torch.Tensor):
            raise TypeError(f"{self.name} returned {type(y).__name__}, expected a torch.Tensor")
        return OrderedDict([(OUTPUT_NAME, y)])


class TrialDataLoader:
    """Polygraphy data loader over a trial plan: yields ``{"x", "valid_token_mask"}`` feed dicts lazily.

    ``trials`` remembers the last yielded ``Trial`` so a caller can label results.
    """

    def __init__(self, plan: Iterable[Trial]):
        self.plan = plan
        self.current: Trial | None = None

    def __iter__(self):
        for trial in self.plan:
            self.current = trial
            yield trial.feed_dict()


# Polygraphy's compare_accuracy computes mean/std/median/quantiles of both outputs for its log after
# every comparison, even when that log is silenced: ~3.5 s for a 4M-element output on our CPU, 6x the
# strict comparison itself. A result whose ``output1_name`` names no output makes it skip them
# (comparator/util.py: log_compared_output_stats); our report already has every number that matters.
NO_STATS_OUTPUT = "<strict report: stats not logged>"


class StrictResult:
    """A compare verdict Polygraphy can use (truthiness) that keeps our full report."""

    def __init__(self, report: ComparisonReport, output1_name: str = OUTPUT_NAME):
        self.report = report
        self.output1_name = output1_name

    def __bool__(self) -> bool:
        return self.report.passed

    def __repr__(self) -> str:
        return f"StrictResult({self.report.summary()})"


class StrictCompareFunc:
    """``compare_func`` for ``Comparator.compare_accuracy``: design.md §5 with the reference's values
    as the denominator, whichever side of the pair the reference runs on.

    ``reference_side`` is 0 when the reference is the first runner of each compared pair (our
    validator's order) and 1 when it is the second. ``reports`` collects every report in call order.
    ``log_stats`` lets Polygraphy compute its (costly) output statistics for its own log.
    """

    def __init__(self, atol: float, rtol: float, reference_side: int = 0, log_stats: bool = False):
        if reference_side not in (0, 1):
            raise ValueError("reference_side must be 0 or 1")
        self.atol, self.rtol, self.reference_side = atol, rtol, reference_side
        self.log_stats = log_stats
        self.reports: list[dict[str, ComparisonReport]] = []

    def __call__(self, iter_result0, iter_result1) -> "OrderedDict[str, StrictResult]":
        ref_result, out_result = (
            (iter_result0, iter_result1) if self.reference_side == 0 else (iter_result1, iter_result0)
        )
        matches: OrderedDict[str, StrictResult] = OrderedDict()
        reports: dict[str, ComparisonReport] = {}
        for name, ref in ref_result.items():
            if name not in out_result:
                raise KeyError(f"output {name!r} is missing from {out_result.runner_name}")
            report = compare_outputs(ref, out_result[name], self.atol, self.rtol)
            reports[name] = report
            matches[name] = StrictResult(report, name if self.log_stats else NO_STATS_OUTPUT)
        self.reports.append(reports)
        return matches


def quiet_polygraphy(severity: str = "CRITICAL"):
    """Polygraphy logs every activation and comparison; our report carries what matters, so keep the CLI quiet."""
    return G_LOGGER.verbosity(getattr(G_LOGGER, severity))


def run_one(runner, feed_dict):
    """One ``Comparator.run`` over one feed dict: a single iteration, so no deep copy of outputs."""
    return Comparator.run([runner], data_loader=[feed_dict])


def compare_runs(reference_results, candidate_results, compare_func: StrictCompareFunc):
    """``Comparator.compare_accuracy`` of (reference, candidate) with our compare func."""
    return Comparator.compare_accuracy([reference_results, candidate_results], comparisons=[(0, 1)],
                                       compare_func=compare_func)
