"""Runners have a lifecycle: ``close()`` and ``with runner:`` release what they hold, once; a closed runner
refuses calls in one line; the build, the calibration and ``kkdeploy.load`` release what they no longer use."""

from __future__ import annotations

import json

import pytest
import torch

import kkdeploy
from engines import registry
from engines.base import BUILT, AllValidRouter, Backend, CandidateResult, Runner
from kkdeploy import KKError, ReferenceTransformer, TransformerConfig
from kkdeploy.cli import main as cli_main
from kkdeploy.inputs import generate_case
from kkdeploy.pipeline import runtime
from kkdeploy.pipeline.build import BuildRequest, run_build
from kkdeploy.pipeline.runtime import ServedRunner

CONFIG = TransformerConfig(2, 8, 16, 2, 16, 1)
CPU = torch.device("cpu")
RELEASED: list[str] = []  # what every Held runner released, in order


class Held(Runner):
    """Serves the reference and records its release."""

    backend = "held"

    def __init__(self, name: str = "held", model=None):
        super().__init__(CONFIG, torch.float32, CPU)
        self.name, self.model = name, model or ReferenceTransformer(CONFIG).eval()

    def infer(self, x, mask):
        with torch.no_grad():
            return self.model(x, mask)

    def release(self) -> None:
        RELEASED.append(self.name)
        self.model = None


@pytest.fixture(autouse=True)
def clear_released():
    RELEASED.clear()


def test_close_releases_once_and_a_closed_runner_refuses_every_call_in_one_line():
    x, mask = generate_case(CONFIG, CPU, torch.float32, 0)
    with Held() as runner:
        assert runner(x, mask).shape == x.shape and not runner.closed
    assert runner.closed and runner.model is None and RELEASED == ["held"]
    runner.close()
    assert RELEASED == ["held"]  # idempotent
    for call in (lambda: runner(x, mask), lambda: runner(x), lambda: runner.infer(x, mask)):
        with pytest.raises(KKError) as caught:
            call()
        assert "\n" not in str(caught.value) and "closed" in str(caught.value)


def test_a_router_closes_both_routes_and_refuses_through_a_closed_one():
    valid, padded = Held("all-valid"), Held("padded")
    router = AllValidRouter(valid, padded)
    x, mask = generate_case(CONFIG, CPU, torch.float32, 0, padding_ratio=0.5)
    padded.close()
    with pytest.raises(KKError, match="closed"):
        router(x, mask)  # a route closed under the router answers with the same one line
    router.close()
    assert RELEASED == ["padded", "all-valid"] and valid.closed


def test_the_served_runner_is_a_runner_that_closes_its_engines_then_its_fallback():
    fallback = ReferenceTransformer(CONFIG).eval()
    engine, padded = Held("engine"), Held("padded-engine")
    served = ServedRunner(fallback, engine=engine, backend="held", all_valid_only=True, padded_engine=padded)
    assert isinstance(served, Runner)
    x, mask = generate_case(CONFIG, CPU, torch.float32, 0, padding_ratio=0.5)
    with served:
        served(x, mask)
        served(x)
    assert engine.closed and padded.closed and served.fallback is None and served.engine is None
    assert sorted(RELEASED) == ["engine", "padded-engine"]
    with pytest.raises(KKError, match="closed"):
        served(x)


def test_calibration_closes_every_tried_runner():
    from kkdeploy.pipeline.calibration import calibrate_layers

    reference = ReferenceTransformer(CONFIG).eval()
    tried = []

    def runner_for(layers):
        tried.append(Held(f"set {list(layers)}", reference))
        return tried[-1]

    result = calibrate_layers(reference, runner_for, all_valid_only=False, contract="strict", seed=0, trials=1,
                              padding_ratio=0.25)
    assert result["passed"] and tried and all(r.closed for r in tried)


class HeldBackend(Backend):
    """A backend without native code whose runners record their release (registered by ``toy_backend``)."""

    name = "held"

    def build(self, ctx, candidate: str) -> CandidateResult:
        return CandidateResult(candidate, self.name, BUILT)

    def load(self, artifact_dir, entry, config, dtype, device) -> Runner:
        from safetensors.torch import load_file

        model = ReferenceTransformer(config)
        model.load_state_dict(load_file(str(artifact_dir / "weights.safetensors")))
        return Held(entry["name"], model.to(device=device, dtype=dtype).eval())


HELD = HeldBackend()


@pytest.fixture
def toy_backend(monkeypatch):
    monkeypatch.setitem(registry.DESCRIPTORS, "held", registry.BackendDescriptor(
        "held", f"{__name__}:HELD", choices=(registry.BackendChoice("held"),)))


def test_the_build_releases_its_candidates_before_it_writes(toy_backend, tmp_path):
    manifest = run_build(BuildRequest(CONFIG, torch.float32, CPU, tmp_path / "art", backends=["held"], trials=1,
                                      warmups=0, repeats=1, rounds=1))
    assert [c["status"] for c in manifest["candidates"]] == ["passed"]
    assert RELEASED == ["held"]


def test_load_releases_the_buckets_it_loaded_before_a_refusal(monkeypatch, tmp_path):
    loaded = []

    def load_bucket(root, manifest, entry, device=None):
        runner = ServedRunner(ReferenceTransformer(CONFIG).eval(), engine=Held(f"b{entry['batch']}"),
                              manifest={"weights": {"sha256": "ours" if entry["batch"] == 1 else "foreign"}})
        loaded.append(runner)
        return runner

    monkeypatch.setattr(runtime, "load_bucket", load_bucket)
    manifest = {"weights": {"sha256": "ours"}, "batch_buckets": {"buckets": [{"batch": 1, "dir": "buckets/b1"},
                                                                               {"batch": 2, "dir": "."}]}}
    with pytest.raises(KKError, match="weights differ"):
        runtime.load_buckets(tmp_path, manifest)
    assert [r.closed for r in loaded] == [True, True] and RELEASED == ["b1", "b2"]


def test_kkdeploy_load_serves_in_a_with_block_and_releases_the_session(tmp_path):
    out = tmp_path / "art"
    assert cli_main(["build", "--batch-size", "2", "--seq-len", "8", "--d-model", "16", "--heads", "2", "--ffn-dim",
                     "16", "--layers", "1", "--device", "cpu", "--dtype", "float32", "--trials", "1", "--warmups",
                     "0", "--repeats", "1", "--rounds", "1", "--backends", "ort-cpu", "--out", str(out)]) == 0
    manifest = json.loads((out / "manifest.json").read_text())  # ship the engine, whichever timed faster here
    manifest["choice"] = {"candidate": "ort-cpu", "backend": "ort", "all_valid_only": False, "reason": "test"}
    (out / "manifest.json").write_text(json.dumps(manifest))
    x, mask = generate_case(CONFIG, CPU, torch.float32, 0)
    with kkdeploy.load(out) as runner:
        assert runner.backend == "ort-cpu" and runner(x, mask).shape == x.shape
        engine = runner.engine
    assert runner.closed and runner.engine is None
    assert engine.closed and engine.session is None
    with pytest.raises(KKError, match="closed"):
        runner(x, mask)


def test_the_served_runner_hands_out_its_engine_s_static_call_only_where_the_engine_serves_every_call():
    """A server writes straight into a captured graph's buffers (``StaticCall``) only when that graph answers every
    call: not behind an all-valid router, not from the fallback, not once closed."""
    sentinel = object()

    class Captured(Held):
        def static_call(self):
            return sentinel

    fallback = ReferenceTransformer(CONFIG).eval()
    assert ServedRunner(fallback, engine=Captured("c")).static_call() is sentinel
    assert ServedRunner(fallback, engine=Captured("c"), all_valid_only=True).static_call() is None
    assert ServedRunner(fallback).static_call() is None  # the fallback serves
    assert ServedRunner(fallback, engine=Held("plain")).static_call() is None  # a runner without a capture
    served = ServedRunner(fallback, engine=Captured("c"))
    served.close()
    assert served.static_call() is None
