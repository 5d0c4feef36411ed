"""Issue 20 Part B (CPU half): the kkdeploy custom-op library, its exporter mode, graph check and ORT engine.

The library is compiled here (g++ against Debian's libonnxruntime-dev headers, fetched once into the cache:
engines/custom_op_library.py); nothing skips when a compiler is present. Op-level checks run one-node ORT
sessions against torch; the build test runs the product's own command on shape 3.
"""

from __future__ import annotations

import ctypes
import json

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper

import kkdeploy
from engines.custom_op_library import build_library, register
from exporters import ExportOptions, GraphCheckError, build_graph, check_graph, export_onnx
from kkdeploy.cli import main as cli_main
from kkdeploy.errors import KKError
from tests.conftest import SMALL, load_script, models_for

ELEM = {torch.float32: TensorProto.FLOAT, torch.float16: TensorProto.FLOAT16}


@pytest.fixture(scope="module")
def library():
    return build_library("cpu")


def one_node_session(library, op: str, dtype: torch.dtype, shapes: dict, out_shape: list, **attrs):
    import onnxruntime as ort

    names = list(shapes)  # the node's inputs, in order (x, then its parameters)
    node = helper.make_node(op, names, ["y"], domain="kkdeploy", **attrs)
    graph = helper.make_graph([node], op, [helper.make_tensor_value_info(n, ELEM[dtype], s) for n, s in shapes.items()],
                              [helper.make_tensor_value_info("y", ELEM[dtype], out_shape)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("kkdeploy", 1)])
    model.ir_version = 10
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    register(options, library)
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return lambda *ts: torch.from_numpy(session.run(None, dict(zip(names, (t.numpy() for t in ts))))[0])


def linear_inputs(dtype, m=(4, 33), k=96, n=80, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*m, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) * k ** -0.5).to(dtype)
    b = torch.randn(n, generator=g).to(dtype)
    return x, w, b


def sequential_fp32_linear(x, w, b):
    """The kernel's definition in torch: FP32 products (exact for fp16 inputs) summed in k order, one add at a
    time (each an IEEE FP32 add, so this is bitwise what a sequential loop computes), then the FP32 bias."""
    xf, wf = x.float(), w.float()
    acc = torch.zeros(*x.shape[:-1], w.shape[0])
    for k in range(x.shape[-1]):
        acc = acc + xf[..., k:k + 1] * wf[:, k]
    return acc + b.float()


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a - b| in float16 units in the last place (monotone integer keys of the bit patterns)."""
    def key(t):
        bits = t.view(torch.int16).to(torch.int32) & 0xFFFF
        return torch.where(bits >= 0x8000, 0x8000 - bits, bits)
    return (key(a) - key(b)).abs()


def test_library_built_against_older_headers_loads_in_the_installed_runtime(library):
    import onnxruntime as ort

    built_api = ctypes.CDLL(str(library)).KKDeployOpsApiVersion()
    runtime = tuple(int(p) for p in ort.__version__.split(".")[:2])
    assert built_api == 21  # Debian trixie's libonnxruntime-dev 1.21
    assert runtime >= (1, built_api)  # the runtime is at least as new: GetApi(21) must succeed
    run = one_node_session(library, "Linear", torch.float32, {"x": [2, 3], "w": [4, 3], "b": [4]}, [2, 4])
    x, w, b = linear_inputs(torch.float32, m=(2,), k=3, n=4)
    assert torch.equal(run(x, w, b), sequential_fp32_linear(x, w, b))
    assert build_library("cpu") == library  # cached: same path, no recompile


def test_linear_float32_matches_torch(library):
    x, w, b = linear_inputs(torch.float32)
    run = one_node_session(library, "Linear", torch.float32, {"x": list(x.shape), "w": list(w.shape),
                                                                "b": list(b.shape)}, [4, 33, 80])
    y = run(x, w, b)
    assert torch.equal(y, sequential_fp32_linear(x, w, b))  # exactly the documented order (no FMA)
    torch.testing.assert_close(y, torch.nn.functional.linear(x, w, b), atol=1e-5, rtol=1e-5)


def test_linear_float16_accumulates_in_fp32_adds_fp32_bias_and_rounds_once(library):
    x, w, b = linear_inputs(torch.float16)
    run = one_node_session(library, "Linear", torch.float16, {"x": list(x.shape), "w": list(w.shape),
                                                                "b": list(b.shape)}, [4, 33, 80])
    y = run(x, w, b)
    assert y.dtype == torch.float16
    # Bitwise: the kernel's own definition (sequential FP32 sum, FP32 bias, one rounding).
    assert torch.equal(y, sequential_fp32_linear(x, w, b).half())
    # Against the formula with torch's (blocked) FP32 GEMM, and against the exact sum rounded once:
    # only the FP32 summation order differs (error <= K * 2^-24 * S, S = sum|x*w| + |b|), far below one fp16
    # ulp at magnitude S, so after one rounding each the two differ by at most 1 fp16 ulp of S. (In ulps of the
    # result itself the distance can be larger where the sum cancels to near zero.)
    magnitude = x.float().abs() @ w.float().abs().T + b.float().abs()
    ulp_of_magnitude = torch.exp2(torch.floor(torch.log2(magnitude)) - 10)
    torch_formula = (x.float() @ w.float().T + b.float()).half()
    exact = (x.double() @ w.double().T + b.double()).half()
    for expected in (torch_formula, exact):
        assert ((y.float() - expected.float()).abs() <= ulp_of_magnitude).all()
        assert (y != expected).float().mean().item() < 0.01
    # Rounding before the bias (Gemm / MatMul+Add in fp16) is a different op: it differs in many elements.
    rounded_first = (x.float() @ w.float().T).half().float().add(b.float()).half()
    assert (rounded_first != y).float().mean().item() > 0.05


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_layer_norm_matches_torch(library, dtype):
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(5, 7, 64, generator=g) * 3 + 1).to(dtype)
    w, b = torch.randn(64, generator=g).to(dtype), torch.randn(64, generator=g).to(dtype)
    run = one_node_session(library, "LayerNorm", dtype, {"x": [5, 7, 64], "w": [64], "b": [64]}, [5, 7, 64],
                           epsilon=1e-5)
    y = run(x, w, b)
    expected = torch.nn.functional.layer_norm(x, (64,), w, b, 1e-5)
    if dtype == torch.float32:
        torch.testing.assert_close(y, expected, atol=1e-5, rtol=1e-5)
    else:  # FP32 statistics in another order than ATen's, one rounding: equal or 1 ulp apart
        assert ulp_distance(y, expected).max().item() <= 1
        torch.testing.assert_close(y.float(), torch.nn.functional.layer_norm(x.float(), (64,), w.float(), b.float(),
                                                                             1e-5).half().float(), atol=2e-3, rtol=0)


def test_options_name_the_custom_modes():
    opts = ExportOptions(linear="custom", layer_norm="custom")
    assert opts.uses_custom_ops and opts.label() == "custom-separate-fp32pw-ln-custom"
    assert "layer_norm" not in ExportOptions().to_dict() and not ExportOptions().uses_custom_ops
    assert ExportOptions.from_dict(opts.to_dict()) == opts
    with pytest.raises(KKError, match="unknown layer_norm mode 'cuda'"):
        ExportOptions(layer_norm="cuda")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_export_writes_kkdeploy_nodes_and_the_check_accepts_exactly_that_domain(tmp_path, dtype):
    model, _ = models_for(SMALL, dtype)
    info = export_onnx(model, SMALL, dtype, tmp_path / "m.onnx", ExportOptions(linear="custom", layer_norm="custom"))
    hist = info["op_histogram"]
    assert hist["kkdeploy:Linear"] == 2 * 6 and hist["kkdeploy:LayerNorm"] == 2 * 2 + 1
    assert "Gemm" not in hist and "LayerNormalization" not in hist  # MatMul stays: Q@K^T and P@V
    graph = onnx.load(str(tmp_path / "m.onnx"))
    assert {(o.domain, o.version) for o in graph.opset_import} == {("", 17), ("kkdeploy", 1)}

    other = onnx.ModelProto()
    other.CopyFrom(graph)
    next(n for n in other.graph.node if n.domain == "kkdeploy").domain = "com.example"
    other.opset_import.append(helper.make_opsetid("com.example", 1))
    with pytest.raises(GraphCheckError, match="'com.example'"):
        check_graph(other, SMALL, dtype)
    unknown = onnx.ModelProto()
    unknown.CopyFrom(graph)
    next(n for n in unknown.graph.node if n.op_type == "Linear").op_type = "Softmax"
    with pytest.raises(GraphCheckError, match=r"\(Softmax\) is not a kkdeploy op"):
        check_graph(unknown, SMALL, dtype)


def test_graph_check_still_rejects_a_non_standard_domain_in_a_stock_graph():
    model, _ = models_for(SMALL)
    graph = build_graph(model, SMALL, torch.float32)
    check_graph(graph, SMALL, torch.float32)
    graph.graph.node[0].domain = "com.microsoft"
    graph.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    with pytest.raises(GraphCheckError, match="'com.microsoft'"):
        check_graph(graph, SMALL, torch.float32)


def test_build_shape3_ships_the_library_in_the_artifact_and_load_serves_it(tmp_path, library):
    out = tmp_path / "art"
    code = cli_main(["build", "--shape", "3", "--device", "cpu", "--dtype", "float32", "--linear", "custom",
                     "--backends", "ort-cpu", "--out", str(out), "--trials", "1", "--warmups", "1", "--repeats", "2",
                     "--rounds", "1"])
    assert code == 0
    manifest = json.loads((out / "manifest.json").read_text())
    entry = next(c for c in manifest["candidates"] if c["name"] == "ort-cpu")
    assert entry["status"] == "passed" and entry["validation"]["failed_elements"] == 0
    assert entry["options"]["custom_ops_library"] == "libkkdeploy_ops.so"
    build = entry["options"]["custom_ops_build"]  # the manifest says how the shipped library was built
    assert build["cuda"] is None and build["api_version"] == 21 and build["compiler"]
    assert "libkkdeploy_ops.so.build.json" in manifest["files"]  # the record travels with the library
    assert "libkkdeploy_ops.so" in entry["files"] and len(manifest["files"]["libkkdeploy_ops.so"]) == 64
    assert entry["fresh_process"]["status"] == "ok"
    assert manifest["export"]["op_histogram"]["kkdeploy:Linear"] == 4 * 6
    # scripts/build_table.py (issue 20's per-shape tables) reads the same manifest.
    table = load_script("build_table")
    rows = {r["candidate"]: r for r in table.rows_for(manifest)}
    assert rows["ort-cpu"]["failed_elements"] == 0 and rows["ort-cpu"]["cuda_ep_use_tf32"] is None
    assert rows["fallback (PyTorch)"]["status"] == "fallback" and sum(r["shipped"] for r in rows.values()) == 1
    assert "| 3 | ort-cpu | passed | 0 |" in table.markdown(list(rows.values()))
    # Serve the engine (on this CPU the plain-loop kernels are slower than the fallback, so pin the choice).
    manifest["choice"] = {**manifest["choice"], "candidate": "ort-cpu", "backend": "ort", "all_valid_only": False}
    (out / "manifest.json").write_text(json.dumps(manifest))
    runner = kkdeploy.load(out, device="cpu")
    assert runner.backend == "ort-cpu" and runner.engine is not None
    config = kkdeploy.official_config(3)
    x, mask = kkdeploy.generate_case(config, "cpu", torch.float32, 7)
    reference, _ = models_for(config)
    with torch.inference_mode():
        torch.testing.assert_close(runner(x, mask), reference(x, mask), atol=1e-4, rtol=1e-3)


def test_missing_compiler_is_a_one_line_error_and_an_unavailable_candidate(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("CXX", "/nonexistent/g++")
    with pytest.raises(KKError, match="not on PATH") as info:
        build_library("cpu")
    assert "\n" not in str(info.value)
    out = tmp_path / "art"
    cli_main(["build", "--batch-size", "2", "--seq-len", "8", "--d-model", "16", "--heads", "2", "--ffn-dim", "16",
              "--layers", "1", "--device", "cpu", "--dtype", "float32", "--linear", "custom", "--backends", "ort-cpu",
              "--out", str(out), "--trials", "1", "--warmups", "1", "--repeats", "2", "--rounds", "1"])
    entry = json.loads((out / "manifest.json").read_text())["candidates"][0]
    assert entry["status"] == "unavailable" and entry["reason"].startswith("unavailable: the kkdeploy custom ops")


def test_export_cli_accepts_custom_modes(tmp_path):
    out = tmp_path / "exp"
    assert cli_main(["export", "--batch-size", "2", "--seq-len", "8", "--d-model", "16", "--heads", "2",
                     "--ffn-dim", "16", "--layers", "1", "--dtype", "float16", "--device", "cpu", "--linear", "custom",
                     "--layer-norm", "custom", "--out", str(out)]) == 0
    info = json.loads((out / "export.json").read_text())
    assert info["options"]["linear"] == "custom" and info["options"]["layer_norm"] == "custom"


@pytest.mark.parametrize("level", ["disabled", "all"])
def test_offline_optimization_keeps_the_custom_nodes_and_the_saved_graph_reloads(tmp_path, library, level):
    from engines.ort import import_ort, session_options

    ort = import_ort()
    model, _ = models_for(SMALL, torch.float16)
    export_onnx(model, SMALL, torch.float16, tmp_path / "m.onnx", ExportOptions(linear="custom", layer_norm="custom"))
    optimized = tmp_path / "m.optimized.onnx"
    ort.InferenceSession(str(tmp_path / "m.onnx"), session_options(ort, level, optimized, custom_ops_library=library),
                         providers=["CPUExecutionProvider"])
    saved = onnx.load(str(optimized))
    assert sum(n.domain == "kkdeploy" for n in saved.graph.node) == 12 + 5
    session = ort.InferenceSession(str(optimized), session_options(ort, "disabled", custom_ops_library=library),
                                   providers=["CPUExecutionProvider"])
    x, mask = kkdeploy.generate_case(SMALL, "cpu", torch.float16, 3)
    (y,) = session.run(["y"], {"x": x.numpy(), "valid_token_mask": mask.numpy()})
    with torch.inference_mode():
        expected = model(x, mask)
    torch.testing.assert_close(torch.from_numpy(y).float(), expected.float(), atol=5e-3, rtol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gelu_is_atens_formula_in_fp32_rounded_once(library, dtype):
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(6, 40, generator=g) * 3).to(dtype)
    y = one_node_session(library, "Gelu", dtype, {"x": [6, 40]}, [6, 40])(x)
    assert y.dtype == dtype
    xf = x.float()
    formula = xf * 0.5 * (1.0 + torch.erf(xf * (1 / 2 ** 0.5)))  # the CUDA kernel's expression (ATen's)
    exact = torch.nn.functional.gelu(x.double(), approximate="none")
    if dtype == torch.float32:  # libm's erff and torch's erf may differ in the last bits; the formula is ATen's
        torch.testing.assert_close(y, formula, atol=2e-7, rtol=2e-6)
    else:  # one rounding of a result accurate to a few FP32 ulps: the FP16 value of the exact GELU, or 1 ulp off
        assert ulp_distance(y, exact.half()).max().item() <= 1
        assert (y != formula.half()).float().mean().item() < 0.01


def test_export_with_custom_gelu_runs_on_the_cpu_ep(tmp_path, library):
    from engines.ort import import_ort, session_options

    ort = import_ort()
    model, _ = models_for(SMALL, torch.float16)
    opts = ExportOptions(linear="custom", layer_norm="custom", gelu="custom")
    assert opts.uses_custom_ops and ExportOptions(gelu="custom").uses_custom_ops
    assert opts.label().endswith("-gelu-custom")
    info = export_onnx(model, SMALL, torch.float16, tmp_path / "m.onnx", opts)
    hist = info["op_histogram"]
    assert hist["kkdeploy:Gelu"] == SMALL.num_layers and "Erf" not in hist
    session = ort.InferenceSession(str(tmp_path / "m.onnx"), session_options(ort, "disabled", custom_ops_library=library),
                                   providers=["CPUExecutionProvider"])
    x, mask = kkdeploy.generate_case(SMALL, "cpu", torch.float16, 5, padding_ratio=0.25)
    (y,) = session.run(["y"], {"x": x.numpy(), "valid_token_mask": mask.numpy()})
    with torch.inference_mode():
        expected = model(x, mask)
    torch.testing.assert_close(torch.from_numpy(y).float(), expected.float(), atol=5e-3, rtol=1e-2)


def test_cuda_library_commands_compile_the_kernels_with_nvcc_defaults_and_link_cublaslt(tmp_path, library):
    from engines import custom_op_library as col

    cuda = {"nvcc": "/opt/cuda/bin/nvcc", "version": "nvcc 13.0", "flags": list(col.NVCC_FLAGS), "arch": "sm_90"}
    include = library.parent  # any directory: the commands are only formed here
    kernels, wrapper, link = col.compile_commands("g++", include, tmp_path / col.LIBRARY_NAME, cuda)
    assert kernels[0] == "/opt/cuda/bin/nvcc" and kernels[-3].endswith("kkdeploy_ops_cuda.cu")
    assert "arch=compute_90,code=sm_90" in kernels
    # Bitwise needs ATen's floating-point code generation: nvcc's defaults, no fast math, FMA contraction on.
    assert not any("fast" in f or "fmad" in f or "prec" in f for f in kernels)
    assert wrapper[0] == "g++" and "-DKKDEPLOY_WITH_CUDA" in wrapper and "-shared" not in wrapper
    assert "-ffp-contract=off" in wrapper  # the CPU kernels' documented order still holds in the CUDA build
    assert link[0] == "/opt/cuda/bin/nvcc" and "-lcublasLt" in link and link[-1].endswith(col.LIBRARY_NAME)
    # With PyTorch's own cuBLAS wheel found, compile and link against exactly that library.
    cuda["cublas"] = {"include": "/site/nvidia/cublas/include", "lib_dir": "/site/nvidia/cublas/lib",
                      "lib": ":libcublasLt.so.13"}
    kernels, _, link = col.compile_commands("g++", include, tmp_path / col.LIBRARY_NAME, cuda)
    assert "-I/site/nvidia/cublas/include" in kernels
    assert "-l:libcublasLt.so.13" in link and "-L/site/nvidia/cublas/lib" in link
    (cpu_cmd,) = col.compile_commands("g++", include, tmp_path / col.LIBRARY_NAME, None)
    assert "-DKKDEPLOY_WITH_CUDA" not in cpu_cmd and not any(a.endswith(".cu") for a in cpu_cmd)
    # The CPU build carries no CUDA kernels, and the key separates the two builds.
    assert ctypes.CDLL(str(library)).KKDeployOpsWithCuda() == 0
    headers = col.ort_headers()
    assert col.library_key("g++", *headers) != col.library_key("g++", *headers, cuda)


def test_a_cuda_build_without_a_gpu_or_nvcc_is_a_one_line_error(monkeypatch):
    from engines import custom_op_library as col

    if not torch.cuda.is_available():
        with pytest.raises(KKError, match="this machine has none") as info:
            build_library("cuda")
        assert "\n" not in str(info.value)
    from kkdeploy.kernels import cuda_build

    monkeypatch.setenv("NVCC", "/nonexistent/nvcc")
    with pytest.raises(KKError, match="NVCC=/nonexistent/nvcc is not an executable"):
        col.nvcc()
    monkeypatch.delenv("NVCC")
    monkeypatch.setattr(cuda_build.shutil, "which", lambda name: None)
    monkeypatch.setattr(cuda_build, "NVCC_FALLBACK", "/nonexistent/cuda/bin/nvcc")
    with pytest.raises(KKError, match="need nvcc"):
        col.nvcc()


def test_cuda_sources_keep_atens_operand_order():
    """The CUDA kernels are bitwise only if written as ATen writes them (nvcc contracts a*b+c by position);
    pin the expressions the GPU self-test proved, so an edit that reorders them fails here first."""
    from engines.custom_op_library import CUDA_SOURCES, SOURCE_DIR

    src = "".join((SOURCE_DIR / name).read_text() for name in CUDA_SOURCES)  # the kernels and the shared Welford
    for expr in ("const float mean = s.mean + delta * (1.f / count);",
                 "return {mean, s.m2 + delta * (value - mean), count};",
                 "mean = n_other * other.mean + n_own * own.mean;",
                 "m2 = other.m2 + own.m2 + delta * delta * other.count * n_own;",
                 "mean_m2[1] = s.m2 / float(N);",
                 "const float rstd = rsqrtf(mean_m2[1] + eps);",
                 "__half2float(g.v[k]) * (rstd * (__half2float(data.v[k]) - mean)) +",
                 "v * 0.5f * (1.0f + ::erff(v * kAlpha))",
                 "CUBLASLT_EPILOGUE_BIAS", "CUBLAS_COMPUTE_32F, CUDA_R_32F"):
        assert expr in src, expr


def test_gpu_selftest_says_it_needs_a_gpu_in_one_line(capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the script would run its op table")
    selftest = load_script("custom_ops_gpu_selftest")
    assert selftest.main(["--shapes", "3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["custom_ops_gpu_selftest: needs a CUDA GPU"]


def test_gpu_selftest_runs_long_shapes_through_the_long_context_model():
    from kkdeploy import TransformerConfig
    from kkdeploy.models.long_context import LongContextTransformer

    selftest = load_script("custom_ops_gpu_selftest")
    short, cases = selftest.model_and_cases(TransformerConfig(2, 64, 32, 4, 32, 1), "cpu")
    assert not isinstance(short, LongContextTransformer) and cases == selftest.PADDING
    long_model, cases = selftest.model_and_cases(TransformerConfig(1, 2048, 32, 4, 32, 1), "cpu")
    assert isinstance(long_model, LongContextTransformer) and cases == (0.0,)
    assert long_model.dtype == torch.float16
    reference, _ = models_for(TransformerConfig(1, 2048, 32, 4, 32, 1))  # the same seeded weights
    assert all(torch.equal(a.half(), b) for a, b in zip(reference.state_dict().values(),
                                                        long_model.state_dict().values()))
