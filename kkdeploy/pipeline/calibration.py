"""Precision repair: the largest set of float16 blocks that validation accepts for one candidate.

Calibration is a pipeline step: it validates block subsets, then the engine builds the chosen one. So it lives
here, above both floors it joins: the models define what a float16 block computes (``kkdeploy.models.mixed``,
``kkdeploy.models.fused``), an engine says how to build the runner for one block set, the search order is
``exporters.precision``'s, and the verdict for each set is ``validate_candidates``' on the build's own trial
plan. A build hands ``layer_calibrator`` to its engines as ``BuildContext.calibrate``; the engines never import
validation.
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from engines.base import close_all
from exporters.precision import bisect_fp16_layers

from ..inputs import DEFAULT_SEED, DEFAULT_TRIALS


def calibrate_layers(reference, runner_for_layers, *, all_valid_only: bool, contract: str,
                     seed: int, trials: int, padding_ratio: float) -> dict:
    """Largest float16 block set whose runner passes ``contract`` on the trial plan (precision repair).

    ``runner_for_layers(fp16_layers)`` builds the candidate under test for one block set (a captured
    PyTorch model, an ONNX Runtime session of the mixed export, ...), so what is calibrated is what ships;
    the search itself is ``exporters.precision.bisect_fp16_layers``. Returns its record plus, per tried set,
    ``failed_elements`` per mask mode and, for a failing set, the validator's ``reason``.
    """
    from validation.validator import validate_candidates  # Polygraphy's glue: loaded by a build, not by every command

    failures: dict[tuple[int, ...], dict] = {}

    def passes(layers: tuple[int, ...]) -> bool:
        runner = runner_for_layers(layers)
        report = validate_candidates(reference, {"mixed": runner}, reference.config, torch.float32,
                                     reference.device, seed=seed, trials=trials, padding_ratio=padding_ratio,
                                     contract=contract, all_valid_only={"mixed"} if all_valid_only else ())
        close_all([runner])  # the next set is built anew; this one's session, engine or capture goes now
        cand = report.candidates["mixed"]
        failures[layers] = {"failed_elements": {m: cand.failed_elements(m) for m in cand.modes if cand.mode_records(m)}}
        passed = "mixed" in report.passed()
        if not passed:
            failures[layers]["reason"] = report.reason("mixed")
        return passed

    result = bisect_fp16_layers(reference.config.num_layers, passes)
    for entry in result["tried"]:
        entry.update(failures[tuple(entry["fp16_layers"])])
    result["fp16_layers"] = list(result["fp16_layers"])
    return result


def layer_calibrator(reference, plan: dict) -> Callable[[Callable], dict]:
    """``BuildContext.calibrate`` for one build: ``calibrate(runner_for_layers)`` searches the float16 blocks of
    one candidate against ``reference`` on the build's trial plan (``plan``: contract, seed, trials,
    padding_ratio) and returns the record, with the seconds it took."""
    def calibrate(runner_for_layers) -> dict:
        start = time.perf_counter()
        record = calibrate_layers(reference, runner_for_layers, all_valid_only=False, **plan)
        record["seconds"] = round(time.perf_counter() - start, 3)
        return record

    return calibrate


def calibrate_fused_layers(reference: torch.nn.Module, device: torch.device, plan: dict,
                           half_gemm: bool = False) -> dict:
    """The float16 blocks of ``torch-compile-fused[-half-gemm]-mixed``, searched on a trial plan: the search
    ``kkdeploy build`` runs for those candidates, for the bench. Each tried set runs on its eager twin
    (``engines.torch_compile.fused_eager_twin``): a compile per tried set would cost minutes."""
    from engines.torch_compile import CALIBRATED_ON_EAGER_TWIN, fused_eager_twin

    plan = {"contract": plan.get("contract", "judge"), "seed": plan.get("seed", DEFAULT_SEED),
            "trials": plan.get("trials", DEFAULT_TRIALS), "padding_ratio": plan.get("padding_ratio", 0.25)}
    record = layer_calibrator(reference, plan)(fused_eager_twin(reference, device, half_gemm))
    record["calibrated_on"] = CALIBRATED_ON_EAGER_TWIN
    return record
