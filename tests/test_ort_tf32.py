"""Issue 20 Part A: the ORT CUDA EP's TF32 setting follows the build's --tf32 and is recorded in the manifest.

ORT's CUDA EP defaults ``use_tf32`` to on, PyTorch's float32 matmuls to off: left alone, a float32 ORT engine
would round its GEMMs differently from the reference it is validated against whenever --no-tf32 is asked for.
"""

from __future__ import annotations

import torch

from engines import ort as ort_engine
from kkdeploy.config import tf32_mode


def test_providers_carry_use_tf32_only_when_given():
    cuda = torch.device("cuda", 1)
    (name, opts), = ort_engine.providers_for("ort-cuda-graph", cuda, True)
    assert name == "CUDAExecutionProvider" and opts == {"device_id": 1, "enable_cuda_graph": "1", "use_tf32": "1"}
    assert ort_engine.providers_for("ort-cuda", cuda, False)[0][1]["use_tf32"] == "0"
    assert "use_tf32" not in ort_engine.providers_for("ort-cuda", cuda)[0][1]  # an old artifact: ORT's default
    assert ort_engine.providers_for("ort-cpu", torch.device("cpu"), True) == ["CPUExecutionProvider"]


def test_a_cuda_candidate_records_the_builds_tf32_and_a_cpu_one_records_none():
    for enabled in (True, False):
        with tf32_mode(enabled):
            assert ort_engine.tf32_option("ort-cuda") is enabled
            assert ort_engine.tf32_option("ort-cuda-graph") is enabled
            assert ort_engine.tf32_option("ort-cpu") is None
    assert ort_engine.recorded_tf32({"cuda_ep_use_tf32": False}) is False
    assert ort_engine.recorded_tf32({"cuda_ep_use_tf32": True}) is True
    assert ort_engine.recorded_tf32({}) is None


def test_load_opens_the_session_with_the_recorded_setting(monkeypatch, tmp_path):
    seen = {}

    class FakeSession:  # stands in for onnxruntime.InferenceSession: records what load asked for
        def __init__(self, path, sess_options=None, providers=None):
            seen["providers"] = providers

        def get_providers(self):
            return [p[0] if isinstance(p, tuple) else p for p in seen["providers"]]

    class FakeOrt:
        InferenceSession = FakeSession

    monkeypatch.setattr(ort_engine, "import_ort", lambda: FakeOrt)
    monkeypatch.setattr(ort_engine, "session_options", lambda *a, **k: None)
    monkeypatch.setattr(ort_engine, "OrtRunner", lambda session, *a, **k: session)
    entry = {"name": "ort-cuda-graph", "options": {"model": "m.onnx", "cuda_ep_use_tf32": False}}
    ort_engine.BACKEND.load(tmp_path, entry, None, torch.float32, torch.device("cuda", 0))
    assert seen["providers"] == [("CUDAExecutionProvider", {"device_id": 0, "enable_cuda_graph": "1",
                                                            "use_tf32": "0"})]
