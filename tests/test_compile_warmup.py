"""Compiles ahead in child processes (engines.compile_warmup, pipeline.compile_ahead): scheduling, records, the
build's use of them, and a real child whose compile the build then finds in Inductor's cache (CPU)."""

from __future__ import annotations

import json
import time

import pytest
import torch

from engines import compile_warmup
from engines.compile_warmup import CompileWarmup, default_workers
from kkdeploy.cli import main
from tests.test_inductor import CPU, TINY
from tests.test_timing_bench import TINY as TINY_FLAGS

CUDA = torch.device("cuda")


def warmup(tmp_path, workers=1, wait_s=30.0):
    weights = tmp_path / "weights.safetensors"  # the stand-in child logs beside it
    return CompileWarmup(weights, TINY, torch.float32, CPU, workers=workers, wait_s=wait_s,
                         child_module="tests.warmup_child")


def started(tmp_path) -> list[str]:
    log = tmp_path / "started.log"
    return log.read_text().split() if log.is_file() else []


def test_default_workers_one_child_on_a_gpu_machine_with_cores_to_spare(monkeypatch):
    monkeypatch.setattr(compile_warmup.os, "cpu_count", lambda: 16)
    assert default_workers(CPU, 5) == 0  # a CPU compile is the build's whole job there
    assert default_workers(CUDA, 1) == 0  # one compile gains nothing from a child
    assert default_workers(CUDA, 5) == 1 and default_workers(CUDA, 2) == 1
    monkeypatch.setattr(compile_warmup.os, "cpu_count", lambda: 2)
    assert default_workers(CUDA, 5) == 0


def test_children_run_at_most_workers_at_once_and_the_build_waits_for_its_own(tmp_path):
    with warmup(tmp_path, workers=1) as w:
        assert w.start(["sleep-0.2", "sleep-0.1"]) == ["sleep-0.2"]  # one slot; the other is not queued
        assert w.wait("sleep-0.1") is None  # no child compiled it: the build compiles it itself
        record = w.wait("sleep-0.2")
        assert record.status == "ok" and record.compile_seconds == 0.5 and record.waited_seconds > 0
        assert w.start(["sleep-0.2", "sleep-0.1"]) == ["sleep-0.1"]  # the slot is free again; none twice
        assert w.wait("sleep-0.1").status == "ok"
        assert started(tmp_path) == ["sleep-0.2", "sleep-0.1"]
    summary = w.summary()
    assert summary["workers"] == 1 and [c["status"] for c in summary["children"]] == ["ok", "ok"]


def test_a_failed_or_crashed_child_is_recorded_with_its_reason(tmp_path):
    with warmup(tmp_path, workers=2) as w:
        w.start(["fail", "crash"])
        failed, crashed = w.wait("fail"), w.wait("crash")
    assert failed.status == "failed" and failed.reason == "KKError: no graph"
    assert crashed.status == "failed" and crashed.reason.startswith("exit code 3")
    assert "the child fell over" in crashed.reason


def test_a_child_past_the_limit_is_stopped_and_the_build_goes_on(tmp_path):
    with warmup(tmp_path, workers=2, wait_s=0.5) as w:
        w.start(["sleep-30"])
        t = time.perf_counter()
        record = w.wait("sleep-30")
        assert time.perf_counter() - t < 10
    assert record.status == "timed-out" and "compiled here" in record.reason


def test_close_stops_running_children(tmp_path):
    w = warmup(tmp_path, workers=2)
    w.start(["sleep-30", "sleep-31"])
    w.close()
    assert {r.name: r.status for r in w.records.values()} == {"sleep-30": "stopped", "sleep-31": "stopped"}


def test_load_runners_takes_the_built_runner_and_closes_the_failed_ones(tmp_path):
    from engines.base import CandidateResult
    from kkdeploy.pipeline.build import BuildRequest, load_runners
    from kkdeploy.status import BUILD_FAILED, BUILT

    class Held:
        closed = False

        def close(self):
            self.closed = True

    kept, dropped = Held(), Held()
    results = [CandidateResult("a", "no-such-backend", BUILT), CandidateResult("b", "no-such-backend", BUILD_FAILED)]
    built = {"a": kept, "b": dropped}
    runners = load_runners(BuildRequest(TINY, torch.float32, CPU, tmp_path), tmp_path, results, built)
    assert runners == {"a": kept} and not kept.closed and dropped.closed and built == {}


def test_the_build_refuses_negative_compile_workers(capsys):
    assert main(["build", *TINY_FLAGS, "--device", "cpu", "--compile-workers", "-1"]) == 2
    err = capsys.readouterr().err
    assert "--compile-workers" in err and "Traceback" not in err


def test_a_child_compile_fills_the_cache_the_build_then_hits(tmp_path, monkeypatch):
    """The real child: it compiles the faithful graph on the CPU into a fresh Inductor cache; the build's own compile
    of the same candidate is then a cache hit, and the build validates the runner it compiled (no second load)."""
    from torch._dynamo.utils import counters

    from engines import torch_compile
    from kkdeploy.pipeline.build import BuildRequest, run_build

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))

    def no_reload(*args, **kwargs):
        raise AssertionError("the build loaded a candidate it had compiled")

    monkeypatch.setattr(torch_compile.BACKEND, "load", no_reload)
    hits = counters["inductor"]["fxgraph_cache_hit"]
    out = tmp_path / "artifacts"
    manifest = run_build(BuildRequest(TINY, torch.float32, CPU, out, backends=["torch-compile"], trials=2,
                                      warmups=1, repeats=3, rounds=1, compile_workers=1))
    entry = next(c for c in manifest["candidates"] if c["name"] == "torch-compile")
    assert entry["status"] == "passed", entry
    child = entry["options"]["compile_warmup"]
    assert child["status"] == "ok", child
    assert child["compile_seconds"] > 0
    assert manifest["compile_warmup"]["children"] == [child] and manifest["compile_warmup"]["workers"] == 1
    assert counters["inductor"]["fxgraph_cache_hit"] > hits
    assert json.loads((out / "manifest.json").read_text())["compile_warmup"]["workers"] == 1


def test_the_build_proves_kernels_while_the_first_child_compiles_and_starts_the_gemm_graph_after(tmp_path,
                                                                                                 monkeypatch):
    from engines.base import BuildContext
    from kkdeploy.kernels import model_proofs
    from kkdeploy.pipeline import compile_ahead
    from kkdeploy.pipeline.build import BuildRequest
    from kkdeploy.models.weights import build_models

    events = []

    class Recorder:
        def __init__(self, weights, config, dtype, device, *, tf32, workers):
            self.records, self.workers = {}, workers
            events.append(("workers", workers))

        def start(self, names):
            events.append(("start", list(names)))
            self.records.update(dict.fromkeys(names))

        def close(self):
            events.append(("close",))

    def prove(model, config, dtype, device, kinds):
        events.append(("prove", list(kinds)))
        return model_proofs.ModelProofs(seconds=1.5)

    monkeypatch.setattr(compile_warmup, "CompileWarmup", Recorder)
    monkeypatch.setattr(model_proofs, "prove_model_kernels", prove)

    class Bar:
        def describe(self, text):
            events.append(("bar", text))

    reference, _ = build_models(TINY, torch.float32, CPU)
    ctx = BuildContext(TINY, torch.float32, CPU, reference, tmp_path)
    request = BuildRequest(TINY, torch.float32, CPU, tmp_path, compile_workers=2,
                           backends=["torch-compile", "torch-compile-faithful-gemms", "torch-graph"])
    assert compile_ahead.torch_compile_candidates(request, ctx) == ["torch-compile", "torch-compile-faithful-gemms"]
    made = compile_ahead.start_compile_warmup(request, ctx, tmp_path / "w.safetensors", Bar())
    assert made.proof_seconds == 1.5
    assert events == [("workers", 2), ("start", ["torch-compile"]),
                      ("bar", "prove kernels (compiling torch-compile in a child process)"),
                      ("prove", ["attention", "layer_norm", "linear"]), ("start", ["torch-compile-faithful-gemms"])]
    request.compile_workers = None  # the default on the CPU: no child, no early proofs
    assert compile_ahead.start_compile_warmup(request, ctx, tmp_path / "w.safetensors", Bar()) is None
