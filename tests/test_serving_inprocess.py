"""kkdeploy's in-process Triton backend (`--engine inprocess`): the C++ library compiled here, its Python half driven
without a server through raw pointers as the C++ half drives it, and a real tritonserver serving it under load from
two client processes, every answer bit for bit the direct engine's."""

from __future__ import annotations

import ctypes
import json
import re
import shutil
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import numpy as np
import pytest
import torch

import kkdeploy
from kkdeploy.errors import KKError
from kkdeploy.pipeline.runtime import bucketed
from kkdeploy.serving import backend_build, cuda_driver, inprocess, loadtest, triton_server
from kkdeploy.serving.triton_repo import write_repository
from tests.conftest import HostDriver, build_serving_artifact, captured_bucket_engine

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> Path:
    return build_serving_artifact(tmp_path_factory.mktemp("inprocess") / "a", "--batch-buckets", "1,2")


@pytest.fixture(scope="module")
def repository(small, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("inprocess-repo") / "repo"
    info = write_repository(small, out, engine="inprocess",
                            parameters={"kkdeploy_release_dir": str(out.parent)})
    assert info.engine_backend == "kkdeploy" and info.topology == "one-hop" and info.buckets == [1, 2]
    return out


def test_the_library_is_built_once_and_exports_triton_s_entry_points(repository):
    library = backend_build.backend_library()
    assert library.is_file() and backend_build.backend_library() == library  # cached by its key
    copied = repository / "kkdeploy" / "1" / backend_build.LIBRARY_NAME
    assert copied.read_bytes() == library.read_bytes()
    nm = shutil.which("nm")
    if nm:
        symbols = subprocess.run([nm, "-D", "--defined-only", str(library)], capture_output=True, text=True).stdout
        exported = {line.split()[-1] for line in symbols.splitlines() if " T " in line}
        assert exported == {"TRITONBACKEND_Initialize", "TRITONBACKEND_ModelInitialize", "TRITONBACKEND_ModelFinalize",
                            "TRITONBACKEND_ModelInstanceInitialize", "TRITONBACKEND_ModelInstanceFinalize",
                            "TRITONBACKEND_ModelInstanceExecute"}


def test_the_repository_names_the_backend_and_refuses_two_hops(small, repository, tmp_path):
    config = (repository / "kkdeploy" / "config.pbtxt").read_text()
    assert 'backend: "kkdeploy"' in config and "max_batch_size: 2" in config
    assert "preferred_batch_size: [ 1, 2 ]" in config and "FORCE_CPU_ONLY_INPUT_TENSORS" not in config
    assert not (repository / "kkdeploy" / "1" / "model.py").exists()  # no Python-backend model
    assert (repository / "kkdeploy" / "1" / "artifacts" / "manifest.json").is_file()
    readme = (repository / "README.md").read_text()
    assert "in-process backend" in readme and sys.executable in readme
    assert "KKDEPLOY_SITE_DIRS=" in readme  # how to start it by hand with this Python's site directories
    with pytest.raises(KKError, match="--engine inprocess is a one-hop model"):
        write_repository(small, tmp_path / "r", engine="inprocess", topology="two-hop")
    with pytest.raises(KKError, match="--kubernetes with --engine inprocess: .* use --engine python"):
        write_repository(small, tmp_path / "r", engine="inprocess", kubernetes=True)
    assert not (tmp_path / "r").exists()


def _described(array: np.ndarray):
    """An input as the C++ half describes it: (shape, [(pointer, bytes, memory type, id)])."""
    return tuple(array.shape), [(array.ctypes.data, array.nbytes, inprocess.MEMORY_CPU, 0)]


def test_the_python_half_answers_through_pointers_as_the_engine_does(small, repository):
    """What ``TRITONBACKEND_ModelInstanceExecute`` does, without a server: inputs handed over as pointers into host
    memory (not copied), one execution of three requests, each answer read where the outcome points; a request past
    the largest bucket is the caller's error (INVALID_ARG); finalize leaves the release marker."""
    config = json.loads(json.dumps(_config_json(repository)))
    model = inprocess.Model(json.dumps(config), str(repository / "kkdeploy"), 1)
    assert model.output_datatype == "FP32" and model.max_batch == 2
    instance = model.instance("kkdeploy_0_0", "CPU", 0)
    rng = np.random.default_rng(0)
    x1 = rng.standard_normal((1, 8, 16)).astype(np.float32)
    x2 = rng.standard_normal((1, 8, 16)).astype(np.float32)
    mask2 = np.ones((1, 8), dtype=bool)
    mask2[0, 6:] = False
    x3 = rng.standard_normal((3, 8, 16)).astype(np.float32)
    outcomes, runs = instance.execute([(_described(x1), None), (_described(x2), _described(mask2)),
                                       (_described(x3), None)])
    direct = bucketed(kkdeploy.load(small))
    with torch.inference_mode():
        x = torch.from_numpy(np.concatenate([x1, x2]))
        mask = torch.from_numpy(np.concatenate([np.ones((1, 8), dtype=bool), mask2]))
        expected = direct.run_bucket(2, x, mask).numpy()
    for i, want in enumerate((expected[:1], expected[1:])):
        shape, pointer, nbytes, on_host = outcomes[i]
        assert shape == (1, 8, 16) and on_host and nbytes == want.nbytes
        got = np.frombuffer((np.ctypeslib.ctypes.c_char * nbytes).from_address(pointer), dtype=np.float32)
        assert got.tobytes() == want.tobytes()  # bit for bit the engine's bucket-2 answer
    code, message = outcomes[2]
    assert code == inprocess.ERROR_INVALID_ARG and "3" in message
    # (…, bucket, real rows): the run that answered; the refused request ran none
    assert len(runs) == 1 and runs[0][3:] == (2, 2)
    # copy_out: an answer into a response buffer (here host memory: the path the C++ half takes for GPU memory)
    target = np.zeros((1, 8, 16), dtype=np.float32)
    instance.copy_out([(1, target.ctypes.data, target.nbytes, inprocess.MEMORY_CPU, 0)])
    assert target.tobytes() == expected[1:].tobytes()
    # a buffer that does not hold its shape (Triton checks sizes first; this half still refuses it alone)
    outcomes, runs = instance.execute([(((1, 8, 16), [(x1.ctypes.data, 100, inprocess.MEMORY_CPU, 0)]), None)])
    assert outcomes[0][0] == inprocess.ERROR_INTERNAL and "RuntimeError" in outcomes[0][1] and runs == []
    outcomes, runs = instance.execute([(None, None), (_described(x1), None)])  # no x at all, then a good request
    assert outcomes[0] == (inprocess.ERROR_INVALID_ARG, "kkdeploy: ValueError: the request has no input 'x'")
    assert outcomes[1][0] == (1, 8, 16) and runs[0][3:] == (1, 1)
    instance.finalize()
    assert (repository.parent / f"kkdeploy.{__import__('os').getpid()}").is_file()


def _config_json(repository: Path) -> dict:
    """The model config as Triton hands it to a backend (the fields the Python half reads)."""
    text = (repository / "kkdeploy" / "config.pbtxt").read_text()
    params = dict(__import__("re").findall(r'key: "(\w+)" value: \{ string_value: "([^"]*)" \}', text))
    return {"name": "kkdeploy", "max_batch_size": 2,
            "input": [{"name": "x", "data_type": "TYPE_FP32", "dims": ["8", "16"]},
                      {"name": "valid_token_mask", "data_type": "TYPE_BOOL", "dims": ["8"], "optional": True}],
            "output": [{"name": "y", "data_type": "TYPE_FP32", "dims": ["8", "16"]}],
            "parameters": {k: {"string_value": v} for k, v in params.items()}}


def test_batch1_grpc_from_two_processes_in_process_every_answer_exact(small, tmp_path):
    triton_server.find_server() or triton_server.install_server()
    out = tmp_path / "lt" / "loadtest.json"  # --out: a folder, as build and bench take
    done = subprocess.run([sys.executable, "-m", "kkdeploy", "loadtest", "--artifacts", str(small), "--serve",
                           "--engine", "inprocess", "--protocol", "grpc", "--processes", "2", "--concurrency", "4",
                           "--requests", "400", "--mix", "1:0.7,2:0.3", "--padding", "0,0.25", "--pool", "16",
                           "--direct", "--out", str(out.parent)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert out.with_suffix(".png").is_file()
    assert "in-process" in done.stdout
    (run,) = json.loads(out.read_text())["runs"]
    assert run["requests"] == run["answered"] == run["bitwise_equal"] == 400
    assert run["errors"] == run["wrong"] == run["warmup_wrong"] == 0
    server = run["server"]
    assert server["requests"] == 400 and set(server["runs_by_bucket"]) <= {"1", "2"}
    assert server["runs_by_bucket"]  # the backend's own metrics reach /metrics (kkdeploy_bucket_executions_total)
    assert server["engine_us_per_run"] > 0 and server["compute_infer_duration_us_per_request"] > 0
    assert server["executions"] > 0 and server["engine_runs"] == server["executions"]
    assert server["executions_by_route"] == {"python": server["executions"]}  # a CPU engine: no native route
    against = run["against_engine"]  # --direct: the load set against the engine alone, in the same process
    assert against["largest_bucket"] == 2 and 0 < against["fraction_of_engine"]
    assert "p50_over_engine_ms" not in against  # a mix of batch sizes has no one engine latency
    assert "Against the engine alone" in done.stdout


def test_what_the_build_needs_is_a_one_line_error_naming_the_fix(monkeypatch, tmp_path):
    """No compiler, a Python without a shared libpython, a compile that fails: each a KKError that names the fix
    (or --engine python), and no library is left half-written in the cache."""
    import sysconfig

    monkeypatch.setenv("KKDEPLOY_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("CXX", "/nonexistent/g++")
    with pytest.raises(KKError, match="in-process Triton backend needs a C\\+\\+17 compiler .* set CXX; or serve with "
                                      "--engine python"):
        backend_build.backend_library()
    monkeypatch.undo()
    monkeypatch.setenv("KKDEPLOY_CACHE_DIR", str(tmp_path / "cache"))
    real = sysconfig.get_config_var
    monkeypatch.setattr(sysconfig, "get_config_var", lambda name: 0 if name == "Py_ENABLE_SHARED" else real(name))
    with pytest.raises(KKError, match="without a shared libpython, which kkdeploy's in-process Triton backend embeds"):
        backend_build.backend_library()
    monkeypatch.undo()
    monkeypatch.setenv("KKDEPLOY_CACHE_DIR", str(tmp_path / "cache"))
    broken = tmp_path / "broken.cc"
    broken.write_text("this is not C++;\n")
    monkeypatch.setattr(backend_build, "SOURCES", [broken, *backend_build.SOURCES[1:]])
    with pytest.raises(KKError, match="compiling kkdeploy.s in-process Triton backend failed: .*error.*"
                                      "--engine python"):
        backend_build.backend_library()
    assert not list((tmp_path / "cache").rglob("*.so")) and not list((tmp_path / "cache").rglob("*.tmp"))


def test_a_server_without_pythonhome_still_finds_the_interpreter_s_home(repository, tmp_path):
    """A Triton install other than the bundled one gets no PYTHONHOME from `kkdeploy serve`: the backend names the
    home and the executable of the Python it was built for, and the model loads."""
    import os
    import time
    import urllib.request

    install = triton_server.find_server() or triton_server.install_server()
    ports = triton_server.free_ports()
    server = triton_server.TritonServer(install, repository, tmp_path / "work",
                                        **{f"{k}_port": v for k, v in ports.items()})
    env = server.environment()
    env.pop("PYTHONHOME", None)
    server.workdir.mkdir(parents=True)
    log = tmp_path / "log.txt"
    with open(log, "wb") as out:
        proc = subprocess.Popen(server.command(server.backend_directory()), env=env, stdout=out,
                                stderr=subprocess.STDOUT)
    try:
        ready = False
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None and not ready:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{ports['http']}/v2/health/ready", timeout=1) as r:
                    ready = r.status == 200
            except OSError:
                time.sleep(0.2)
        assert ready, log.read_text()[-2000:]
        # the embedded interpreter is this one: the executable torch would start its compile workers with
        assert f"in-process on cpu (Python {sys.version.split()[0]}, {sys.executable})" in log.read_text()
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_the_server_s_python_finds_the_running_source_tree_without_an_install(repository, tmp_path):
    """The embedded interpreter has no current directory on sys.path: run from a source checkout whose install is
    absent or points elsewhere, it failed to import kkdeploy.serving.inprocess. `kkdeploy serve` now names the folder
    holding the running kkdeploy (and engines/, validation/) last among the site directories it passes."""
    import os

    root = Path(kkdeploy.__file__).resolve().parents[1]
    dirs = triton_server._site_dirs()
    assert dirs[-1] == str(root) and dirs.count(str(root)) == 1
    assert all((root / package / "__init__.py").is_file() for package in ("kkdeploy", "engines", "validation"))
    install = triton_server.find_server() or triton_server.install_server()
    server = triton_server.TritonServer(install, repository, tmp_path / "work",
                                        **{f"{k}_port": v for k, v in triton_server.free_ports().items()})
    assert str(root) in server.environment()[triton_server.ENV_SITE_DIRS].split(os.pathsep)


def test_a_model_reloaded_in_process_answers_exactly_again(small, repository, tmp_path):
    """The watchdog heals a broken model by unloading and loading it: in process, that finalizes the instance
    and loads a new engine in the same interpreter. Three reloads, every answer exact after each."""
    install = triton_server.find_server() or triton_server.install_server()
    ports = triton_server.free_ports()
    plan = loadtest.LoadPlan(model="kkdeploy", seq_len=8, d_model=16, dtype="float32", grpc_port=ports["grpc"],
                             http_port=ports["http"], mix=[[1, 1.0], [2, 1.0]], padding=[0.0, 0.25], pool=6, seed=9)
    pool = loadtest.make_pool(plan)
    answers = loadtest.expected_answers(kkdeploy.load(small), pool)
    with triton_server.TritonServer(install, repository, tmp_path / "work",
                                    extra_args=["--model-control-mode=explicit", "--load-model=*"],
                                    **{f"{k}_port": v for k, v in ports.items()}) as server:
        server.wait_ready(120)
        client = loadtest.Client(plan, pool, {}, "reload")
        try:
            for attempt in range(4):
                if attempt:
                    assert server.reload("kkdeploy", 120), (server.last_load_error, server.log_text()[-3000:])
                exact = [loadtest.answered_by(answers[k], client.send(k)) is not None for k in range(len(pool))]
                assert all(exact), (attempt, exact)
            # a load Triton refuses says why, in Triton's words
            assert not server.load("no-such-model", 30)
            assert re.match(r"HTTP 5\d\d: failed to load 'no-such-model'", server.last_load_error), server.last_load_error
        finally:
            client.close()
    assert server.log_text().count("in-process on cpu") == 4  # one engine per load, in the one process


def test_the_gather_study_splits_a_request_s_time_on_the_cpu(small, tmp_path):
    """`scripts/serving_gather_study.py` (the GPU study of where a batch-1 request's gather goes) drives the
    in-process backend's Python half as Triton does and checks every route answers the same bits; here its
    plumbing on the CPU."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    import serving_gather_study

    out = tmp_path / "gather.json"
    assert serving_gather_study.main(["--artifacts", str(small), "--device", "cpu", "--rounds", "1", "--runs", "3",
                                      "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["bitwise_same_answers"] is True and result["runs_per_variant"] == 3
    assert set(result["medians_us"]) == {"mask sent, torch copies", "no mask, torch copies"}  # no direct route: CPU
    assert all(m["execute"] >= m["gather"] > 0 for m in result["medians_us"].values())


def test_the_host_wait_mode_of_the_shared_cuda_context_is_named():
    """``cuda_sync_mode`` reads the scheduling bits of the current context's flags (the in-process instance logs it,
    since tritonserver owns the context); a driver that is missing or refuses is said, never raised."""
    import ctypes

    class Driver:
        def __init__(self, flags: int, result: int = 0):
            self.flags, self.result = flags, result

        def cuCtxGetFlags(self, out):  # noqa: N802 - the driver's own name
            ctypes.cast(out, ctypes.POINTER(ctypes.c_uint)).contents.value = self.flags
            return self.result

    assert [cuda_driver.cuda_sync_mode(Driver(f)) for f in (0, 1, 2, 4)] == ["auto", "spin", "yield", "blocking-sync"]
    assert cuda_driver.cuda_sync_mode(Driver(0x4 | 0x8)) == "blocking-sync"  # other bits (map host) ignored
    assert cuda_driver.cuda_sync_mode(Driver(0, result=201)) == "unknown (cuCtxGetFlags returned CUresult 201)"
    assert cuda_driver.cuda_sync_mode(object()).startswith("unknown (AttributeError")
    assert cuda_driver.cuda_sync_mode().startswith(("unknown", "auto", "spin", "yield", "blocking-sync"))


def test_the_host_wait_mode_can_be_set_and_a_wrong_one_is_refused_before_anything_loads(monkeypatch):
    """``set_cuda_sync_mode`` writes the scheduling bits with ``cuCtxSetFlags``, keeping the context's other flags,
    and answers the mode read back; a driver that refuses leaves it unchanged and says so; a name that is no mode is
    a one-line error that lists the modes (``Instance`` checks it before it builds the engine)."""
    import ctypes

    class Driver:
        def __init__(self, flags: int, set_result: int = 0):
            self.flags, self.set_result, self.written = flags, set_result, []

        def cuCtxGetFlags(self, out):  # noqa: N802 - the driver's own name
            ctypes.cast(out, ctypes.POINTER(ctypes.c_uint)).contents.value = self.flags
            return 0

        def cuCtxSetFlags(self, flags):  # noqa: N802
            self.written.append(flags.value)
            if self.set_result == 0:
                self.flags = flags.value
            return self.set_result

    d = Driver(0x4 | 0x8)  # blocking sync, map host
    assert cuda_driver.set_cuda_sync_mode("spin", d) == "spin"
    assert d.written == [0x1 | 0x8]
    assert cuda_driver.set_cuda_sync_mode("auto", d) == "auto" and d.flags == 0x8
    refused = Driver(0x4, set_result=401)
    assert cuda_driver.set_cuda_sync_mode("spin", refused) == "unchanged (CUresult 401); blocking-sync"
    assert cuda_driver.set_cuda_sync_mode("spin", object()).startswith("unchanged (AttributeError")
    with pytest.raises(ValueError, match="is not a host-wait mode; use leave, auto, spin, yield, blocking-sync"):
        cuda_driver.set_cuda_sync_mode("busy", d)
    monkeypatch.setenv(cuda_driver.HOST_WAIT_ENV, "fast")
    with pytest.raises(ValueError, match="KKDEPLOY_HOST_WAIT='fast' is not a host-wait mode"):
        inprocess.Instance(types.SimpleNamespace(config={}, name="m"), "m_0", "GPU", 0)
    monkeypatch.delenv(cuda_driver.HOST_WAIT_ENV)
    assert cuda_driver.host_wait_wanted() == "leave"


def _request(x: np.ndarray, mask: np.ndarray | None, memory=inprocess.MEMORY_CPU):
    """A request as the C++ half describes it: ``((shape, buffers), mask or None)``, pointers into ``x``/``mask``."""
    described = (list(x.shape), [(x.ctypes.data, x.nbytes, memory, 0)])
    if mask is None:
        return (described, None)
    return (described, (list(mask.shape), [(mask.ctypes.data, mask.nbytes, memory, 0)]))


def test_the_direct_route_moves_the_same_bytes_as_torch_s_copies_and_waits_once():
    """``DirectRoute``: each request's rows land in the bucket's capture (padding rows zero, fully masked), the
    answer comes back into the bucket's host buffer in one copy, and the host waits once; the answers are those of
    ``BucketEngine.run`` on the same requests. Requests it cannot take (GPU memory, pieces, a wrong size, more rows
    than a run holds) are left to that route."""
    engine, captures = captured_bucket_engine()
    driver = HostDriver()
    route = inprocess.DirectRoute(engine, driver)
    a = np.arange(6, dtype=np.float32).reshape(1, 3, 2)
    b = np.full((2, 3, 2), 7.0, dtype=np.float32)
    mask_a = np.array([[True, True, False]])
    outcomes, kept, runs = route.execute([_request(a, mask_a), _request(b, None)], time.perf_counter_ns())
    x, mask = captures[4].replays[-1]
    assert torch.equal(x[:1], torch.from_numpy(a)) and torch.equal(x[1:3], torch.from_numpy(b)) and not x[3].any()
    assert torch.equal(mask, torch.tensor([[True, True, False], [True] * 3, [True] * 3, [False] * 3]))
    host = engine.host_outputs[4]
    assert [o[1:] for o in outcomes] == [(host.data_ptr(), 24, True), (host.data_ptr() + 24, 48, True)]
    assert [o[0] for o in outcomes] == [(1, 3, 2), (2, 3, 2)]
    expected, _, _, _, _ = captured_bucket_engine()[0].run([torch.from_numpy(a), torch.from_numpy(b)],
                                                     [torch.from_numpy(mask_a), None])
    assert all(torch.equal(kept[i], expected[i]) for i in range(2))
    assert driver.calls.count(("wait",)) == 1 and driver.calls[-1] == ("wait",)
    assert runs[0][3:] == (4, 3) and all(t >= 0 for t in runs[0][:3])
    # a full bucket of mask-less requests: the mask is written all True once, then left as it is
    full = np.ones((4, 3, 2), dtype=np.float32)
    driver.calls.clear()
    route.execute([_request(full, None)], 0)
    assert ("fill", 1, 12) in driver.calls and engine.static_all_true[4]
    driver.calls.clear()
    outcomes, kept, _ = route.execute([_request(full, None)], 0)
    assert not [c for c in driver.calls if c[0] == "fill"] and torch.equal(kept[0], 2 * torch.ones(4, 3, 2))
    # the other route pads the same capture's mask: the next all-valid run here must write it all True again
    engine.run([torch.ones(1, 3, 2)] * 2, [torch.from_numpy(mask_a), None])
    driver.calls.clear()
    outcomes, kept, _ = route.execute([_request(full, None)], 0)
    assert ("fill", 1, 12) in driver.calls and captures[4].replays[-1][1].all()
    assert torch.equal(kept[0], 2 * torch.ones(4, 3, 2))
    route.execute([_request(a, None)], 0)  # bucket 1, all valid
    assert torch.equal(captures[1].replays[-1][1], torch.ones(1, 3, dtype=torch.bool))
    # not for this route: the other one answers
    assert route.execute([_request(a, None, memory=inprocess.MEMORY_GPU)], 0) is None
    assert route.execute([_request(a, mask_a, memory=inprocess.MEMORY_GPU)], 0) is None
    pieces = ([1, 3, 2], [(a.ctypes.data, 12, 0, 0), (a.ctypes.data + 12, 12, 0, 0)])
    assert route.execute([(pieces, None)], 0) is None
    assert route.execute([(([1, 3, 2], [(a.ctypes.data, 20, 0, 0)]), None)], 0) is None  # bytes != shape
    assert route.execute([_request(np.zeros((1, 3, 3), np.float32), None)], 0) is None  # another row shape
    assert route.execute([_request(a, np.array([[True, True]]))], 0) is None  # a mask of another length
    assert route.execute([_request(full, None), _request(a, None)], 0) is None  # 5 rows: more than one run
    assert route.execute([None], 0) is None  # the C++ half refused it: the other route answers the error
    del engine.static[1]
    assert route.execute([_request(a, None)], 0) is None  # a bucket without a capture


def test_an_instance_takes_the_direct_route_and_answers_every_request_when_it_fails():
    engine, captures = captured_bucket_engine()
    instance = inprocess.Instance.__new__(inprocess.Instance)
    instance.model, instance.engine, instance.last = types.SimpleNamespace(name="m"), engine, {}
    instance.x_dtype, instance.mask_dtype, instance.engine_thread = torch.float32, torch.bool, threading.get_ident()
    instance.direct = inprocess.DirectRoute(engine, HostDriver())
    a = np.full((1, 3, 2), 3.0, dtype=np.float32)
    outcomes, runs = instance.execute([_request(a, None)])
    assert outcomes[0][1] == engine.host_outputs[1].data_ptr()
    assert torch.equal(instance.last[0], torch.from_numpy(2 * a))
    assert len(captures[1].replays) == 1
    pieces = ([1, 3, 2], [(a.ctypes.data, 12, 0, 0), (a.ctypes.data + 12, 12, 0, 0)])  # Triton's tensor in two
    outcomes, _ = instance.execute([(pieces, None)])  # pieces: not the direct route's; BucketEngine.run answers it
    assert outcomes[0][0] == (1, 3, 2) and len(captures[1].replays) == 2
    assert torch.equal(instance.last[0], torch.from_numpy(2 * a))

    class Broken(HostDriver):
        def wait(self, stream):
            raise RuntimeError("cuStreamSynchronize failed with CUresult 700")

    instance.direct = inprocess.DirectRoute(engine, Broken())
    outcomes, runs = instance.execute([_request(a, None), _request(a, None)])
    assert runs == [] and instance.last == {}
    assert outcomes == [(inprocess.ERROR_INTERNAL, "m: RuntimeError: cuStreamSynchronize failed with CUresult 700")] * 2


def test_the_serving_study_serves_each_variant_with_every_plan_and_refuses_a_wrong_one(capsys):
    """``scripts/serving_h200.py --variants``: a variant's words in a layout's label never drop its mixed and
    shared-memory runs (a host-wait mode once did, and then more instances); a route, a mode or a client that does
    not exist is a usage error."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    import serving_h200

    for label in ("one-hop, in-process, host waits spin, static inputs", "one-hop, in-process, torch copies",
                  "one-hop, in-process, direct route in Python, host waits spin, static inputs",
                  "one-hop, in-process, torch copies, host waits blocking-sync, static inputs", "one-hop",
                  "one-hop, in-process, 2 instances, static inputs"):
        assert serving_h200.measures_all(label), label
    for label in ("one-hop, GPU outputs", "two-hop", "one-hop, in-process, GPU outputs, host waits spin",
                  "two-hop, 2 instances"):
        assert not serving_h200.measures_all(label), label
    for wrong, said in (("direct+fast", "not a host-wait mode"), ("tcp", "the route is native, direct or copies")):
        with pytest.raises(SystemExit):
            serving_h200.main(["--variants", wrong])
        assert said in capsys.readouterr().err
    with pytest.raises(SystemExit):
        serving_h200.main(["--client", "lean,curl"])
    assert "lean, native or tritonclient" in capsys.readouterr().err
    # CUDA shared-memory plans run only where tritonclient's CUDA support imports; elsewhere the reason is recorded
    try:
        import cuda.bindings.runtime  # noqa: F401
    except ImportError:
        assert serving_h200.cuda_shared_memory_missing().startswith("tritonclient's CUDA shared memory cannot be")


def test_the_serving_study_draws_one_chart_per_layout(tmp_path):
    """``scripts/serving_h200.py``'s charts: one picture per shape and server layout, skipped runs left out."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    import serving_h200

    def run(name, layout):
        return {"name": name, "topology": layout, "loop": "closed", "latency_ms": {"mean": 0.6},
                "latency_cdf_ms": [0.3 + k / 200 for k in range(101)], "latency_ms_by_batch": {"1": {}},
                "plan": dict(protocol="grpc", concurrency=1, rate=None, client="native", shared_memory="none"),
                "server": {"request_duration_us_per_request": 300.0, "queue_duration_us_per_request": 50.0}}

    results = {"shapes": {"3": {"direct": {"1": {"median_ms": 0.15}}, "runs": [
        run("batch-1 c=1, lean client", "one-hop, in-process"), run("batch-1 c=1, native client", "one-hop, in-process"),
        {"name": "saturation", "topology": "one-hop, in-process", "skipped": "out of budget"},
        run("batch-1 c=1", "one-hop")]}}}
    serving_h200.charts(tmp_path, results)
    assert sorted(p.name for p in tmp_path.glob("*.png")) == ["serving-h200-3-1.png", "serving-h200-3-2.png"]


def test_the_driver_checks_every_call_and_makes_none_for_nothing():
    """``cuda_driver.Driver`` on a stand-in library: each call passes its arguments through, a non-zero CUresult is
    raised with the call's name, and a copy or fill of zero bytes calls nothing."""
    class Lib:
        def __init__(self):
            self.calls, self.result = [], 0

        def __getattr__(self, name):
            def call(*args):
                self.calls.append((name, *args))
                return self.result
            return call

    lib = Lib()
    driver = cuda_driver.Driver(lib)
    driver.to_device(0x1000, 0x2000, 64, 7)
    driver.to_host(0x3000, 0x1000, 32, 7)
    driver.fill(0x1000, 1, 16, 7)
    driver.wait(7)
    for nothing in (driver.to_device, driver.to_host):
        nothing(0x1000, 0x2000, 0, 7)
    driver.fill(0x1000, 0, 0, 7)
    assert lib.calls == [("cuMemcpyHtoDAsync_v2", 0x1000, 0x2000, 64, 7),
                         ("cuMemcpyDtoHAsync_v2", 0x3000, 0x1000, 32, 7),
                         ("cuMemsetD8Async", 0x1000, 1, 16, 7), ("cuStreamSynchronize", 7)]
    lib.result = 700
    with pytest.raises(RuntimeError, match="^cuMemcpyHtoDAsync failed with CUresult 700$"):
        driver.to_device(0x1000, 0x2000, 64, 7)
    with pytest.raises(RuntimeError, match="^cuStreamSynchronize failed with CUresult 700$"):
        driver.wait(7)


def _native_server(repository: Path, work: Path, monkeypatch, **env: str):
    """A real tritonserver serving ``repository`` in process, its instances on the CPU stand-in for a CUDA engine and
    driver (tests/native_standin: bucket 1 launchable by the native route, bucket 2 not), with ``env`` set."""
    standin = Path(__file__).parent / "native_standin"
    stub = work / "libkk_stub_cuda.so"
    if not stub.is_file():
        work.mkdir(parents=True, exist_ok=True)
        subprocess.run([shutil.which("cc") or "gcc", "-shared", "-fPIC", "-O1", "-o", str(stub),
                        str(standin / "stub_cuda.c")], check=True)
    import os

    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(standin), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("KKDEPLOY_NATIVE_STANDIN", "1")
    monkeypatch.setenv("KKDEPLOY_CUDA_DRIVER", str(stub))
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    install = triton_server.find_server() or triton_server.install_server()
    ports = triton_server.free_ports()
    server = triton_server.TritonServer(install, repository, work / f"server-{len(list(work.iterdir()))}",
                                        **{f"{k}_port": v for k, v in ports.items()})
    return server, ports


def _native_cases(ports: dict):
    """Send three requests: 1 row, 1 row with a padded mask (bucket 1: the native route's), 2 rows with a mask
    (bucket 2: Python's); ``[(x, mask, answer or the error's text)]``."""
    import tritonclient.grpc as grpcclient

    rng = np.random.default_rng(5)
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{ports['grpc']}")
    out = []
    try:
        for rows, padded in ((1, False), (1, True), (2, True)):
            x = rng.standard_normal((rows, 8, 16)).astype(np.float32)
            mask = np.ones((rows, 8), dtype=bool)
            if padded:
                mask[:, 5:] = False
            inputs = [grpcclient.InferInput("x", list(x.shape), "FP32"),
                      grpcclient.InferInput("valid_token_mask", list(mask.shape), "BOOL")][:2 if padded else 1]
            inputs[0].set_data_from_numpy(x)
            if padded:
                inputs[1].set_data_from_numpy(mask)
            try:
                answer = client.infer("kkdeploy", inputs).as_numpy("y")
            except Exception as exc:  # noqa: BLE001 - the error is what the test reads
                answer = str(exc)
            out.append((x, mask, answer))
    finally:
        client.close()
    return out


def test_the_native_route_serves_in_cpp_and_leaves_the_rest_to_python(repository, tmp_path, monkeypatch):
    """The C++ half's native route in a real tritonserver, on the CPU stand-in for a CUDA engine and driver: it
    gathers a request's rows into the bucket's staging, pads and masks the bucket, launches the graph, copies the
    answer back and answers, with the GIL untouched; a run whose bucket has no launchable graph goes to Python's
    route; both routes' answers are 2 * x * mask, exact, with the host copies split over threads (a 64-byte chunk:
    each 512-byte row in 8 pieces, the mask's bytes in the last one, on the instance's helper threads) as with the
    default chunk. A launch that fails answers that execution with the call's name and code; a driver library that
    cannot be opened leaves every run to Python, and says so."""
    log, calls = tmp_path / "routes.log", tmp_path / "calls.log"
    server, ports = _native_server(repository, tmp_path / "work", monkeypatch, KKDEPLOY_STANDIN_LOG=str(log),
                                   KKDEPLOY_NATIVE_COPY_CHUNK="64", KKDEPLOY_STUB_CALL_LOG=str(calls))
    with server:
        server.wait_ready(120)
        calls.write_text("")
        cases = _native_cases(ports)
        metrics = urllib_get(f"http://127.0.0.1:{ports['metrics']}/metrics")
    # host requests: one copy to the device for the rows (and one for a mask), one back; the 2-row run is Python's
    assert calls.read_text().split("\n")[:-1] == ["HtoD 512", "DtoH 512", "HtoD 512", "HtoD 8", "DtoH 512"]
    for x, mask, answer in cases:
        assert isinstance(answer, np.ndarray), answer
        assert np.array_equal(answer, x * 2 * mask[..., None])
    # the native route ran the two 1-row requests (the second padded to 5 valid tokens), Python the 2-row one
    assert log.read_text().split("\n")[-4:-1] == ["native 1 8", "native 1 5", "python 2 10"]
    assert "native route (C++)" in server.log_text()
    assert re.search(r'kkdeploy_bucket_executions_total\{bucket="1",model="kkdeploy"\} 2', metrics), metrics
    assert re.search(r'kkdeploy_rows_total\{kind="real",model="kkdeploy"\} 4', metrics), metrics
    assert re.search(r'kkdeploy_route_executions_total\{model="kkdeploy",route="native"\} 2', metrics), metrics
    assert re.search(r'kkdeploy_route_executions_total\{model="kkdeploy",route="python"\} 1', metrics), metrics

    server, ports = _native_server(repository, tmp_path / "work", monkeypatch, KKDEPLOY_STUB_LAUNCH_RESULT="700")
    with server:
        server.wait_ready(120)
        (_, _, first), (_, _, second), (x, mask, third) = _native_cases(ports)
    for failed in (first, second):
        assert isinstance(failed, str) and "kkdeploy: native route: cuGraphLaunch failed with CUresult 700" in failed
    assert np.array_equal(third, x * 2 * mask[..., None])  # Python's route, unaffected

    monkeypatch.delenv("KKDEPLOY_STUB_LAUNCH_RESULT")
    monkeypatch.delenv("KKDEPLOY_NATIVE_COPY_CHUNK")
    server, ports = _native_server(repository, tmp_path / "work", monkeypatch,
                                   KKDEPLOY_CUDA_DRIVER=str(tmp_path / "no-such-libcuda.so"))
    with server:
        server.wait_ready(120)
        cases = _native_cases(ports)
    assert all(np.array_equal(answer, x * 2 * mask[..., None]) for x, mask, answer in cases)
    assert "no native route: cannot open" in server.log_text()
    assert log.read_text().split("\n")[-4:-1] == ["python 1 8", "python 1 5", "python 2 10"]


def urllib_get(url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(url, timeout=10) as response:
        return response.read().decode()


def _pair(ports: dict, x0: np.ndarray, x1: np.ndarray, mask1: np.ndarray) -> list:
    """Two 1-row requests sent together (the server's batcher waits for the second: one execution of two requests;
    it batches requests with the same inputs only, so both carry a mask), the first all valid, the second
    ``mask1``; their answers, or the error's text."""
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(f"127.0.0.1:{ports['grpc']}")
    done: list = [None, None]
    event = [threading.Event(), threading.Event()]

    def answer(i):
        def callback(result, error):
            done[i] = str(error) if error is not None else result.as_numpy("y")
            event[i].set()
        return callback

    try:
        for i, (x, mask) in enumerate(((x0, np.ones_like(mask1)), (x1, mask1))):
            inputs = [grpcclient.InferInput("x", list(x.shape), "FP32"),
                      grpcclient.InferInput("valid_token_mask", list(mask.shape), "BOOL")]
            inputs[0].set_data_from_numpy(x)
            inputs[1].set_data_from_numpy(mask)
            client.async_infer("kkdeploy", inputs, answer(i))
        assert all(e.wait(60) for e in event)
    finally:
        client.close()
    return done


def test_the_native_route_copies_rows_and_answers_on_the_gpu_where_they_lie(small, tmp_path, monkeypatch):
    """Requests whose inputs lie on the instance's GPU (a client's CUDA shared-memory region) and answers into
    response buffers there take the native route, copied on the device: no host gather, no host round trip for the
    answer. On the CPU the stand-in driver takes host addresses for device pointers, and
    KKDEPLOY_STANDIN_DEVICE_MEMORY has the route take request and response buffers as device memory: every request
    (``all``), or every other request of an execution (``alternate``: one in host memory and one on the device in the
    same run, the host rows crossing in their own copy). The stub logs every copy, so the test reads which copies the
    route made, and the answers are exact. Inputs on another GPU (``other``) are Python's route's."""
    repository = tmp_path / "repo"
    write_repository(small, repository, engine="inprocess", max_queue_delay_us=2_000_000,
                     parameters={"kkdeploy_release_dir": str(tmp_path)})
    config = repository / "kkdeploy" / "config.pbtxt"  # a batch of 2 preferred alone: the batcher waits for the pair
    config.write_text(config.read_text().replace("preferred_batch_size: [ 1, 2 ]", "preferred_batch_size: [ 2 ]"))
    calls, routes = tmp_path / "calls.log", tmp_path / "routes.log"
    rng = np.random.default_rng(11)
    x = [rng.standard_normal((1, 8, 16)).astype(np.float32) for _ in range(4)]
    mask = np.ones((1, 8), dtype=bool)
    mask[:, 6:] = False
    row, mask_row = x[0].nbytes, mask.nbytes  # 512 and 8 bytes

    expected = {
        # rows and masks on the device, the answer to the host buffer (kept for host responses), the answers on the
        # device: nothing crosses from the host
        "all": [f"DtoD {row}", f"DtoD {mask_row}", f"DtoD {row}", f"DtoD {mask_row}", f"DtoH {2 * row}",
                f"DtoD {row}", f"DtoD {row}"],
        # the first request from the host (its rows and its mask through the staging buffers), the second on the
        # device; the first answer is copied on the host, the second on the device
        "alternate": [f"HtoD {row}", f"HtoD {mask_row}", f"DtoD {row}", f"DtoD {mask_row}", f"DtoH {2 * row}",
                      f"DtoD {row}"],
    }
    for i, (mode, copies) in enumerate(expected.items()):
        server, ports = _native_server(repository, tmp_path / "work", monkeypatch, KKDEPLOY_STANDIN_DEVICE_MEMORY=mode,
                                       KKDEPLOY_STUB_CALL_LOG=str(calls), KKDEPLOY_STANDIN_LOG=str(routes),
                                       KKDEPLOY_STANDIN_LAUNCHABLE="1,2")
        with server:
            server.wait_ready(120)
            calls.write_text("")
            first, second = _pair(ports, x[2 * i], x[2 * i + 1], mask)
        assert np.array_equal(first, 2 * x[2 * i]) and np.array_equal(second, 2 * x[2 * i + 1] * mask[..., None])
        assert routes.read_text().split("\n")[-2:-1] == ["native 2 14"], mode
        assert calls.read_text().split("\n")[:-1] == copies, mode
    # inputs on another GPU: the native route leaves the execution to Python's, which answers it
    server, ports = _native_server(repository, tmp_path / "work", monkeypatch, KKDEPLOY_STANDIN_DEVICE_MEMORY="other")
    with server:
        server.wait_ready(120)
        first, second = _pair(ports, x[0], x[1], mask)
    assert np.array_equal(first, 2 * x[0]) and np.array_equal(second, 2 * x[1] * mask[..., None])
    assert routes.read_text().split("\n")[-2:-1] == ["python 2 14"]


def test_the_native_plan_names_each_bucket_and_shares_the_captures_masks(monkeypatch, capsys):
    """``Instance._native_plan``: every bucket smallest first, with its capture's buffers and graph where it has one
    to launch (else zeros: Python's); the capture's mask is then written every run by both routes; refused by the
    C++ half or turned off, the instance is Python's alone again."""
    engine, captures = captured_bucket_engine((1, 2, 4), launchable=(2, 4))  # bucket 1: no graph to launch
    instance = inprocess.Instance.__new__(inprocess.Instance)
    instance.model, instance.name, instance.engine = types.SimpleNamespace(name="m"), "m_0", engine
    instance.stream = types.SimpleNamespace(cuda_stream=77)
    instance.direct = inprocess.DirectRoute(engine, HostDriver())
    plan = instance._native_plan()
    stream, seq, x_row, y_row, rows, answer, buckets = plan
    assert (stream, seq, x_row, y_row, rows, answer) == (77, 3, 24, 24, (3, 2), (3, 2))
    assert [b[0] for b in buckets] == [1, 2, 4] and buckets[0] == (1, 0, 0, 0, 0, 0, 0, 0)
    for size, x, mask, y, sx, smask, hy, graph in buckets[1:]:
        stage_x, stage_mask = engine.staging(size)
        assert (x, mask, y) == (captures[size].x.data_ptr(), captures[size].mask.data_ptr(), captures[size].y.data_ptr())
        assert (sx, smask, hy, graph) == (stage_x.data_ptr(), stage_mask.data_ptr(),
                                          engine.host_outputs[size].data_ptr(), captures[size].graph_exec())
        assert graph != 0
    assert engine.static_mask_shared and engine.static_mask_stale(4, all_true=True)
    assert engine.static_mask_stale(4, all_true=True)  # written again: the native route may have changed it
    instance.native = plan
    instance.native_refused("cannot open libcuda.so.1")
    assert instance.native_plan() is None and not engine.static_mask_shared
    assert "m (m_0): no native route: cannot open libcuda.so.1" in capsys.readouterr().err
    monkeypatch.setenv(inprocess.NATIVE_ROUTE_ENV, "0")
    assert instance._native_plan() is None
    monkeypatch.delenv(inprocess.NATIVE_ROUTE_ENV)
    engine.static = {1: captures[1].static_call()}  # no capture to launch anywhere: no plan
    assert instance._native_plan() is None
