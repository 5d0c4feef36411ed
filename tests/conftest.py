import importlib.util
import json
import os
import struct
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import numpy as np

import pytest
import torch

from kkdeploy import TransformerConfig
from kkdeploy.models.weights import build_models

torch.set_num_threads(2)

SMALL = TransformerConfig(batch_size=3, seq_len=16, d_model=32, num_heads=4, ffn_dim=48, num_layers=2, causal=True)
SMALL_NONCAUSAL = TransformerConfig(3, 16, 32, 4, 48, 2, causal=False)
#: `kkdeploy build` arguments of the serving tests' small CPU artifact (a few seconds to build, quick protocol)
SERVING_BUILD = ["--batch-size", "2", "--seq-len", "8", "--d-model", "16", "--heads", "2", "--ffn-dim", "16",
                 "--layers", "2", "--device", "cpu", "--trials", "2", "--warmups", "2", "--repeats", "5", "--rounds", "1"]


def build_serving_artifact(out: Path, *extra: str) -> Path:
    """The serving tests' small CPU artifact at ``out`` (``extra``: more build flags, e.g. --batch-buckets 1,2)."""
    from kkdeploy.cli import main as cli

    assert cli(["build", *SERVING_BUILD, *extra, "--out", str(out)]) == 0
    return out


@pytest.fixture
def small_config():
    return SMALL


def models_for(config, dtype=torch.float32, sdpa_layers=1, seed=0):
    return build_models(config, dtype, "cpu", seed=seed, sdpa_layers=sdpa_layers)


def load_script(name: str):
    """A module from scripts/ (run by hand, not a package), for tests of its functions and main()."""
    path = Path(__file__).resolve().parents[1] / "scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN payloads and signed zeros included)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    view = {torch.float16: torch.int16, torch.float32: torch.int32, torch.bfloat16: torch.int16}[a.dtype]
    return torch.equal(a.contiguous().view(view), b.contiguous().view(view))


def run_interpreter_script(script: str) -> list:
    """Run ``script`` (it prints ``RESULTS <json>``) in a fresh process under TRITON_INTERPRET=1 and return the
    results; skips where Triton is not importable or its interpreter cannot run with this numpy."""
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    # the GPU's fma (one rounding), tile dots whatever the BLAS, and numpy 2.4's int() of 1-element arrays
    script = ("from tests.interpreter_support import exact_dot, exact_fma, scalar_index\n"
              "exact_fma()\nexact_dot()\nscalar_index()\n") + script
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parents[1], env=env, timeout=600)
    if run.returncode != 0 and "only 0-dimensional arrays can be converted to Python scalars" in run.stderr:
        # triton 3.6's interpreter indexes with int(np.array([n])), an error since numpy 2.4 (fixed upstream
        # by squeezing); the compiled kernel is unaffected. Any other failure fails the test.
        pytest.skip("this triton's interpreter cannot run with this numpy (int() of a 1-element array)")
    assert run.returncode == 0, run.stderr[-4000:]
    line = next(l for l in run.stdout.splitlines() if l.startswith("RESULTS "))
    return json.loads(line[len("RESULTS "):])


def kernel_trace(calls: int, kernels: list[tuple[str, float, float]], period: float = 100.0) -> dict:
    """torch.profiler's Chrome format: device kernels are complete events of category "kernel"; host events and
    runtime calls around them must be ignored."""
    events = [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0.0, "dur": 500.0},
              {"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": 1.0, "dur": 3.0}]
    for c in range(calls):
        for name, start, dur in kernels:
            events.append({"ph": "X", "cat": "kernel", "name": name, "ts": c * period + start, "dur": dur,
                           "pid": 0, "tid": 7})
    events.reverse()  # the split goes by start time, not by the order events are written
    return {"traceEvents": events}


def round_to_float32(value: Fraction) -> float:
    """The float32 nearest to an exact rational, ties to even (no double rounding through float64)."""
    if value == 0:
        return 0.0
    near = np.float32(float(value))
    best = None
    for cand in (near, np.nextafter(near, np.float32(np.inf)), np.nextafter(near, np.float32(-np.inf))):
        gap = abs(Fraction(float(cand)) - value)
        even = struct.unpack("I", struct.pack("f", float(cand)))[0] % 2 == 0
        if best is None or gap < best[0] or (gap == best[0] and even):
            best = (gap, float(cand))
    return best[1]


@pytest.fixture
def proof_sandbox(monkeypatch, tmp_path):
    """A pretend CUDA device for the path rules and proof keys (no kernel runs), an empty proof cache, and no
    proofs remembered by this process before or after the test."""
    from kkdeploy.kernels import proof

    monkeypatch.setenv("KKDEPLOY_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "Test GPU")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    proof.forget_proofs()
    proof._kernel_environment.cache_clear()
    yield proof
    proof.forget_proofs()
    proof._kernel_environment.cache_clear()


from tests.standins import CapturedStandIn, HostDriver, captured_bucket_engine  # noqa: E402,F401 - the tests' names


#: the rows LayerNorm's kernels in csrc/layer_norm.cu, as ``layer_norm_ptx_entries`` names them (rows2_full and
#: block4_full once per width they are compiled for)
LAYER_NORM_KERNELS = ("rows", "rows2", *(f"rows2_full{n}" for n in (16, 32, 64, 128)),
                      *(f"rows2_full_early{n}" for n in (16, 32, 64, 128)), "block4",
                      *(f"block4_full{n}" for n in (256, 384, 512, 768, 1024)),
                      "rows2_masked", *(f"rows2_full{e}_masked{n}" for e in ("", "_early") for n in (16, 32, 64, 128)))


def layer_norm_ptx_entries(tmp_path: Path) -> dict[str, str]:
    """csrc/layer_norm.cu compiled to PTX for sm_90 with the build's nvcc flags: each kernel by its template
    arguments ({"rows2<pdl>": body, "block4_full1024<plain>": body, "rows2_full_masked128<pdl>": body, ...}), the
    kernel's own name and its basic blocks' numbers taken out (they follow the order the kernels are emitted in)."""
    import re

    from kkdeploy.kernels import layer_norm
    from kkdeploy.kernels.cuda_build import NVCC_FLAGS

    flags = [f for f in NVCC_FLAGS if f not in ("-Xcompiler", "-fPIC")]
    out = tmp_path / "ln.ptx"
    subprocess.run(["nvcc", *flags, "-arch=sm_90", "--ptx", str(layer_norm.SOURCE), "-o", str(out)], check=True,
                   capture_output=True)
    ptx = out.read_text()
    found = {}
    for match in re.finditer(r"\.entry (\S+)\(", ptx):
        name = match.group(1)
        kernel = re.search(r"layer_norm_(rows2|rows|block4)(_masked)?_f16_kernelILb([01])E(?:Li(\d+)E)?(Lb1E)?(?:Lb0E)?E",
                           name)
        body = ptx[match.start():ptx.index("\n}\n", match.end())].replace(name, "KERNEL")
        width = int(kernel.group(4) or 0)  # the full forms are the kernels compiled for one width
        masked = "_masked" if kernel.group(2) else ""
        launch = (f"{kernel.group(1)}_full{'_early' if kernel.group(5) else ''}{masked}{width}" if width
                  else kernel.group(1) + masked)
        key = f"{launch}<{'pdl' if kernel.group(3) == '1' else 'plain'}>"
        found[key] = re.sub(r"\$L__BB\d+_", "$L__BB_", body)
    return found
