"""Serving on Triton Inference Server (issue 21), end to end on the CPU: a real ``tritonserver``, real HTTP and gRPC
clients, every response compared element by element with the reference under the strict rule.

The server is the one bundled in nvidia-pytriton, installed by ``kkdeploy serve --install-server``'s code path
(pip --no-deps into kkdeploy's cache) the first time; nothing here is skipped or mocked. All traffic is loopback.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch

import kkdeploy
from kkdeploy import artifacts
from kkdeploy.cli import main as cli
from kkdeploy.config import TransformerConfig
from kkdeploy.errors import KKError
from kkdeploy.serving import triton_model, triton_repo, triton_server
from validation import CONTRACTS, compare_outputs

pytestmark = pytest.mark.slow

# Narrow and deep enough that ONNX Runtime beats the eager fallback by ~2.5x on the CPU (0.21 against 0.54 ms
# here), so the chooser ships ort-cpu on every run and the native onnxruntime repository is always exercised.
B, S, D = 4, 16, 16
SHAPE_ARGS = ["--batch-size", str(B), "--seq-len", str(S), "--d-model", str(D), "--heads", "2", "--ffn-dim", "16",
              "--layers", "4", "--device", "cpu"]
QUICK = ["--trials", "2", "--warmups", "2", "--repeats", "10", "--rounds", "1"]
ROOT = Path(__file__).resolve().parents[1]


# -- fixtures -------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    """Artifacts of a small custom shape with batch buckets 1, 2 and 4, built through the CLI; the CPU build ships
    ort-cpu at the artifact's batch."""
    out = tmp_path_factory.mktemp("serving") / "artifacts"
    assert cli(["build", *SHAPE_ARGS, *QUICK, "--batch-buckets", "1,2", "--out", str(out)]) == 0
    assert artifacts.read_json(out / artifacts.MANIFEST)["choice"]["candidate"] == "ort-cpu"
    return out


@pytest.fixture(scope="module")
def fallback_built(tmp_path_factory) -> Path:
    """Artifacts whose only candidate is unavailable on the CPU: the PyTorch fallback ships."""
    out = tmp_path_factory.mktemp("serving-fallback") / "artifacts"
    assert cli(["build", "--batch-size", "2", "--seq-len", "8", "--d-model", "16", "--heads", "2", "--ffn-dim", "16",
                "--layers", "1", "--device", "cpu", "--backends", "torch-graph", *QUICK, "--out", str(out)]) == 0
    assert artifacts.read_json(out / artifacts.MANIFEST)["choice"]["candidate"] == "pytorch-fallback"
    return out


@pytest.fixture(scope="module")
def install() -> triton_server.ServerInstall:
    return triton_server.find_server() or triton_server.install_server()


class Reference:
    """The reference model on the artifact's own weights; ``expect(x, mask)`` for any number of sequences."""

    def __init__(self, root: Path):
        from safetensors.torch import load_file

        manifest = artifacts.read_json(root / artifacts.MANIFEST)
        self.config = TransformerConfig.from_dict(manifest["config"])
        self.model = kkdeploy.ReferenceTransformer(self.config)
        self.model.load_state_dict(load_file(str(root / manifest["weights"]["file"])), strict=True)
        self.model.eval()

    def expect(self, x: np.ndarray, mask: np.ndarray | None) -> torch.Tensor:
        with torch.inference_mode():
            return self.model(torch.from_numpy(x), None if mask is None else torch.from_numpy(mask))


def assert_strict(reference: torch.Tensor, served: np.ndarray, what: str = ""):
    report = compare_outputs(reference, torch.from_numpy(np.array(served)), *CONTRACTS["strict"])
    assert report.passed, f"{what}: {report.summary()}"


def make_case(rng: np.random.Generator, n: int, padded: bool, seq: int = S, width: int = D):
    x = rng.standard_normal((n, seq, width), dtype=np.float32)
    mask = np.ones((n, seq), dtype=bool)
    if padded:
        lengths = rng.integers(1, seq + 1, size=n)
        mask = np.arange(seq)[None, :] < lengths[:, None]
        x[~mask] = 0.0
    return x, mask


def infer(protocol: str, client, model: str, x: np.ndarray, mask: np.ndarray | None,
          x_type: str = "FP32") -> np.ndarray:
    lib = importlib.import_module(f"tritonclient.{protocol}")
    inputs = [lib.InferInput("x", list(x.shape), x_type)]
    inputs[0].set_data_from_numpy(x)
    if mask is not None:
        inputs.append(lib.InferInput("valid_token_mask", list(mask.shape), "BOOL"))
        inputs[1].set_data_from_numpy(mask)
    return client.infer(model, inputs).as_numpy("y")


@contextlib.contextmanager
def client_for(protocol: str, server: triton_server.TritonServer):
    """A client, closed afterwards: an open keep-alive connection holds a stopping server for its exit timeout."""
    lib = importlib.import_module(f"tritonclient.{protocol}")
    if protocol == "http":
        client = lib.InferenceServerClient(server.http_url, network_timeout=60.0, connection_timeout=10.0)
    else:
        client = lib.InferenceServerClient(server.grpc_url)
    try:
        yield client
    finally:
        client.close()


def metrics(server: triton_server.TritonServer) -> dict[tuple[str, str], float]:
    """``{(metric, model): value}`` of the nv_inference_* counters."""
    with urllib.request.urlopen(server.metrics_url, timeout=10) as reply:
        text = reply.read().decode()
    found = {}
    for name, model, value in re.findall(r'^(nv_inference_\w+)\{model="([^"]+)",version="1"\} (\S+)$', text, re.M):
        found[(name, model)] = float(value)
    return found


def wait_for_count(server, key, target: float, timeout_s: float = 10.0) -> dict:
    """The metrics once ``key`` reached ``target`` (counters are updated as responses complete), or at timeout."""
    deadline = time.monotonic() + timeout_s
    found = metrics(server)
    while found.get(key, 0) < target and time.monotonic() < deadline:
        time.sleep(0.2)
        found = metrics(server)
    return found


def settled_metrics(server, quiet_s: float = 1.0, timeout_s: float = 10.0) -> dict:
    """The metrics once they stopped moving for ``quiet_s``: a request an earlier test got its answer to may not be
    counted yet (Triton updates the counters after the response is on its way), and a snapshot taken then counts it
    on the wrong side (seen once in CI: 6 requests where 5 were sent)."""
    deadline = time.monotonic() + timeout_s
    found = metrics(server)
    while time.monotonic() < deadline:
        time.sleep(quiet_s)
        again = metrics(server)
        if again == found:
            break
        found = again
    return found


@pytest.fixture(scope="module")
def served(built, install, tmp_path_factory):
    """The bucketed ORT artifact behind the bundled server, one hop (one Python model runs the shipped ort-cpu
    engines through kkdeploy.load), on free loopback ports."""
    work = tmp_path_factory.mktemp("served")
    info = triton_repo.write_repository(built, work / "repository", available_backends=install.backends())
    assert info.engine_backend == "python" and info.candidate == "ort-cpu"
    assert (info.topology, info.buckets) == ("one-hop", [1, 2, 4])
    http, grpc, metrics_port = triton_server.free_ports().values()
    server = triton_server.TritonServer(install, Path(info.path), work, http_port=http, grpc_port=grpc,
                                        metrics_port=metrics_port)
    server.start()
    try:
        server.wait_ready(240)
        yield server, info
    finally:
        server.stop()


@pytest.fixture(scope="module")
def reference(built) -> Reference:
    return Reference(built)


# -- the repository, without a server -------------------------------------------------------------------------------
def test_io_names_match_the_exported_graph():
    from exporters import INPUT_NAMES, OUTPUT_NAMES

    assert (triton_repo.INPUT_X, triton_repo.INPUT_MASK) == tuple(INPUT_NAMES)
    assert (triton_repo.OUTPUT_Y,) == tuple(OUTPUT_NAMES)
    assert (triton_model.INPUT_X, triton_model.INPUT_MASK, triton_model.OUTPUT_Y) == (*INPUT_NAMES, *OUTPUT_NAMES)


def test_front_groups_and_pads_without_splitting_a_request():
    assert triton_model.chunks([1, 3, 2, 4, 1], 4) == [[0, 1], [2], [3], [4]]
    assert triton_model.chunks([2, 2, 2], 4) == [[0, 1], [2]]
    xs = [torch.ones(1, 3, 2), 2 * torch.ones(2, 3, 2)]
    masks = [None, torch.tensor([[True, False, False], [True, True, False]])]
    x, mask, bounds = triton_model.pad_batch(xs, masks, 4)
    assert bounds == [(0, 1), (1, 3)]
    assert x.shape == (4, 3, 2) and torch.equal(x[3], torch.zeros(3, 2)) and torch.equal(x[1:3], xs[1])
    assert mask[0].all() and torch.equal(mask[1:3], masks[1]) and not mask[3].any()
    with pytest.raises(ValueError, match="do not fit"):
        triton_model.pad_batch([torch.ones(5, 3, 2)], [None], 4)


def test_one_hop_gather_reuses_its_buffers_and_rewrites_every_row():
    """``BucketEngine.run`` without a server: a recording runner sees what the engine would get. Buffers are reused,
    so every run must rewrite every row: padding rows zero and masked after a full run left data in them; a full
    bucket of mask-less requests gets the bucket's all-True mask, the same tensor each time and never written."""
    from kkdeploy.pipeline.runtime import BucketedRunner

    seen = []

    class Engine:
        backend, reason = "recording", ""

        def __call__(self, x, mask):
            seen.append((x.clone(), mask.clone(), mask))
            return x * 2

    model = triton_model.BucketEngine.__new__(triton_model.BucketEngine)
    model.runner = BucketedRunner({1: Engine(), 2: Engine(), 4: Engine()})
    model.row_shape, model.dtype, model.device, model.cuda = [3, 2], torch.float32, torch.device("cpu"), False
    model.inference_mode, model.buffers, model.static, model.static_all_true = torch.inference_mode, {}, {}, {}
    model.static_mask_shared = False
    model.gpu_outputs = False
    model.all_valid = {b: torch.ones([b, 3], dtype=torch.bool) for b in (1, 2, 4)}
    full = [torch.full((2, 3, 2), 5.0), torch.full((2, 3, 2), 7.0)]
    ys, size, n, _, _ = model.run(full, [None, None])
    assert (size, n) == (4, 4) and torch.equal(torch.cat(ys), 2 * torch.cat(full))
    assert seen[-1][2] is model.all_valid[4]
    version = model.all_valid[4]._version
    masked = torch.tensor([[True, True, False]])
    ys, size, n, _, _ = model.run([torch.ones(1, 3, 2), 3 * torch.ones(2, 3, 2)], [masked, None])
    x, mask, _ = seen[-1]
    assert (size, n) == (4, 3) and [tuple(y.shape) for y in ys] == [(1, 3, 2), (2, 3, 2)]
    assert torch.equal(x[:3], torch.cat([torch.ones(1, 3, 2), 3 * torch.ones(2, 3, 2)])) and not x[3].any()
    assert torch.equal(mask, torch.tensor([[True, True, False], [True] * 3, [True] * 3, [False] * 3]))
    assert torch.equal(ys[1], 6 * torch.ones(2, 3, 2))
    ys, size, n, _, _ = model.run(full, [None, None])  # back to all valid: the cached mask, untouched
    assert seen[-1][2] is model.all_valid[4] and model.all_valid[4]._version == version
    assert model.all_valid[4].all() and len(model.buffers) == 1  # one bucket ran: one set of buffers
    ys, size, n, _, _ = model.run([torch.ones(1, 3, 2)], [None])  # one sequence: bucket 1, its own buffers
    assert (size, n) == (1, 1) and len(model.buffers) == 2 and ys[0].shape == (1, 3, 2)
    # Bound for a GPU, several requests' host rows are gathered on the host and cross in one copy each
    # (into the bucket's reused buffers: here plain ones, pinned on a GPU; stale contents are overwritten)
    x_out, mask_out = torch.full((4, 3, 2), 7.0), torch.zeros(4, 3, dtype=torch.bool)
    x, mask = triton_model.gather_host([torch.ones(1, 3, 2), 3 * torch.ones(2, 3, 2)], [masked, None], x_out, mask_out)
    assert torch.equal(x, torch.cat([torch.ones(1, 3, 2), 3 * torch.ones(2, 3, 2)]))
    assert torch.equal(mask, torch.tensor([[True, True, False], [True] * 3, [True] * 3]))
    assert x.data_ptr() == x_out.data_ptr() and mask.data_ptr() == mask_out.data_ptr()  # written in place
    x, mask = triton_model.gather_host([2 * torch.ones(1, 3, 2)], [None], x_out, mask_out)  # stale rows rewritten
    assert torch.equal(x, 2 * torch.ones(1, 3, 2)) and mask.all()


def test_one_hop_writes_straight_into_a_captured_graph_s_buffers(monkeypatch):
    """A bucket whose engine has a ``StaticCall`` (a CUDA graph serving every mask): the gather writes into the
    graph's own input buffers and the run is its replay, with no copy in and no clone out. Every row is rewritten
    each run; the mask buffer is filled all True only when the last run left something else in it; the answers
    are the engine's, as through its ordinary call."""
    from tests.conftest import captured_bucket_engine

    model, engines = captured_bucket_engine((1, 4))
    full = [torch.full((2, 3, 2), 5.0), torch.full((2, 3, 2), 7.0)]
    ys, size, n, _, _ = model.run(full, [None, None])
    four = engines[4]
    assert (size, n) == (4, 4) and torch.equal(torch.cat(ys), 2 * torch.cat(full))
    assert model.buffers[4][0] is four.x and model.buffers[4][1] is four.mask and ys[0].data_ptr() == four.y.data_ptr()
    assert four.replays[-1][1].all() and model.static_all_true[4]
    version = four.mask._version
    model.run(full, [None, None])  # all valid again: the mask already holds all True, not written
    assert four.mask._version == version and len(four.replays) == 2
    masked = torch.tensor([[True, True, False]])
    ys, size, n, _, _ = model.run([torch.ones(1, 3, 2), 3 * torch.ones(2, 3, 2)], [masked, None])
    x, mask = four.replays[-1]
    assert (size, n) == (4, 3) and not x[3].any() and not model.static_all_true[4]
    assert torch.equal(mask, torch.tensor([[True, True, False], [True] * 3, [True] * 3, [False] * 3]))
    assert torch.equal(ys[0], torch.tensor([[[2.0, 2.0]] * 2 + [[0.0, 0.0]]]))
    assert torch.equal(ys[1], 6 * torch.ones(2, 3, 2))
    model.run(full, [None, None])  # all valid after a padded run: the mask is written all True once more
    assert four.replays[-1][1].all() and model.static_all_true[4]
    ys, size, n, _, _ = model.run([torch.ones(1, 3, 2)], [None])  # bucket 1: its own graph's buffers
    assert (size, n) == (1, 1) and len(engines[1].replays) == 1 and torch.equal(ys[0], 2 * torch.ones(1, 3, 2))
    # on by default where the GPU serves (checked bitwise and faster on a GPU); "0" turns it off
    monkeypatch.delenv(triton_model.STATIC_INPUTS_ENV, raising=False)  # on by default
    assert set(triton_model.static_calls(engines, cuda=True)) == {1, 4}
    monkeypatch.setenv(triton_model.STATIC_INPUTS_ENV, "0")
    assert triton_model.static_calls(engines, cuda=True) == {}
    monkeypatch.setenv(triton_model.STATIC_INPUTS_ENV, "1")
    assert set(triton_model.static_calls(engines, cuda=True)) == {1, 4}
    assert triton_model.static_calls(engines, cuda=False) == {}
    model.gpu_outputs = True  # answers left on the GPU are read after the run: a copy, not the graph's buffer
    ys, _, _, _, _ = model.run(full, [None, None])
    assert ys[0].data_ptr() != four.y.data_ptr() and torch.equal(torch.cat(ys), 2 * torch.cat(full))
    from engines.base import Runner

    plain = Runner.__new__(Runner)  # a bucket runner without a capture: the base class's static_call, None
    assert set(triton_model.static_calls({1: plain, 4: engines[4]}, cuda=True)) == {4}


def _parse_text(text: str):
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    return text_format.Parse(text, model_config_pb2.ModelConfig())


def _parse_config(path: Path):
    """config.pbtxt parsed by Triton's own schema (model_config.proto): a wrong field name does not parse."""
    return _parse_text(path.read_text())


def test_ort_artifacts_get_a_native_onnxruntime_engine_model(built, tmp_path):
    repo = tmp_path / "repo"
    assert cli(["triton-repo", "--artifacts", str(built), "--out", str(repo), "--model-name", "kk",
                "--engine", "native"]) == 0  # a native engine model: the two-hop layout
    manifest = artifacts.read_json(built / artifacts.MANIFEST)
    entry = next(c for c in manifest["candidates"] if c["name"] == manifest["choice"]["candidate"])
    front = _parse_config(repo / "kk" / "config.pbtxt")  # Triton's own schema: a typo would not parse
    engine = _parse_config(repo / "kk_engine" / "config.pbtxt")
    assert (front.backend, front.max_batch_size) == ("python", B)
    assert front.HasField("dynamic_batching")
    assert [(i.name, list(i.dims), i.optional) for i in front.input] == [("x", [S, D], False),
                                                                          ("valid_token_mask", [S], True)]
    assert [(o.name, list(o.dims)) for o in front.output] == [("y", [S, D])]
    assert front.parameters["kkdeploy_engine_model"].string_value == "kk_engine"
    assert (engine.backend, engine.max_batch_size) == ("onnxruntime", 0)
    assert [list(i.dims) for i in engine.input] == [[B, S, D], [B, S]] and list(engine.output[0].dims) == [B, S, D]
    assert engine.optimization.graph.level == triton_repo.ORT_DISABLE_ALL  # the build saved the optimized graph
    model = repo / "kk_engine" / "1" / engine.default_model_filename
    assert engine.default_model_filename == entry["options"]["model"]
    assert artifacts.file_sha256(model) == manifest["files"][entry["options"]["model"]]
    assert (repo / "kk" / "1" / "model.py").read_text() == Path(triton_model.__file__).read_text()
    for name in ("README.md", "manifest.json", "validation.json", "serving.json"):
        assert (repo / name).is_file(), name
    assert triton_repo.load_info(repo)["engine_backend"] == "onnxruntime"
    assert "onnxruntime" in (repo / "README.md").read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["repo"]  # no staging directory left


def test_an_ort_engine_with_custom_ops_registers_its_library_in_the_native_config(tmp_path):
    out = tmp_path / "artifacts"
    assert cli(["build", *SHAPE_ARGS, *QUICK, "--linear", "custom", "--out", str(out)]) == 0
    manifest = artifacts.read_json(out / artifacts.MANIFEST)
    # Ship the custom-op engine whatever the CPU timing said (its plain-loop kernels may lose to the fallback).
    manifest["choice"] = {**manifest["choice"], "candidate": "ort-cpu", "backend": "ort", "all_valid_only": False}
    artifacts.write_json(out / artifacts.MANIFEST, manifest)
    repo = tmp_path / "repo"
    info = triton_repo.write_repository(out, repo, engine="native")
    assert info.engine_backend == "onnxruntime"
    engine = _parse_config(repo / "kkdeploy_engine" / "config.pbtxt")  # Triton's schema: the field must exist
    (operation,) = engine.model_operations.op_library_filename
    library = repo / "kkdeploy_engine" / "1" / "libkkdeploy_ops.so"
    assert operation == str(library.resolve()) and library.is_file()
    assert artifacts.file_sha256(library) == manifest["files"]["libkkdeploy_ops.so"]
    # A stock graph's config names no library.
    plain = _parse_text(triton_repo.engine_config("e", "onnxruntime", TransformerConfig(B, S, D, 2, 16, 4),
                                                  "float32", "cpu", {"name": "ort-cpu", "options": {"model": "m.onnx"}}))
    assert not plain.HasField("model_operations")


def test_one_hop_repository_is_one_model_on_the_buckets(built, tmp_path):
    info = triton_repo.write_repository(built, tmp_path / "one", max_queue_delay_us=50, instances=2)
    assert (info.topology, info.engine_backend, info.buckets, info.engine_model) == ("one-hop", "python", [1, 2, 4],
                                                                                     "kkdeploy")
    assert sorted(p.name for p in (tmp_path / "one").iterdir() if p.is_dir()) == ["kkdeploy"]  # no second model
    config = _parse_config(tmp_path / "one" / "kkdeploy" / "config.pbtxt")  # Triton's own schema
    assert (config.backend, config.max_batch_size) == ("python", 4)
    assert list(config.dynamic_batching.preferred_batch_size) == [1, 2, 4]
    assert config.dynamic_batching.max_queue_delay_microseconds == 50
    assert config.instance_group[0].count == 2
    assert config.parameters["kkdeploy_role"].string_value == "batched"
    assert [(i.name, list(i.dims), i.optional) for i in config.input] == [("x", [S, D], False),
                                                                           ("valid_token_mask", [S], True)]
    copied = kkdeploy.load(tmp_path / "one" / "kkdeploy" / "1" / "artifacts")  # every check kkdeploy.load makes
    assert copied.sizes == [1, 2, 4] and copied.buckets[4].backend == "ort-cpu"
    assert triton_repo.load_info(tmp_path / "one")["topology"] == "one-hop"
    assert "one hop" in (tmp_path / "one" / "README.md").read_text()
    with pytest.raises(KKError, match="needs the two-hop layout"):
        triton_repo.write_repository(built, tmp_path / "x", engine="native", topology="one-hop")
    with pytest.raises(KKError, match="--instances"):
        triton_repo.write_repository(built, tmp_path / "x", instances=0)


def test_a_cuda_one_hop_model_answers_from_host_memory_unless_asked(built, tmp_path):
    # A GPU output costs Triton's Python backend a second round trip to the stub, and a stub killed during it sends
    # the unfilled buffers as answers: host outputs are the default, GPU outputs only on request.
    from kkdeploy.serving.triton_model import gpu_outputs_wanted

    cuda = tmp_path / "cuda"
    shutil.copytree(built, cuda)
    manifest = artifacts.read_json(cuda / artifacts.MANIFEST)
    manifest["environment"]["device"]["type"] = "cuda"
    artifacts.write_json(cuda / artifacts.MANIFEST, manifest)

    def wanted(out, **kw):
        info = triton_repo.write_repository(cuda, tmp_path / out, **kw)
        config = _parse_config(tmp_path / out / "kkdeploy" / "config.pbtxt")
        parameters = {k: {"string_value": v.string_value} for k, v in config.parameters.items()}
        return info.output_device, gpu_outputs_wanted({"parameters": parameters})

    assert wanted("default") == ("cpu", False)
    assert wanted("gpu", output_device="gpu") == ("gpu", True)
    assert not gpu_outputs_wanted({"parameters": {}})  # a repository written before the parameter existed
    info = triton_repo.write_repository(built, tmp_path / "cpu", output_device="gpu")  # a CPU artifact: host only
    assert info.output_device == "cpu"
    assert "kkdeploy_output_device" not in (tmp_path / "cpu" / "kkdeploy" / "config.pbtxt").read_text()
    with pytest.raises(KKError, match="--output-device must be one of cpu, gpu"):
        triton_repo.write_repository(cuda, tmp_path / "x", output_device="host")


def test_auto_serves_a_cuda_artifact_here_in_process_where_the_backend_builds(built, tmp_path, monkeypatch):
    """``--engine auto`` in a repository this machine serves (``kkdeploy serve``, ``loadtest --serve``): a CUDA
    artifact takes the in-process backend, saying so; where it cannot be built, the Python backend, saying why. A CPU
    artifact, a repository for elsewhere (``triton-repo``), the two-hop layout and an explicit engine are as before."""
    from kkdeploy.serving import backend_build

    cuda = tmp_path / "cuda"
    shutil.copytree(built, cuda)
    manifest = artifacts.read_json(cuda / artifacts.MANIFEST)
    manifest["environment"]["device"]["type"] = "cuda"
    artifacts.write_json(cuda / artifacts.MANIFEST, manifest)
    info = triton_repo.write_repository(cuda, tmp_path / "here", served_here=True)
    assert info.engine_backend == triton_repo.INPROCESS_BACKEND and "--engine auto on a CUDA artifact" in info.engine_reason
    assert (tmp_path / "here" / "kkdeploy" / "1" / backend_build.LIBRARY_NAME).is_file()
    for out, kw in (("elsewhere", {}), ("python", dict(engine="python", served_here=True))):
        assert triton_repo.write_repository(cuda, tmp_path / out, **kw).engine_backend == "python", out
    two_hop = triton_repo.write_repository(cuda, tmp_path / "two-hop", topology="two-hop", served_here=True)
    assert two_hop.topology == "two-hop" and two_hop.engine_backend != triton_repo.INPROCESS_BACKEND
    assert triton_repo.write_repository(built, tmp_path / "cpu", served_here=True).engine_backend == "python"

    def no_compiler(log=None):
        raise KKError("no C++ compiler found (g++)")

    monkeypatch.setattr(backend_build, "backend_library", no_compiler)
    info = triton_repo.write_repository(cuda, tmp_path / "no-compiler", served_here=True)
    assert info.engine_backend == "python"
    assert "the in-process backend cannot be built here: no C++ compiler found" in info.engine_reason


def test_python_engine_repository_and_refusals(built, fallback_built, tmp_path):
    info = triton_repo.write_repository(built, tmp_path / "py", engine="python", topology="two-hop")
    engine = _parse_config(tmp_path / "py" / "kkdeploy_engine" / "config.pbtxt")
    assert (info.engine_backend, engine.backend, info.topology) == ("python", "python", "two-hop")
    copied = tmp_path / "py" / "kkdeploy_engine" / "1" / "artifacts"
    assert kkdeploy.load(copied).backend == "ort-cpu"  # the copy passes every check kkdeploy.load makes
    fb = triton_repo.write_repository(fallback_built, tmp_path / "fb")
    assert fb.engine_backend == "python"  # the fallback has no native backend
    with pytest.raises(KKError, match="native Triton backend"):
        triton_repo.write_repository(fallback_built, tmp_path / "fb2", engine="native")
    with pytest.raises(KKError, match="no onnxruntime backend"):
        triton_repo.write_repository(built, tmp_path / "n", engine="native", available_backends={"python"})
    with pytest.raises(KKError, match="not empty"):
        triton_repo.write_repository(built, tmp_path / "py")
    tampered = tmp_path / "tampered"
    subprocess.run(["cp", "-r", str(built), str(tampered)], check=True)
    (tampered / "model.onnx").write_bytes(b"not the validated graph")
    with pytest.raises(KKError, match="model.onnx was modified"):
        triton_repo.write_repository(tampered, tmp_path / "t")
    assert not (tmp_path / "t").exists()


def test_engine_choice_and_gpu_engine_configs_follow_the_manifest():
    """Pure logic on manifest dicts (no engine is built or run here): which Triton backend each shipped choice gets,
    and that the GPU engine configs are valid Triton config text. TensorRT and ORT-CUDA themselves cannot run here."""
    def manifest(backend, candidate, all_valid_only=False):
        return {"choice": {"candidate": candidate, "backend": backend, "all_valid_only": all_valid_only}}

    assert triton_repo.plan_engine(manifest("ort", "ort-cuda"))[0] == "onnxruntime"
    assert triton_repo.plan_engine(manifest("trt", "trt"))[0] == "tensorrt"
    assert triton_repo.plan_engine(manifest("torch_compile", "torch-compile"))[0] == "python"
    backend, why = triton_repo.plan_engine(manifest("trt", "trt", all_valid_only=True))
    assert backend == "python" and "all-valid" in why
    assert triton_repo.plan_engine(manifest("trt", "trt"), "python")[0] == "python"
    # One hop unless a native engine model (or the old layout) is asked for.
    assert triton_repo.plan_topology(manifest("trt", "trt"))[:2] == ("one-hop", "python")
    assert triton_repo.plan_topology(manifest("trt", "trt"), "native")[:2] == ("two-hop", "tensorrt")
    assert triton_repo.plan_topology(manifest("ort", "ort-cuda"), topology="two-hop")[:2] == ("two-hop", "onnxruntime")
    with pytest.raises(KKError, match="--topology must be one of"):
        triton_repo.plan_topology(manifest("ort", "ort-cpu"), topology="three-hop")
    with pytest.raises(KKError, match="--engine must be one of"):
        triton_repo.plan_engine(manifest("ort", "ort-cpu"), "fast")
    config = TransformerConfig(B, S, D, 2, 16, 4)
    trt = _parse_text(triton_repo.engine_config("e", "tensorrt", config, "float16", "cuda", {
        "name": "trt", "options": {"engine": "engine.plan", "tensorrt": "10.x", "version_compatible": False}}))
    assert (trt.backend, trt.default_model_filename, trt.max_batch_size) == ("tensorrt", "engine.plan", 0)
    from tritonclient.grpc import model_config_pb2 as pb

    assert [i.data_type for i in trt.input] == [pb.DataType.Value("TYPE_FP16"), pb.DataType.Value("TYPE_BOOL")]
    assert [list(i.dims) for i in trt.input] == [[B, S, D], [B, S]]
    assert trt.instance_group[0].kind == pb.ModelInstanceGroup.KIND_GPU
    ort = _parse_text(triton_repo.engine_config("e", "onnxruntime", config, "float16", "cuda", {
        "name": "ort-cuda-graph", "options": {"model": "ort-cuda-graph.optimized.onnx", "cuda_graph": True,
                                              "graph_optimization_level": "basic", "onnxruntime": "1.x"}}))
    assert ort.instance_group[0].kind == pb.ModelInstanceGroup.KIND_GPU
    assert ort.optimization.graph.level == triton_repo.ORT_DISABLE_ALL


@pytest.mark.parametrize("argv, message", [
    (["--model-name", "bad name"], "--model-name"),
    (["--max-queue-delay-us", "-1"], "--max-queue-delay-us"),
])
def test_triton_repo_bad_input_is_one_line(built, tmp_path, argv, message):
    done = subprocess.run([sys.executable, "-m", "kkdeploy", "triton-repo", "--artifacts", str(built),
                           "--out", str(tmp_path / "r"), *argv], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and message in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr


# -- the running server ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_all_valid_and_padded_requests_match_the_reference(served, reference, protocol):
    server, info = served
    with client_for(protocol, server) as client:
        rng = np.random.default_rng(7)
        for n in range(1, B + 1):
            for padded in (False, True):
                x, mask = make_case(rng, n, padded)
                y = infer(protocol, client, info.model, x, mask)
                assert y.shape == (n, S, D)
                assert_strict(reference.expect(x, mask), y, f"{protocol} n={n} padded={padded}")
        x, _ = make_case(rng, 3, False)  # no mask: every token valid, as in the model
        assert_strict(reference.expect(x, None), infer(protocol, client, info.model, x, None), "no mask")
        x, mask = make_case(rng, 2, True)  # a sequence with no valid token: zeros, like the padding rows
        mask[1] = False
        x[1] = 0.0
        y = infer(protocol, client, info.model, x, mask)
        assert_strict(reference.expect(x, mask), y, "fully masked sequence")
        assert not y[1].any()


def _start(install, repository: Path, work: Path) -> triton_server.TritonServer:
    http, grpc, metrics_port = triton_server.free_ports().values()
    server = triton_server.TritonServer(install, repository, work, http_port=http, grpc_port=grpc,
                                        metrics_port=metrics_port)
    server.start()
    return server


def test_two_hop_layout_still_serves_exactly(built, reference, install, tmp_path):
    """The layout before issue 30 (front + engine model at its fixed batch B): still served exactly, and the engine
    model takes exactly B sequences."""
    from tritonclient.utils import InferenceServerException

    info = triton_repo.write_repository(built, tmp_path / "repository", engine="python", topology="two-hop")
    server = _start(install, Path(info.path), tmp_path)
    try:
        server.wait_ready(240)
        with client_for("grpc", server) as client:
            rng = np.random.default_rng(17)
            for n in range(1, B + 1):
                x, mask = make_case(rng, n, n % 2 == 0)
                assert_strict(reference.expect(x, mask), infer("grpc", client, info.model, x, mask), f"two-hop n={n}")
        with client_for("http", server) as client:
            x, mask = make_case(np.random.default_rng(3), B, True)
            assert_strict(reference.expect(x, mask), infer("http", client, info.engine_model, x, mask), "engine")
            with pytest.raises(InferenceServerException) as err:
                infer("http", client, info.engine_model, x[:2], mask[:2])
            assert err.value.status() == "400"
        members = server.group_members()
        assert len(members) >= 3  # the server and the two models' Python stubs
    finally:
        assert server.stop() == 0
    assert server.group_members() == []


def test_one_hop_runs_the_smallest_bucket_and_counts_its_stages(served, reference):
    server, info = served

    def kk_metrics() -> dict:
        with urllib.request.urlopen(server.metrics_url, timeout=10) as reply:
            text = reply.read().decode()
        return {f"{n}{{{l}}}": float(v) for n, l, v in re.findall(r"^(kkdeploy_\w+)\{([^}]*)\} (\S+)$", text, re.M)}

    with client_for("grpc", server) as client:
        rng = np.random.default_rng(23)
        time.sleep(0.6)  # stage counters are pushed at most every 0.5 s: this request pushes everything pending
        infer("grpc", client, info.model, *make_case(rng, 1, False))
        time.sleep(0.7)
        before = kk_metrics()
        x3, m3 = make_case(rng, 3, True)
        assert_strict(reference.expect(x3, m3), infer("grpc", client, info.model, x3, m3), "3 in bucket 4")
        time.sleep(0.6)
        x1, m1 = make_case(rng, 1, True)
        assert_strict(reference.expect(x1, m1), infer("grpc", client, info.model, x1, m1), "1 in bucket 1")
    time.sleep(0.7)  # pushed by the model's background flush at the latest
    after = kk_metrics()

    def delta(name: str, **labels) -> float:
        key = next(k for k in after if k.startswith(name + "{") and all(f'{a}="{b}"' in k for a, b in labels.items()))
        return after[key] - before.get(key, 0.0)

    assert delta("kkdeploy_bucket_executions_total", bucket="4") == 1  # 3 sequences: the smallest bucket is 4
    assert delta("kkdeploy_bucket_executions_total", bucket="1") == 1  # 1 sequence: bucket 1, no padding
    assert delta("kkdeploy_bucket_executions_total", bucket="2") == 0
    assert delta("kkdeploy_rows_total", kind="real") == 4 and delta("kkdeploy_rows_total", kind="padding") == 1
    for stage in ("gather", "engine", "respond"):
        assert delta("kkdeploy_stage_us_total", stage=stage) > 0


def test_concurrent_clients_lose_nothing_and_get_their_own_rows(served, reference):
    server, info = served
    rng = np.random.default_rng(11)
    cases = []
    for i in range(40):  # a pool of mixed requests, each with its reference computed once
        x, mask = make_case(rng, int(rng.integers(1, B + 1)), bool(i % 2))
        cases.append((x, mask, reference.expect(x, mask)))
    before = settled_metrics(server)
    clients, per_client = 8, 50
    outcomes: dict[int, list] = {c: [] for c in range(clients)}

    def run(c: int):
        protocol = "http" if c % 2 == 0 else "grpc"
        with client_for(protocol, server) as client:
            pick = random.Random(c)
            for _ in range(per_client):
                k = pick.randrange(len(cases))
                x, mask, expected = cases[k]
                try:
                    y = infer(protocol, client, info.model, x, mask)
                    report = compare_outputs(expected, torch.from_numpy(np.array(y)), *CONTRACTS["strict"])
                    outcomes[c].append((k, y.shape == x.shape and report.passed, report.summary()))
                except Exception as exc:  # noqa: BLE001 - counted as lost
                    outcomes[c].append((k, False, f"{type(exc).__name__}: {exc}"))

    threads = [threading.Thread(target=run, args=(c,), daemon=True) for c in range(clients)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 300
    for t in threads:
        t.join(timeout=max(1.0, deadline - time.monotonic()))
    assert not any(t.is_alive() for t in threads), "clients did not finish within 300 s"
    answered = [o for c in outcomes.values() for o in c]
    assert len(answered) == clients * per_client
    wrong = [o for o in answered if not o[1]]
    assert not wrong, f"{len(wrong)} wrong or lost, first: {wrong[0]}"
    key = ("nv_inference_request_success", info.model)
    after = wait_for_count(server, key, before.get(key, 0) + clients * per_client)
    requests = after[key] - before.get(key, 0)
    executions = after[("nv_inference_exec_count", info.model)] - before.get(("nv_inference_exec_count", info.model), 0)
    assert requests == clients * per_client
    assert executions < requests  # the dynamic batcher gathered concurrent requests into shared engine calls


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_bad_requests_get_a_4xx_and_the_server_keeps_answering(served, reference, protocol):
    from tritonclient.utils import InferenceServerException

    server, info = served
    with client_for(protocol, server) as client:
        rng = np.random.default_rng(5)
        x, mask = make_case(rng, 2, True)
        bad = {
            "wrong width": (make_case(rng, 2, False, width=D - 1)[0], mask, "FP32", "unexpected shape for input 'x'"),
            "wrong dtype": (x.astype(np.float64), mask, "FP64", "data-type is 'FP64'"),
            "mask of the wrong shape": (x, mask[:, : S - 1], "FP32", "unexpected shape for input 'valid_token_mask'"),
            "more sequences than B": (*make_case(rng, B + 1, False), "FP32", f"batch-size must be <= {B}"),
            "mask for other sequences": (x, np.ones((3, S), dtype=bool), "FP32", "batch size does not match"),
        }
        expected_status = "400" if protocol == "http" else "StatusCode.INVALID_ARGUMENT"
        for what, (bx, bmask, x_type, message) in bad.items():
            with pytest.raises(InferenceServerException) as err:
                infer(protocol, client, info.model, bx, bmask, x_type=x_type)
            assert err.value.status() == expected_status, what
            assert message in err.value.message(), (what, err.value.message())
            assert server.alive()
            assert_strict(reference.expect(x, mask), infer(protocol, client, info.model, x, mask), f"after {what}")


def test_metrics_count_the_requests(served):
    server, info = served
    with client_for("http", server) as client:
        before = settled_metrics(server)
        rng = np.random.default_rng(9)
        sizes = [1, 2, 3, 4, 2]
        for n in sizes:
            infer("http", client, info.model, *make_case(rng, n, True))
        key = ("nv_inference_request_success", info.model)
        after = wait_for_count(server, key, before.get(key, 0) + len(sizes))
        assert after[key] - before.get(key, 0) == len(sizes)
        count = ("nv_inference_count", info.model)  # sequences, not requests
        assert after[count] - before.get(count, 0) == sum(sizes)
        assert after[("nv_inference_request_success", info.engine_model)] > 0


def test_server_stops_and_leaves_no_process(served):
    server, info = served
    members = server.group_members()
    assert server.pid in members and len(members) >= 2  # the server and the one model's Python stub (one hop)
    assert triton_server.processes_mentioning(info.path)
    assert server.stop() == 0  # a clean shutdown
    assert not server.alive() and server.group_members() == []
    assert triton_server.processes_mentioning(info.path) == []
    for pid in members:
        assert not Path(f"/proc/{pid}").exists() or Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    assert not [p for p in Path("/dev/shm").glob(f"{triton_server._SHM_PREFIX}*") if p.name in server._shm_regions]


# -- `kkdeploy serve` -----------------------------------------------------------------------------------------------
def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k != triton_server.ENV_SERVER}
    env.update(PYTHONUNBUFFERED="1", **extra)
    return env


def test_serve_runs_until_interrupted_and_leaves_nothing(fallback_built, install):
    http, grpc, metrics_port = triton_server.free_ports().values()
    proc = subprocess.Popen([sys.executable, "-m", "kkdeploy", "serve", "--artifacts", str(fallback_built),
                             "--http-port", str(http), "--grpc-port", str(grpc), "--metrics-port", str(metrics_port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env())
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 240
        while not any("ready in" in ln for ln in lines) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert any("ready in" in ln for ln in lines), "".join(lines)
        text = "".join(lines)
        server_pid = int(re.search(r"tritonserver pid (\d+)", text).group(1))
        workdir = re.search(r"repository (\S+)/repository", text).group(1)
        assert "pytorch-fallback" in text
        import tritonclient.http as th

        ref = Reference(fallback_built)
        x, mask = make_case(np.random.default_rng(1), 1, True, seq=ref.config.seq_len, width=ref.config.d_model)
        client = th.InferenceServerClient(f"127.0.0.1:{http}", network_timeout=60.0)
        try:
            assert_strict(ref.expect(x, mask), infer("http", client, "kkdeploy", x, mask), "serve")
        finally:
            client.close()
        proc.send_signal(signal.SIGINT)  # Ctrl-C
        assert proc.wait(timeout=90) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    reader.join(timeout=10)
    text = "".join(lines)
    assert "no process left" in text, text
    assert not Path(f"/proc/{server_pid}").exists() or Path(f"/proc/{server_pid}/stat").read_text().split()[2] == "Z"
    assert triton_server.processes_mentioning(workdir) == []
    assert not Path(workdir).exists()


def test_serve_bad_setups_are_one_line_errors(built, install, tmp_path):
    def serve(*argv, env=None):
        return subprocess.run([sys.executable, "-m", "kkdeploy", "serve", *argv], capture_output=True, text=True,
                              timeout=120, env=env or _env())

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = serve("--artifacts", str(built), "--http-port", str(port))
    assert done.returncode == 2 and f"port {port} (http) is already in use" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert importlib.util.find_spec("pytriton") is None, "a pytriton package is installed: it would be found"
    bare = _env(**{triton_server.ENV_CACHE: str(tmp_path / "empty-cache"),
                   "PATH": os.pathsep.join([str(Path(sys.executable).parent), "/usr/bin", "/bin"])})
    done = serve("--artifacts", str(built), env=bare)
    assert done.returncode == 2 and "no tritonserver found" in done.stderr
    assert triton_server.INSTALL_COMMAND in done.stderr and len(done.stderr.strip().splitlines()) == 1
    done = serve("--artifacts", str(tmp_path / "nowhere"))
    assert done.returncode == 2 and "is not a directory" in done.stderr
    done = serve("--artifacts", str(built), "--http-port", "9", "--grpc-port", "9")
    assert done.returncode == 2 and "both 9" in done.stderr
    done = serve("--artifacts", str(built), env=_env(KKDEPLOY_HOST_WAIT="busy"))  # no server is started for it
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "KKDEPLOY_HOST_WAIT='busy' is not a host-wait mode; use leave, auto, spin" in done.stderr


def test_a_crashed_server_is_reported_by_its_signal_not_a_backtrace_frame(tmp_path):
    server = triton_server.TritonServer(triton_server.ServerInstall.__new__(triton_server.ServerInstall), tmp_path,
                                        tmp_path)
    server.log_path.write_text("I1204 12:00:00.000 1 server.cc:1] loading\nSignal (6) received.\n"
                               " 0# 0x000055D0 in tritonserver\n22# 0x00007F42599278EC in /lib/x86_64-linux-gnu/libc.so.6\n")
    assert server.failure_reason().startswith("Signal (6) received.")
    server.log_path.write_text("I1204 12:00:00.000 1 server.cc:1] the last words\n 3# 0x1 in x\n")
    assert server.failure_reason().startswith("the last words")  # no signal: the last line that is not a frame


def test_free_ports_are_three_distinct_ports_nothing_listens_on():
    ports = triton_server.free_ports()
    assert list(ports) == ["http", "grpc", "metrics"] and len(set(ports.values())) == 3
    assert not any(triton_server.port_in_use("127.0.0.1", port) for port in ports.values())
