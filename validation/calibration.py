"""Precision repair: the largest set of float16 blocks that validation accepts for one candidate.

It lives in ``validation`` because it *is* validation, run once per block set: the models define what a
float16 block computes (``kkdeploy.models.mixed``), the search order is ``exporters.precision``'s, and
the verdict for each set is ``validate_candidates``' on the build's own trial plan.
"""

from __future__ import annotations

import torch

from exporters.precision import bisect_fp16_layers

from .validator import validate_candidates


def calibrate_layers(reference, runner_for_layers, *, all_valid_only: bool, contract: str,
                     seed: int, trials: int, padding_ratio: float) -> dict:
    """Largest float16 block set whose runner passes ``contract`` on the trial plan (precision repair).

    ``runner_for_layers(fp16_layers)`` builds the candidate under test for one block set (a captured
    PyTorch model, an ONNX Runtime session of the mixed export, ...), so what is calibrated is what ships;
    the search itself is ``exporters.precision.bisect_fp16_layers``. Returns its record plus, per tried set,
    ``failed_elements`` per mask mode and, for a failing set, the validator's ``reason``.
    """
    failures: dict[tuple[int, ...], dict] = {}

    def passes(layers: tuple[int, ...]) -> bool:
        runner = runner_for_layers(layers)
        report = validate_candidates(reference, {"mixed": runner}, reference.config, torch.float32,
                                     reference.device, seed=seed, trials=trials, padding_ratio=padding_ratio,
                                     contract=contract, all_valid_only={"mixed"} if all_valid_only else ())
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

