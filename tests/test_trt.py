"""TensorRT through Polygraphy: written against the real API, run only where TensorRT and a GPU exist.

TensorRT's builder cannot be installed on this project's machines (PyPI ships stubs that fetch from
NVIDIA's index), so the engine tests skip with that exact reason; nothing here mocks TensorRT.
"""

from __future__ import annotations

import json

import pytest
import torch

from engines import BuildContext, get_backend
from engines.trt import AUTOCAST, MIXED
from kkdeploy.pipeline.build import BuildRequest, run_build
from tests.conftest import SMALL

TRT = get_backend("trt")
CUDA = torch.device("cuda")
TRT_MISSING = TRT.unavailable_reason(CUDA, torch.float32) or (
    None if torch.cuda.is_available() else "unavailable: TensorRT engines need a CUDA GPU (none here)")


def context(options: dict) -> BuildContext:
    return BuildContext(SMALL, torch.float32, torch.device("cpu"), torch.nn.Linear(1, 1), out_dir=None,
                        options=options)


def test_judge_builds_add_the_mixed_and_autocast_engines():
    """Strongly typed networks take their precision from the graph, so float16 comes as graph variants."""
    assert TRT.candidates(context({})) == ["trt"]
    assert TRT.candidates(context({"mixed_precision": False})) == ["trt"]
    assert TRT.candidates(context({"mixed_precision": True})) == ["trt", MIXED, AUTOCAST]


def test_unavailable_trt_is_one_recorded_row_not_a_crash(tmp_path):
    manifest = run_build(BuildRequest(SMALL, torch.float32, torch.device("cpu"), tmp_path / "a", backends=["trt"],
                                      contract="judge", trials=1, warmups=1, repeats=2, rounds=1))
    rows = [c for c in manifest["candidates"] if c["backend"] == "trt"]
    assert [(r["name"], r["status"]) for r in rows] == [("trt", "unavailable")]
    assert rows[0]["reason"].startswith("unavailable: ")


@pytest.mark.skipif(TRT_MISSING is not None, reason=str(TRT_MISSING))
@pytest.mark.parametrize("dtype,contract", [(torch.float16, "strict"), (torch.float32, "judge")])
def test_engines_build_validate_and_serve(tmp_path, dtype, contract):
    import kkdeploy

    out = tmp_path / "artifacts"
    manifest = run_build(BuildRequest(SMALL, dtype, CUDA, out, backends=["trt"], contract=contract, trials=2,
                                      warmups=1, repeats=3, rounds=1))
    entries = {c["name"]: c for c in manifest["candidates"]}
    expected = {"trt"} | ({MIXED, AUTOCAST} if contract == "judge" else set())
    assert expected <= set(entries)
    assert entries["trt"]["status"] in ("passed", "failed") and entries["trt"]["options"]["strongly_typed"]
    if contract == "judge":
        assert entries[MIXED]["options"]["fp16_layers"] == entries[MIXED]["options"]["calibration"]["fp16_layers"]
        assert not list(out.glob(".calibrate-*"))
    for name, entry in entries.items():
        if entry["status"] != "passed":
            continue
        pinned = json.loads(json.dumps(manifest))
        pinned["choice"] = {**pinned["choice"], "candidate": name, "backend": "trt", "all_valid_only": False}
        (out / "manifest.json").write_text(json.dumps(pinned))
        runner = kkdeploy.load(out, device="cuda")
        assert runner.backend == name, runner.reason
