"""`kkdeploy env`: one line per thing the machine can or cannot do, each 'off' with its reason; JSON for machines."""

from __future__ import annotations

import json

import pytest

from engines import registry
from kkdeploy.cli import main
from kkdeploy.commands import env


def _report(tmp_path, *args):
    path = tmp_path / "env.json"
    assert main(["env", "--device", "cpu", "--json", str(path), *args]) == 0
    return json.loads(path.read_text())


def _check(report, area, name):
    return next(c for c in report["checks"] if c["area"] == area and c["name"] == name)


def test_every_backend_kernel_and_serving_part_has_a_line_and_every_off_line_a_reason(tmp_path, capsys):
    report = _report(tmp_path)
    assert report["format"] == env.ENV_FORMAT and report["device"]["type"] == "cpu" and report["dtype"] == "float32"
    names = [c["name"] for c in report["checks"] if c["area"] == "backend"]
    assert sorted(names) == sorted(d.recipe_name or d.choices[0].name for d in registry.DESCRIPTORS.values())
    assert _check(report, "validation", "Polygraphy comparator")["status"] == env.OK
    assert {c["name"] for c in report["checks"] if c["area"] == "serving"} == {
        "tritonserver", "Python backend", "in-process backend", "in-process native route", "load generator client",
        "native gRPC client"}
    assert "no CUDA device" in _check(report, "serving", "in-process native route")["detail"]
    assert _check(report, "serving", "native gRPC client")["status"] == env.OK  # CI has a compiler and hpack
    for check in report["checks"]:
        assert check["status"] in (env.OK, env.OFF), check  # no check may fail on a healthy machine
        assert check["detail"], check
    # on the CPU: CUDA graphs, every kernel of ours and dependent launches are off, each saying why
    assert "CUDA" in _check(report, "backend", "torch-graph")["detail"]
    kernels = [c for c in report["checks"] if c["area"] == "kernel" and c["name"] != "ONNX Runtime custom ops"]
    assert len(kernels) == 5 and all(c["status"] == env.OFF and "cpu" in c["detail"] for c in kernels), kernels
    # the CPU build's default backend is ready, and a backend built only on request says so
    assert _check(report, "backend", "ort")["status"] == env.OK
    assert _check(report, "backend", "ort")["detail"] == "ort-cpu"
    assert "on request" in _check(report, "backend", "torch-compile")["detail"]
    out = capsys.readouterr().out
    assert "What this machine can do" in out and "ready; every 'off' line says why" in out


def test_a_checks_own_one_line_error_is_its_reason(tmp_path, monkeypatch):
    # A server named by the variable but absent: the same one-line error `kkdeploy serve` gives, as the reason.
    monkeypatch.setenv("KKDEPLOY_TRITONSERVER", str(tmp_path / "no-such-triton"))
    check = _check(_report(tmp_path), "serving", "tritonserver")
    assert check["status"] == env.OFF and "KKDEPLOY_TRITONSERVER" in check["detail"] and "no bin/tritonserver" in check["detail"]


def test_without_a_compiler_the_native_client_line_says_so(tmp_path, monkeypatch):
    monkeypatch.setenv("CXX", "no-such-compiler")
    check = _check(_report(tmp_path), "serving", "native gRPC client")
    assert check["status"] == env.OFF and "no-such-compiler" in check["detail"] and "--client lean" in check["detail"]


def test_a_check_that_breaks_is_reported_and_the_others_still_run(tmp_path, monkeypatch):
    from engines.torch_graph import BACKEND

    def broken(device, dtype):
        raise RuntimeError("driver exploded\nsecond line")

    monkeypatch.setattr(BACKEND, "unavailable_reason", broken)
    report = _report(tmp_path)
    check = _check(report, "backend", "torch-graph")
    assert check == {"area": "backend", "name": "torch-graph", "status": env.ERROR,
                     "detail": "RuntimeError: driver exploded"}
    assert _check(report, "backend", "ort")["status"] == env.OK and len(report["checks"]) > 10


def test_float16_on_the_cpu_is_reported_not_refused(tmp_path):
    assert _report(tmp_path, "--dtype", "float16")["dtype"] == "float16"


@pytest.mark.parametrize("device", ["tpu", "cuda:0"])
def test_a_device_this_machine_lacks_is_a_one_line_error(device, capsys):
    import torch

    if device.startswith("cuda") and torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert main(["env", "--device", device]) == 2
    err = capsys.readouterr().err
    assert "error:" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_the_onnx_runtime_custom_ops_line_names_its_headers_without_fetching_them(tmp_path, monkeypatch):
    monkeypatch.setenv("KKDEPLOY_CACHE_DIR", str(tmp_path / "empty-cache"))
    check = _check(_report(tmp_path), "kernel", "ONNX Runtime custom ops")
    assert check["status"] == env.OFF and "not cached" in check["detail"] and "KKDEPLOY_ORT_INCLUDE" in check["detail"]
    assert not (tmp_path / "empty-cache" / "ort-headers").exists()  # nothing was fetched
    include = tmp_path / "include"
    include.mkdir()
    monkeypatch.setenv("KKDEPLOY_ORT_INCLUDE", str(include))
    check = _check(_report(tmp_path), "kernel", "ONNX Runtime custom ops")
    assert check["status"] == env.OFF and "has no onnxruntime_c_api.h" in check["detail"]
    (include / "onnxruntime_c_api.h").write_text("#define ORT_API_VERSION 21\n")
    check = _check(_report(tmp_path), "kernel", "ONNX Runtime custom ops")
    assert check["status"] == env.OK and "api21" in check["detail"] and str(include) in check["detail"]


NO_POLYGRAPHY = """
import sys

class Missing:  # this interpreter as on a machine without Polygraphy
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "polygraphy":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)

sys.meta_path.insert(0, Missing())
"""


def test_without_polygraphy_env_says_so_and_a_build_refuses_in_one_line(tmp_path):
    """Polygraphy is the build's validator, not every command's: `kkdeploy env` still reports the machine, with
    the validator off and the fix, and `kkdeploy build` stops in one line naming the package (no traceback)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    (tmp_path / "sitecustomize.py").write_text(NO_POLYGRAPHY)
    repo = Path(__file__).resolve().parents[1]
    environ = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(repo)]))
    out = tmp_path / "env.json"
    done = subprocess.run([sys.executable, "-m", "kkdeploy", "env", "--device", "cpu", "--json", str(out)],
                          capture_output=True, text=True, env=environ, timeout=300)
    assert done.returncode == 0, done.stderr
    check = _check(json.loads(out.read_text()), "validation", "Polygraphy comparator")
    assert check["status"] == env.OFF and "pip install polygraphy" in check["detail"]
    built = subprocess.run([sys.executable, "-m", "kkdeploy", "build", "--shape", "3", "--device", "cpu",
                            "--out", str(tmp_path / "b")], capture_output=True, text=True, env=environ, timeout=300)
    assert built.returncode == 2 and "Traceback" not in built.stderr
    assert "needs the Python package 'polygraphy'" in built.stderr and not (tmp_path / "b").exists()


def test_it_says_where_proofs_run_and_that_switching_the_child_off_on_a_gpu_is_a_risk(monkeypatch):
    import torch

    assert "calling process (cpu" in env.proof_checks(torch.device("cpu"))[1].detail
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "Test GPU")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    child = env.proof_checks(torch.device("cuda", 0))[1]
    assert child.status == env.OK and child.detail.startswith("in a spawned child: a kernel that faults")
    monkeypatch.setenv("KKDEPLOY_PROOF_PROCESS", "0")
    off = env.proof_checks(torch.device("cuda", 0))[1]
    assert off.status == env.OFF and "ends the build; unset it" in off.detail
