"""`kkdeploy loadtest` (issue 30): the load generator's arithmetic, and the CPU target with a real server: a shape-3
build with --batch-buckets 1,2,4 serving batch-1 gRPC requests from two client processes, every answer bitwise
equal to the direct engine, whose answers are strict-equal to the reference."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import types
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest
import torch

import kkdeploy
from kkdeploy import artifacts
from kkdeploy.cli import main as cli
from kkdeploy.config import TransformerConfig
from kkdeploy.errors import KKError
from kkdeploy.serving import loadtest, triton_server
from validation import CONTRACTS, compare_outputs

pytestmark = pytest.mark.slow
QUICK = ["--trials", "2", "--warmups", "2", "--repeats", "5", "--rounds", "1"]


@pytest.fixture(scope="module")
def shape3(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("lt") / "shape-03"
    assert cli(["build", "--shape", "3", "--device", "cpu", *QUICK, "--batch-buckets", "1,2,4", "--out", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def install():
    return triton_server.find_server() or triton_server.install_server()


def plan(**kw) -> loadtest.LoadPlan:
    base = dict(model="kkdeploy", seq_len=8, d_model=4, dtype="float32", requests=10, processes=1, concurrency=1)
    return loadtest.LoadPlan(**{**base, **kw})


# -- arithmetic, no server ------------------------------------------------------------------------------------------
def test_mix_padding_and_plan_checks():
    assert loadtest.parse_mix("1:0.7,2:0.2,4") == [[1, 0.7], [2, 0.2], [4, 1.0]]
    assert loadtest.parse_ratios("0,0.25") == [0.0, 0.25]
    for text in ("a", ",", "1:x"):
        with pytest.raises(KKError, match="--mix"):
            loadtest.parse_mix(text)
    for bad, message in [(dict(protocol="udp"), "--protocol"), (dict(concurrency=1, processes=2), "--concurrency"),
                         (dict(rate=-1), "--rate"), (dict(requests=None), "--requests N or --duration"),
                         (dict(mix=[[0, 1.0]]), "--mix"), (dict(padding=[1.0]), "--padding"),
                         (dict(shared_memory="nvme"), "--shared-memory"), (dict(dtype="int8"), "float32 or float16"),
                         (dict(client="native", protocol="http"), "--client native speaks gRPC only")]:
        with pytest.raises(KKError, match=message):
            plan(**bad).check()


def test_megabyte_requests_inside_grpc_get_the_shared_memory_hint_and_small_ones_do_not():
    """A shape-13 batch of 64 (16 MB of float16 each way) sent inside gRPC is told that shared memory moves it
    faster, with the size and what it gave; through shared memory, or a shape-3 request, no hint."""
    big = plan(seq_len=1024, d_model=128, dtype="float16", mix=[[1, 0.5], [64, 0.5]])
    hint = loadtest.payload_hint(big)
    assert hint.startswith("hint: a 64-sequence request carries 16.1 MB each way inside grpc; --shared-memory system")
    assert "docs/serving.md" in hint
    assert loadtest.payload_hint(plan(seq_len=1024, d_model=128, dtype="float16", mix=[[64, 1.0]],
                                      shared_memory="system")) == ""
    assert loadtest.payload_hint(plan(seq_len=128, d_model=128, dtype="float32", mix=[[4, 1.0]])) == ""


def test_one_instance_of_a_cuda_engine_is_told_what_more_gave():
    """``kkdeploy serve`` / ``triton-repo`` on a CUDA artifact with one instance print what 2 and 4 instances
    served; a CPU artifact, or more instances, print nothing of it."""
    from kkdeploy.serving.triton_repo import RepositoryInfo, instances_hint

    def info(device_type: str, instances: int) -> RepositoryInfo:
        return RepositoryInfo(path="/r", model="kkdeploy", engine_model="kkdeploy", engine_backend="kkdeploy",
                              candidate="c", engine_reason="", choice_reason="", config={"batch_size": 4},
                              dtype="float16", device_type=device_type, max_queue_delay_us=0, topology="one-hop",
                              buckets=[1, 2, 4], instances=instances)

    assert instances_hint(info("cuda", 1)).startswith("one instance: at saturation, --instances 2 served 101-110%")
    assert instances_hint(info("cuda", 2)) == instances_hint(info("cpu", 1)) == ""


def test_pool_is_deterministic_and_follows_the_mix():
    p = plan(mix=[[1, 3.0], [3, 1.0]], padding=[0.0, 0.5], pool=200, seed=9)
    a, b = loadtest.make_pool(p), loadtest.make_pool(p)
    assert all(np.array_equal(x1, x2) and (m1 is None) == (m2 is None) for (x1, m1), (x2, m2) in zip(a, b))
    sizes = [x.shape[0] for x, _ in a]
    assert set(sizes) == {1, 3} and 0.6 < sizes.count(1) / len(sizes) < 0.9
    assert all(m is None for _, m in a[0::2])  # ratio 0: no mask sent
    for x, m in a[1::2]:  # ratio 0.5: at least half the tokens valid, invalid rows zero
        assert m.sum(axis=1).min() >= 4 and not x[~m].any()


def test_percentiles_breakdown_and_a_wrong_answer_is_counted():
    assert loadtest.percentile([5, 1, 3, 2, 4], 50) == 3 and loadtest.percentile([], 50) is None
    assert loadtest.percentile(list(range(1, 101)), 99) == 99
    delta = {"nv_inference_request_success": 10, "nv_inference_exec_count": 4, "nv_inference_count": 12,
             "nv_inference_queue_duration_us": 500, "nv_inference_request_duration_us": 3000,
             "kkdeploy_bucket_executions_total{bucket=4}": 3, "kkdeploy_bucket_executions_total{bucket=1}": 1,
             "kkdeploy_stage_us_total{stage=engine}": 800, "kkdeploy_rows_total{kind=real}": 12,
             "kkdeploy_rows_total{kind=padding}": 1, "kkdeploy_route_executions_total{route=native}": 3,
             "kkdeploy_route_executions_total{route=python}": 1}
    s = loadtest.server_breakdown(delta)
    assert s["queue_duration_us_per_request"] == 50 and s["request_duration_us_per_request"] == 300
    assert s["engine_us_per_run"] == 200 and s["avg_batch_sequences"] == 3 and s["padding_rows_fraction"] == 0.0769
    assert s["runs_by_bucket"] == {"4": 3, "1": 1} and s["executions_by_route"] == {"native": 3, "python": 1}
    p = plan(pool=3)
    answers = [{1: ("a",)}, {1: ("b",)}, {1: ("c",), 2: ("d", "e")}]
    records = [(0, 0.0, 0.01, "a", None), (2, 0.1, 0.02, "d", None), (1, 0.2, 0.03, "zz", None),
               (1, 0.3, 0.04, None, "InferenceServerException: down")]
    summary = loadtest.summarize(p, records, answers, delta, 1.0)
    assert (summary["answered"], summary["bitwise_equal"], summary["wrong"], summary["errors"]) == (3, 2, 1, 1)
    assert summary["matched_buckets"] == {"1": 1, "2": 1}
    assert summary["first_errors"] == ["InferenceServerException: down"]
    assert "--concurrency-range=1" in loadtest.perf_analyzer_command(p)


def test_the_chart_splits_a_request_as_tritons_counters_do(tmp_path):
    from kkdeploy.serving import loadtest_chart

    def run(protocol, client, server, cdf):
        return {"plan": dict(protocol=protocol, concurrency=2, rate=None, client=client, shared_memory="none"),
                "loop": "closed", "latency_ms": {"mean": 1.0}, "latency_cdf_ms": cdf,
                "latency_ms_by_batch": {"1": {}}, "server": server}

    counters = {"request_duration_us_per_request": 600.0, "queue_duration_us_per_request": 100.0,
                "compute_input_duration_us_per_request": 50.0, "compute_infer_duration_us_per_request": 400.0,
                "compute_output_duration_us_per_request": 50.0}
    served = run("grpc", "native", counters, [0.5 + k / 100 for k in range(101)])
    assert loadtest_chart.time_split_ms(served) == [("client + network", 0.4), ("queue", 0.1), ("input", 0.05),
                                                    ("infer", 0.4), ("output", 0.05)]
    assert loadtest_chart.run_label(served) == "grpc c=2, native"
    bare = run("http", "lean", {}, [])  # no counters, no latencies: drawn empty, not an error
    assert loadtest_chart.time_split_ms(bare) == [] and loadtest_chart.run_label(bare) == "http c=2, tritonclient"
    path = loadtest_chart.plot_load(tmp_path / "load.png", [served, bare], {"1": {"median_ms": 0.3}})
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and not list(tmp_path.glob(".*partial"))


def test_lean_grpc_requests_are_tritonclients_bytes_with_and_without_shared_memory():
    """The lean client's pre-serialized requests are the messages tritonclient would send for the same inputs (equal
    as messages: a map's entries may be serialized in another order): the payload's bytes; or, through shared
    memory, the regions (x at its payload's offset in the input region, the mask after it, the answer in the output
    region) and no bytes at all."""
    import tritonclient.grpc as grpcclient
    from tritonclient.grpc import _utils, service_pb2

    p = plan(mix=[[2, 1.0]], padding=[0.0, 0.5], pool=2, seed=4, seq_len=64, d_model=32)
    pool = loadtest.make_pool(p)
    regions = types.SimpleNamespace(name="kkdeploy_lt_t", input_region="kkdeploy_lt_t_in",
                                    output_region="kkdeploy_lt_t_out", input_offset=lambda index: 4096 * index)

    def tritonclients(index: int, shm: bool) -> bytes:
        x, mask = pool[index]
        inputs = [grpcclient.InferInput("x", list(x.shape), "FP32")]
        if mask is not None:
            inputs.append(grpcclient.InferInput("valid_token_mask", list(mask.shape), "BOOL"))
        output = grpcclient.InferRequestedOutput("y")
        if shm:
            inputs[0].set_shared_memory(regions.input_region, x.nbytes, 4096 * index)
            if mask is not None:
                inputs[1].set_shared_memory(regions.input_region, mask.nbytes, 4096 * index + x.nbytes)
            output.set_shared_memory(regions.output_region, x.nbytes)
        else:
            inputs[0].set_data_from_numpy(x)
            if mask is not None:
                inputs[1].set_data_from_numpy(mask)
        request = _utils._get_inference_request("kkdeploy", inputs, "", "", [output], 0, False, False, 0, None, None)
        return request

    def parsed(data: bytes):
        return service_pb2.ModelInferRequest.FromString(data)

    cache: dict = {}
    plain, shared = loadtest.LeanGrpc(p, pool, cache), loadtest.LeanGrpc(p, pool, cache, shm=regions)
    try:
        for index in range(len(pool)):
            assert parsed(plain.request(index)) == tritonclients(index, shm=False)
            assert parsed(shared.request(index)) == tritonclients(index, shm=True)
            assert not parsed(shared.request(index)).raw_input_contents
            assert len(shared.request(index)) < 400 < pool[index][0].nbytes  # no payload in a shared-memory request
    finally:
        plain.close(), shared.close()
    assert pool[0][1] is None and pool[1][1] is not None  # both kinds of request were compared


def test_the_answer_is_read_from_a_response_s_wire_bytes_without_parsing_it():
    """``raw_output_contents`` finds a serialized response's raw outputs as views of its bytes (so that a 16 MB
    answer is fingerprinted where it lies), whatever other fields come first: the model's name, a map of
    parameters, the outputs' descriptions, a varint-typed field; and a truncated or foreign message is an error,
    never a wrong answer."""
    from tritonclient.grpc import service_pb2

    rng = np.random.default_rng(3)
    y = rng.standard_normal((2, 300)).astype(np.float32).tobytes()  # 2,400 bytes: a two-byte length varint
    response = service_pb2.ModelInferResponse(model_name="kkdeploy", model_version="1", id="r7")
    response.parameters["sequence_start"].bool_param = True
    response.parameters["triton_final_response"].int64_param = 300
    out = response.outputs.add(name="y", datatype="FP32")
    out.shape.extend([2, 300])
    response.raw_output_contents.append(y)
    wire = response.SerializeToString()
    found = loadtest.raw_output_contents(wire)
    assert [bytes(v) for v in found] == [y]
    assert found[0].obj is wire and loadtest.fingerprint(found[0]) == loadtest.fingerprint(y)
    response.raw_output_contents.append(b"")  # what Triton may leave for an output written to a region
    assert [bytes(v) for v in loadtest.raw_output_contents(response.SerializeToString())] == [y, b""]
    assert loadtest.raw_output_contents(service_pb2.ModelInferResponse(model_name="m").SerializeToString()) == []
    for cut in (wire[:-7], wire[:1], wire[:-len(y) - 1]):
        with pytest.raises(RuntimeError, match="ends inside a field"):
            loadtest.raw_output_contents(cut)
    with pytest.raises(RuntimeError, match="not a ModelInferResponse"):
        loadtest.raw_output_contents(bytes([0x0B, 0x01]))  # wire type 3, a group: nothing Triton sends


def test_fingerprint_is_xxh3_128_of_the_bytes_and_names_its_package_when_missing(monkeypatch):
    """The load generator's answer check: XXH3-128 of the answer's bytes, the same for an array and its bytes,
    different for one flipped bit; without xxhash, a one-line error naming the fix."""
    import xxhash

    a = np.arange(4096, dtype=np.float16).reshape(64, 64)
    assert loadtest.fingerprint_array(a) == loadtest.fingerprint(a.tobytes()) == xxhash.xxh3_128_hexdigest(a.tobytes())
    assert loadtest.fingerprint_array(a[:, ::2]) == loadtest.fingerprint(np.ascontiguousarray(a[:, ::2]).tobytes())
    flipped = a.copy()
    flipped.view(np.uint16)[17, 5] ^= 1
    assert loadtest.fingerprint_array(flipped) != loadtest.fingerprint_array(a)
    monkeypatch.setattr(loadtest, "_xxh3_128", None)
    monkeypatch.setitem(sys.modules, "xxhash", None)
    with pytest.raises(KKError, match=r"needs xxhash to check answers: pip install 'kkdeploy\[serve\]'"):
        loadtest.fingerprint(b"y")


# -- the CPU target, with a real server -----------------------------------------------------------------------------
def test_cpu_target_batch1_grpc_from_two_processes_every_answer_exact(shape3, install, tmp_path):
    out = tmp_path / "lt.json"
    done = subprocess.run([sys.executable, "-m", "kkdeploy", "loadtest", "--artifacts", str(shape3), "--serve",
                           "--protocol", "grpc", "--processes", "2", "--concurrency", "2", "--requests", "120",
                           "--mix", "1", "--padding", "0,0.25", "--pool", "16", "--json", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "Where the time goes" in done.stdout and "bitwise" in done.stdout
    assert "gRPC client: native" in done.stdout  # --client auto: our C++ client, where it builds
    data = json.loads(out.read_text())
    assert data["buckets"] == [1, 2, 4]
    (run,) = data["runs"]
    assert run["plan"]["processes"] == 2 and run["plan"]["protocol"] == "grpc" and run["plan"]["client"] == "native"
    assert run["requests"] == run["answered"] == run["bitwise_equal"] == 120
    assert run["errors"] == run["wrong"] == run["warmup_wrong"] == 0
    server = run["server"]
    assert server["requests"] == 120 and set(server["runs_by_bucket"]) <= {"1", "2"}  # batch-1 requests, gathered
    assert run["latency_ms"]["p50"] > 0 and run["req_per_s"] > 0
    cdf = run["latency_cdf_ms"]  # the distribution in 101 points, and its picture beside the JSON
    assert len(cdf) == 101 and cdf == sorted(cdf) and cdf[-1] == pytest.approx(run["latency_ms"]["max"], abs=1e-3)
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # an empty gRPC call's round trip, measured before the load: less than a request that carries a model's work
    assert 0 < run["rpc_floor_ms"] < run["latency_ms"]["p50"]
    # The direct engine's answers (what every response equalled bit for bit) are strict-equal to the reference.
    p = loadtest.LoadPlan(**run["plan"])
    pool = loadtest.make_pool(p)
    runner = kkdeploy.load(shape3)
    manifest = artifacts.read_json(shape3 / artifacts.MANIFEST)
    from safetensors.torch import load_file

    reference = kkdeploy.ReferenceTransformer(TransformerConfig.from_dict(manifest["config"]))
    reference.load_state_dict(load_file(str(shape3 / manifest["weights"]["file"])))
    answers = loadtest.expected_answers(runner, pool)
    with torch.inference_mode():
        for (x, mask), found in zip(pool, answers):
            xt = torch.from_numpy(x)
            mt = None if mask is None else torch.from_numpy(mask)
            y = runner(xt, mt)
            assert loadtest.fingerprint(y.numpy().tobytes()) == found[1][0]
            assert compare_outputs(reference.eval()(xt, mt), y, *CONTRACTS["strict"]).passed


def test_shared_memory_payloads_are_written_once_before_the_load():
    """A client's system shared-memory input region holds every payload of the pool one after another, written when
    the client is made: a request names its payload's offset and writes nothing (``write`` is a no-op), so the clock
    holds no copy of the client's, as perf_analyzer's shared-memory inputs. Past ``preload_mb`` the region has one
    slot, which each request writes. The regions are registered with the server (a stand-in here) and destroyed."""
    import tritonclient.utils.shared_memory as shm

    registered = []
    fake = types.SimpleNamespace(client=types.SimpleNamespace(
        register_system_shared_memory=lambda name, key, size: registered.append((name, size)),
        unregister_system_shared_memory=lambda name: None))
    p = plan(pool=4, mix=[[1, 0.5], [2, 0.5]], padding=[0.0, 0.25], shared_memory="system")
    pool = loadtest.make_pool(p)
    sizes = [sum(a.nbytes for a in loadtest.payload_arrays(payload)) for payload in pool]
    region = loadtest._SharedMemory(fake, p, pool, "unit_preload")
    try:
        assert region.preloaded and registered[0] == ("kkdeploy_lt_unit_preload_in", sum(sizes))
        assert [region.input_offset(i) for i in range(4)] == [0, sizes[0], sum(sizes[:2]), sum(sizes[:3])]
        for i, (x, mask) in enumerate(pool):  # each payload where its requests say it is
            start = region.input_offset(i)
            got = shm.get_contents_as_numpy(region.inp, x.dtype, [x.size], offset=start)
            assert np.array_equal(got, x.reshape(-1))
            if mask is not None:
                assert np.array_equal(shm.get_contents_as_numpy(region.inp, np.bool_, [mask.size],
                                                                offset=start + x.nbytes), mask.reshape(-1))
        before = shm.get_contents_as_numpy(region.inp, np.uint8, [sum(sizes)]).copy()
        region.write(3)
        assert np.array_equal(shm.get_contents_as_numpy(region.inp, np.uint8, [sum(sizes)]), before)
    finally:
        region.close()
    small = loadtest._SharedMemory(fake, loadtest.LoadPlan(**{**asdict(p), "preload_mb": 0.0}), pool, "unit_slot")
    try:  # one slot at offset 0, written by each request
        assert not small.preloaded and small.input_offset(3) == 0
        small.write(3)
        x, _ = pool[3]
        assert np.array_equal(shm.get_contents_as_numpy(small.inp, x.dtype, [x.size]), x.reshape(-1))
    finally:
        small.close()
    assert not list(Path("/dev/shm").glob("kkdeploy_lt_unit_*"))
    with pytest.raises(KKError, match="--shm-preload-mb must be 0 or more"):
        loadtest.LoadPlan(**{**asdict(p), "preload_mb": -1.0}).check()


def test_a_client_process_that_dies_or_hangs_before_the_load_is_named():
    """The parent waits for its client processes' ready reports, but no longer blindly: one that died first (a crash
    in gRPC's or CUDA's native code ends a process without a report) is named with the signal that ended it on the
    next poll, and one still starting at the deadline is named with what to change. Reports already in the pipe
    count before a death is called."""
    import queue as queue_mod
    import signal

    alive, crashed = types.SimpleNamespace(exitcode=None), types.SimpleNamespace(exitcode=-signal.SIGSEGV)
    ready = queue_mod.Queue()
    ready.put((0, None, [(1, "d")]))
    with pytest.raises(KKError, match=r"client process 1 died before the load \(killed by SIGSEGV\)"):
        list(loadtest.await_clients([alive, crashed], ready, timeout_s=30, poll_s=0.01))
    ready.put((0, None, []))
    ready.put((1, None, []))  # it reported, then ended: it counts
    assert len(list(loadtest.await_clients([alive, crashed], ready, timeout_s=30, poll_s=0.01))) == 2
    ready.put((0, None, [(1, "d")]))
    ready.put((1, None, []))
    assert sorted(i for i, _ in loadtest.await_clients([alive, alive], ready, 30, 0.01)) == [0, 1]
    ready.put((1, "KKError: no server", []))
    with pytest.raises(KKError, match="client process 1 failed before the load: KKError: no server"):
        list(loadtest.await_clients([alive, alive], ready, 30, 0.01))
    began = time.monotonic()
    with pytest.raises(KKError, match=r"client process 0 did not start within 0 s .*--shm-preload-mb"):
        list(loadtest.await_clients([alive], ready, timeout_s=0.2, poll_s=0.05))
    assert time.monotonic() - began < 5
    assert loadtest.exit_reason(3) == "exit code 3" and loadtest.exit_reason(-9) == "killed by SIGKILL"


def test_cuda_regions_are_set_up_one_client_thread_at_a_time(monkeypatch):
    """tritonclient's CUDA shared-memory module makes its one stream per device on first use without a lock, so
    two client threads setting up at once can race for it. A client process's threads create their CUDA regions and
    make their first copy (the preload, or one byte into the output region; it makes the stream) one at a time. A
    stand-in module records what overlaps."""
    import threading

    active, overlaps, calls = [0], [], []
    guard = threading.Lock()

    def busy(name):
        def call(*args):
            with guard:
                active[0] += 1
                calls.append(name)
                if active[0] > 1:
                    overlaps.append(name)
            time.sleep(0.02)
            with guard:
                active[0] -= 1
            return types.SimpleNamespace(name=name) if name == "create" else None
        return call

    import tritonclient.utils  # noqa: F401 - the real package; its CUDA module is the stand-in below

    fake = types.ModuleType("tritonclient.utils.cuda_shared_memory")
    fake.create_shared_memory_region = busy("create")
    fake.set_shared_memory_region = busy("set")
    fake.get_raw_handle = lambda handle: b"handle"
    fake.destroy_shared_memory_region = lambda handle: None
    monkeypatch.setitem(sys.modules, "tritonclient.utils.cuda_shared_memory", fake)
    registered = []
    client = types.SimpleNamespace(client=types.SimpleNamespace(
        register_cuda_shared_memory=lambda name, raw, device, size: registered.append(name),
        unregister_cuda_shared_memory=lambda name: None))
    for preload_mb in (1024.0, 0.0):  # the payloads preloaded, or one slot that each request writes
        p = plan(pool=4, mix=[[1, 1.0]], shared_memory="cuda", preload_mb=preload_mb)
        pool = loadtest.make_pool(p)
        made, registered[:], calls[:] = [], [], []
        threads = [threading.Thread(target=lambda i=i: made.append(loadtest._SharedMemory(client, p, pool, f"t{i}")))
                   for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(made) == 4 and len(registered) == 8 and made[0].preloaded == (preload_mb > 0)
        assert not overlaps, f"set-up calls overlapped across threads: {overlaps}"
        assert calls.count("create") == 8 and calls.count("set") == 4  # one first copy per thread


def _fake_cudart(calls: list, keep: list):
    """cuda-python's runtime as far as ``PinnedReadback`` uses it, over host memory (ctypes buffers)."""
    import ctypes

    def malloc_host(n):
        buf = ctypes.create_string_buffer(n)
        keep.append(buf)
        calls.append(("malloc_host", n))
        return 0, ctypes.addressof(buf)

    def memcpy(dst, src, n, kind):
        calls.append(("memcpy", n, kind))
        ctypes.memmove(dst, src, n)
        return (0, )

    runtime = types.ModuleType("cuda.bindings.runtime")
    runtime.cudaMallocHost = malloc_host
    runtime.cudaMemcpy = memcpy
    runtime.cudaFreeHost = lambda pointer: calls.append(("free_host", pointer)) or (0, )
    runtime.cudaMemcpyKind = types.SimpleNamespace(cudaMemcpyDeviceToHost="DtoH")
    return runtime


def test_cuda_answers_are_read_into_one_pinned_buffer_per_client(monkeypatch):
    """A CUDA shared-memory answer is copied once, device to host, into the client's page-locked buffer, and the
    answer is a view of it: one allocation per client, not tritonclient's zeroed buffer and second copy per call.
    cuda-python's runtime is a stand-in over host memory here; where it is missing, or the region has no device
    address, the client reads through tritonclient as before."""
    import ctypes

    calls, keep = [], []
    runtime = _fake_cudart(calls, keep)
    package = types.ModuleType("cuda.bindings")
    package.runtime = runtime
    monkeypatch.setitem(sys.modules, "cuda", types.ModuleType("cuda"))
    monkeypatch.setitem(sys.modules, "cuda.bindings", package)
    monkeypatch.setitem(sys.modules, "cuda.bindings.runtime", runtime)
    answer = np.arange(24, dtype=np.float16).reshape(2, 3, 4)
    device = ctypes.create_string_buffer(answer.tobytes() + bytes(16))  # the region: the answer, then room
    region = types.SimpleNamespace(_base_addr=ctypes.addressof(device))
    pinned = loadtest.PinnedReadback.open(region, answer.nbytes + 16)
    first = pinned.read(answer.nbytes, np.float16, answer.shape)
    assert np.array_equal(first, answer) and first.dtype == np.float16
    ctypes.memmove(ctypes.addressof(device), (answer + 1).tobytes(), answer.nbytes)  # the next answer
    second = pinned.read(answer.nbytes, np.float16, answer.shape)
    assert np.array_equal(second, answer + 1)
    assert first.__array_interface__["data"][0] == second.__array_interface__["data"][0]  # one buffer, reused
    assert [c[0] for c in calls] == ["malloc_host", "memcpy", "memcpy"] and calls[1][2] == "DtoH"
    with pytest.raises(KKError, match="does not fit"):
        pinned.read(answer.nbytes + 17, np.uint8, [answer.nbytes + 17])
    pinned.close()
    assert calls[-1] == ("free_host", pinned.pointer)
    # a client's regions: its answers come through the pinned buffer, never through tritonclient's reader
    import tritonclient.utils  # noqa: F401 - the real package; its CUDA module is the stand-in below
    p = plan(pool=2, mix=[[1, 1.0]], shared_memory="cuda", seq_len=3, d_model=4, dtype="float16")
    pool = loadtest.make_pool(p)
    fake = types.ModuleType("tritonclient.utils.cuda_shared_memory")
    fake.create_shared_memory_region = lambda name, size, dev: types.SimpleNamespace(
        _base_addr=ctypes.addressof(device) if name.endswith("_out") else 0)
    fake.set_shared_memory_region = lambda handle, arrays: None
    fake.get_raw_handle = lambda handle: b"handle"
    fake.destroy_shared_memory_region = lambda handle: None
    fake.get_contents_as_numpy = lambda *a: pytest.fail("read through tritonclient")
    monkeypatch.setitem(sys.modules, "tritonclient.utils.cuda_shared_memory", fake)
    client = types.SimpleNamespace(client=types.SimpleNamespace(
        register_cuda_shared_memory=lambda *a: None, unregister_cuda_shared_memory=lambda name: None))
    regions = loadtest._SharedMemory(client, p, pool, "pinned")
    assert np.array_equal(regions.read(0), (answer + 1).reshape(-1)[:12].reshape(1, 3, 4))
    regions.close()
    assert regions.pinned is None and calls[-1][0] == "free_host"
    runtime.cudaMemcpy = lambda *a: (700, )  # cudaErrorIllegalAddress
    with pytest.raises(KKError, match="CUDA error 700"):
        loadtest.PinnedReadback.open(region, 8).read(8, np.uint8, [8])
    assert loadtest.PinnedReadback.open(types.SimpleNamespace(), 8) is None  # no device address: tritonclient reads
    monkeypatch.setitem(sys.modules, "cuda.bindings", None)  # as if cuda-python were not installed
    assert loadtest.PinnedReadback.open(region, 8) is None


@pytest.mark.parametrize("engine", ["auto", "inprocess"])
def test_http_and_grpc_open_loop_mixed_batches_through_system_shared_memory(shape3, install, engine):
    from kkdeploy.commands.loadtest import local_server

    runner = kkdeploy.load(shape3)
    args = types.SimpleNamespace(artifacts=str(shape3), model_name="kkdeploy", engine=engine, topology="auto",
                                 instances=1, max_queue_delay_us=200, host="127.0.0.1")
    ports = triton_server.free_ports()
    with local_server(args, ports) as (server, info, _):
        # payloads preloaded into the regions (the default), and written by each request (preload 0)
        for protocol, shm, client, preload in (("http", "system", "lean", 1024), ("grpc", "system", "lean", 1024),
                                               ("grpc", "system", "tritonclient", 1024), ("http", "none", "lean", 0),
                                               ("grpc", "none", "native", 0), ("grpc", "system", "native", 1024),
                                               ("grpc", "system", "lean", 0), ("http", "system", "tritonclient", 0)):
            p = loadtest.LoadPlan(model="kkdeploy", seq_len=128, d_model=128, dtype="float32", protocol=protocol,
                                  http_port=ports["http"], grpc_port=ports["grpc"], metrics_port=ports["metrics"],
                                  processes=1, concurrency=3, rate=40.0, requests=30, warmup=1,
                                  mix=[[1, 0.5], [2, 0.3], [3, 0.2]], padding=[0.0, 0.25], pool=8, seed=3,
                                  shared_memory=shm, client=client, preload_mb=preload)
            answers = loadtest.expected_answers(runner, loadtest.make_pool(p))
            summary = loadtest.run_load(p, answers)
            assert summary["loop"] == "open"
            assert (summary["answered"], summary["bitwise_equal"], summary["errors"]) == (30, 30, 0), \
                (protocol, shm, client, preload, summary["first_errors"])
            assert set(summary["latency_ms_by_batch"]) <= {"1", "2", "3"}
            assert (summary["rpc_floor_ms"] is None) == (protocol == "http")
    assert not list(Path("/dev/shm").glob("kkdeploy_lt_*"))  # every client region destroyed


def test_native_client_answers_are_grpcios_bytes(shape3, install):
    """The same request bytes through grpcio and through our HTTP/2 client, to a real tritonserver: the same answer
    bytes (batch 1, and batch 4, whose 256 KB each way outgrow HTTP/2's default window and frame), the same status
    and words for an unknown model and a wrong shape, and the connection still serves after them."""
    import grpc
    from tritonclient.grpc import service_pb2

    from kkdeploy.commands.loadtest import local_server
    from kkdeploy.serving.native_client import GrpcCallError, GrpcH2c

    args = types.SimpleNamespace(artifacts=str(shape3), model_name="kkdeploy", engine="python", topology="auto",
                                 instances=1, max_queue_delay_us=0, host="127.0.0.1")
    ports = triton_server.free_ports()

    def request(model="kkdeploy", batch=4, shape=None) -> bytes:
        message = service_pb2.ModelInferRequest(model_name=model)
        x = np.random.default_rng(batch).standard_normal((batch, 128, 128)).astype(np.float32)
        tensor = message.inputs.add(name="x", datatype="FP32")
        tensor.shape.extend(shape or x.shape)
        message.raw_input_contents.append(x.tobytes())
        message.outputs.add(name="y")
        return message.SerializeToString()

    with local_server(args, ports) as _:
        channel = grpc.insecure_channel(f"127.0.0.1:{ports['grpc']}", options=[
            ("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)])
        rpc = channel.unary_unary(loadtest.MODEL_INFER)
        native = GrpcH2c("127.0.0.1", ports["grpc"])
        path = loadtest.MODEL_INFER.encode()
        for body in (request(batch=4), request(batch=1), request(batch=4)):
            assert native.unary(path, body, 30.0) == rpc(body, timeout=30.0)
        for body in (request(model="nope"), request(shape=[4, 128, 127])):
            with pytest.raises(grpc.RpcError) as theirs:
                rpc(body, timeout=30.0)
            with pytest.raises(GrpcCallError) as ours:
                native.unary(path, body, 30.0)
            assert (ours.value.code, ours.value.details) == (theirs.value.code().name, theirs.value.details())
        assert native.unary(path, request(batch=1), 30.0) == rpc(request(batch=1), timeout=30.0)
        assert native.unary(loadtest.SERVER_LIVE.encode(), b"", 5.0) == b"\x08\x01"  # ServerLiveResponse(live=True)
        native.close()
        channel.close()


def test_kkdeploy_run_serves_a_bucketed_artifact(shape3, capsys):
    """A build with --batch-buckets loads as a bucketed runner; `kkdeploy run` checks it as any artifact (it once
    stopped on a stack trace: the bucketed runner had no ``fallback``)."""
    assert cli(["run", "--artifacts", str(shape3), "--repeats", "2"]) == 0
    assert "strict: PASS failed 0/" in capsys.readouterr().out


def test_auto_client_falls_back_to_grpcio_where_the_native_one_cannot_be_built(shape3, install):
    """``--client auto`` without a C++ compiler: grpcio's lean client, saying why, and the load still runs."""
    import os

    env = dict(os.environ, CXX="no-such-compiler")
    done = subprocess.run([sys.executable, "-m", "kkdeploy", "loadtest", "--artifacts", str(shape3), "--serve",
                           "--processes", "1", "--concurrency", "1", "--requests", "10", "--no-check"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    said = " ".join(done.stdout.split())
    assert "gRPC client: lean (the native client cannot run here:" in said and "no-such-compiler" in said


def test_loadtest_bad_input_is_one_line(shape3, tmp_path):
    done = subprocess.run([sys.executable, "-m", "kkdeploy", "loadtest", "--artifacts", str(shape3), "--mix", "8",
                           "--no-check"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "at most 4" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr
    port = triton_server.free_port()  # nothing listens there: said at once, not after gRPC's minute of retries
    done = subprocess.run([sys.executable, "-m", "kkdeploy", "loadtest", "--artifacts", str(shape3), "--no-check",
                           "--grpc-port", str(port), "--metrics-port", str(port)], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2 and f"nothing answers on 127.0.0.1:{port}" in done.stderr
    assert "Traceback" not in done.stderr
    (tmp_path / "a-file").write_text("")
    for extra, said in ((["--out", str(tmp_path / "o"), "--json", str(tmp_path / "j.json")], "--json: not allowed with argument --out"),
                        (["--out", str(tmp_path / "a-file")], "is a file; give a folder")):
        done = subprocess.run([sys.executable, "-m", "kkdeploy", "loadtest", "--artifacts", str(shape3), *extra],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 2 and said in done.stderr and len(done.stderr.strip().splitlines()) == 1


def test_kubernetes_manifests_match_the_kubernetes_schemas(shape3, tmp_path):
    from kkdeploy.serving import kubernetes

    assert cli(["triton-repo", "--artifacts", str(shape3), "--out", str(tmp_path / "repo"), "--kubernetes"]) == 0
    folder = tmp_path / "repo" / "kubernetes"
    checked = kubernetes.check_manifests(folder)  # strict: an unknown field fails
    assert [c.split(": ")[1].split("/")[0] for c in checked] == ["Deployment", "HorizontalPodAutoscaler", "ConfigMap",
                                                                 "Service"]
    import yaml

    deployment = yaml.safe_load((folder / "deployment.yaml").read_text())
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["readinessProbe"]["httpGet"]["path"] == "/v2/models/kkdeploy/ready"
    assert container["livenessProbe"]["httpGet"]["path"] == "/v2/health/live"
    hpa = yaml.safe_load((folder / "hpa.yaml").read_text())
    assert hpa["spec"]["metrics"][0]["pods"]["metric"]["name"] == kubernetes.QUEUE_METRIC
    rules = yaml.safe_load(yaml.safe_load((folder / "prometheus-adapter-rules.yaml").read_text())["data"]["config.yaml"])
    assert "nv_inference_queue_duration_us" in rules["rules"][0]["metricsQuery"]
    # A typo is caught by the schema, with a one-line error.
    deployment["spec"]["template"]["spec"]["containers"][0]["readinessProbes"] = container.pop("readinessProbe")
    (folder / "deployment.yaml").write_text(yaml.safe_dump(deployment))
    with pytest.raises(KKError, match="does not match the Kubernetes"):
        kubernetes.check_manifests(folder)


def test_stage_clock_pushes_at_most_every_interval_and_on_close():
    from kkdeploy.serving.triton_model import StageClock

    pushed: list[dict] = []
    clock = StageClock(pushed.append, interval_s=0.3)
    clock.record(1000, 2000, 3000, bucket=4, real=3)
    assert pushed == []  # not yet: the interval has not passed
    time.sleep(0.35)
    clock.record(1000, 1000, 1000, bucket=1, real=1)
    assert len(pushed) == 1
    assert pushed[0][("executions", "4")] == 1 and pushed[0][("executions", "1")] == 1
    assert pushed[0][("rows", "real")] == 4 and pushed[0][("rows", "padding")] == 1
    assert pushed[0][("stage_us", "engine")] == 3.0
    clock.record(5000, 0, 0, bucket=1, real=1)
    clock.close()  # the model unloads: nothing more is pushed (a push is a round trip the server may not answer)
    time.sleep(0.35)
    clock.record(1000, 1000, 1000, bucket=1, real=1)
    assert len(pushed) == 1
    background = StageClock(pushed.append, interval_s=0.1, background=True)
    background.record(1, 1, 1, bucket=2, real=2)
    time.sleep(0.4)  # no more traffic: the background thread pushes it
    assert pushed[-1][("executions", "2")] == 1
    background.close()


def test_stage_clock_never_holds_its_lock_across_a_push():
    # The stub deadlocked once: the background thread held the counters' lock while its push waited for a server
    # that was unloading the model, and finalize() waited for that lock. Now a push blocks no one.
    import threading

    from kkdeploy.serving.triton_model import StageClock

    entered, release = threading.Event(), threading.Event()

    def stuck_sink(totals):
        entered.set()
        release.wait(10)  # a server that does not answer

    clock = StageClock(stuck_sink, interval_s=0.05, background=True)
    clock.record(1, 1, 1, bucket=1, real=1)
    assert entered.wait(5)  # the background thread is inside the push
    began = time.monotonic()
    clock.record(1, 1, 1, bucket=1, real=1)  # a request's own bookkeeping does not wait for it
    clock.close()  # nor does finalize()
    assert time.monotonic() - began < 1.0
    release.set()


def test_expected_answers_hold_both_mask_routes_of_a_bucket():
    """A payload without padding may reach a bucket gathered with other valid rows only (the engine's all-valid
    route) or beside padding rows (the padded route); an engine may answer the two in different bits (the PyTorch
    fallback on the CPU does, with trained-like weights), and both were validated: both are expected."""
    from kkdeploy.pipeline.runtime import BucketedRunner

    class Engine:  # row-independent; each bucket and each route its own answer
        backend, reason = "fake", "test"
        fallback = torch.nn.Linear(1, 1)

        def __init__(self, size):
            self.size = size

        def __call__(self, x, mask):
            return x * (10.0 * self.size + (1.0 if bool(mask.all()) else 0.0))

    runner = BucketedRunner({1: Engine(1), 2: Engine(2)})
    p = plan(mix=[[1, 1.0]], padding=[0.0, 0.25], pool=2)
    pool = loadtest.make_pool(p)
    answers = loadtest.expected_answers(runner, pool)
    unpadded, padded = answers
    assert len(unpadded[1]) == 1 and len(unpadded[2]) == 2  # bucket 2: beside padding, or beside a valid row
    assert len(padded[2]) == 1  # a padded payload makes the batch padded wherever it goes
    x = torch.from_numpy(pool[0][0])
    gathered = runner.run_bucket(2, torch.cat([x, x * 0.5]), torch.ones(2, x.shape[1], dtype=torch.bool))[:1]
    assert loadtest.answered_by(unpadded, loadtest.fingerprint(gathered.numpy().tobytes())) == 2
    assert loadtest.answered_by(unpadded, "not an answer") is None


def test_a_load_is_set_against_the_engine_alone():
    direct = {"1": {"median_ms": 0.13, "seq_per_s": 7692.3}, "2": {"median_ms": 0.14, "seq_per_s": 14285.7},
              "4": {"median_ms": 0.16, "seq_per_s": 25000.0}}
    one = {"plan": {"mix": [[1, 1.0]]}, "seq_per_s": 800.0, "latency_ms": {"p50": 0.55}}
    a = loadtest.against_engine(one, direct)
    assert a["largest_bucket"] == 4 and a["fraction_of_engine"] == 0.032 and a["bucket"] == 1
    assert a["engine_ms"] == 0.13 and a["p50_over_engine_ms"] == 0.42  # above the engine at the bucket it ran on
    three = {"plan": {"mix": [[3, 1.0]]}, "seq_per_s": 15000.0, "latency_ms": {"p50": 16.0}}
    assert loadtest.against_engine(three, direct)["bucket"] == 4  # the smallest bucket holding 3 sequences
    assert loadtest.against_engine(three, direct)["fraction_of_engine"] == 0.6
    mixed = {"plan": {"mix": [[1, 0.5], [4, 0.5]]}, "seq_per_s": 5000.0, "latency_ms": {"p50": 3.0}}
    assert "p50_over_engine_ms" not in loadtest.against_engine(mixed, direct)  # no one engine latency to set it against
