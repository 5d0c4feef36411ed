"""The faithful ONNX exporter: graph check, ONNX Runtime CPU parity under the strict rule, export CLI."""

from __future__ import annotations

import hashlib
import json

import onnx
import pytest
import torch

from exporters import (NAMED_VARIANTS, DenseAttentionTooLarge, ExportOptions, GraphCheckError, check_graph,
                       dense_attention_bytes_ok, export_onnx)
from exporters.ort_probe import float32_fallback_nodes, session_options
from kkdeploy import KKError, TransformerConfig, official_config
from kkdeploy.cli import main
from kkdeploy.inputs import generate_case
from kkdeploy.models.weights import build_models, weights_sha256
from tests.conftest import SMALL, SMALL_NONCAUSAL
from validation.strict import CONTRACTS, compare_outputs

ort = pytest.importorskip("onnxruntime")

STRICT = CONTRACTS["strict"]
PADDINGS = (0.0, 0.25)
OPTION_VARIANTS = {k: v for k, v in NAMED_VARIANTS.items() if k != "fp32_linear_gelu_op"}
CONFIGS = {"small": SMALL, "small-noncausal": SMALL_NONCAUSAL, "shape2": official_config(2),
           "shape3": official_config(3), "shape12": official_config(12)}
# In float32 every Cast is omitted, so these variants write the default's graph byte for byte
# (test_float32_variants_without_casts_are_identical); the float32 parity matrix skips them.
FLOAT32_SAME_AS_DEFAULT = ("native_pointwise", "scale_native")
_MODELS: dict = {}
_EXPECTED: dict = {}


def reference_model(config, dtype):
    """One reference per (config, dtype) for the whole module: building is the slow part."""
    key = (config, dtype)
    if key not in _MODELS:
        _MODELS[key] = build_models(config, dtype, "cpu")[0]
    return _MODELS[key]


def ort_session(path, level="disabled"):
    return ort.InferenceSession(str(path), session_options(level, threads=2), providers=["CPUExecutionProvider"])


def reference_case(model, config, dtype, padding):
    """Inputs and reference output, cached: the float16 reference on the CPU is the slow part."""
    key = (config, dtype, padding)
    if key not in _EXPECTED:
        x, mask = generate_case(config, "cpu", dtype, 1234, padding_ratio=padding)
        with torch.inference_mode():
            _EXPECTED[key] = (x, mask, model(x, mask))
    return _EXPECTED[key]


def strict_reports(session, model, config, dtype):
    """Strict reports of the ORT output against the reference, all-valid and padded."""
    reports = {}
    for padding in PADDINGS:
        x, mask, expected = reference_case(model, config, dtype, padding)
        (y,) = session.run(["y"], {"x": x.numpy(), "valid_token_mask": mask.numpy()})
        y = torch.from_numpy(y)
        assert torch.equal(y[~mask], torch.zeros_like(y[~mask])), "invalid rows must be exactly 0"
        reports[padding] = compare_outputs(expected, y, *STRICT)
    return reports


def export_small(tmp_path, dtype=torch.float32, options=ExportOptions(), config=SMALL, name="model.onnx"):
    model = reference_model(config, dtype)
    path = tmp_path / name
    return model, path, export_onnx(model, config, dtype, path, options)


# -- export info -------------------------------------------------------------------------
def test_export_info_matches_file_and_weights(tmp_path):
    model, path, info = export_small(tmp_path, torch.float16)
    assert info["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    assert info["weights_sha256"] == weights_sha256(model)
    graph = onnx.load(str(path))
    assert sum(info["op_histogram"].values()) == len(graph.graph.node)
    assert info["opset"] == graph.opset_import[0].version == ExportOptions().opset >= 17
    assert info["inputs"] == [{"name": "x", "dtype": "float16", "shape": [3, 16, 32]},
                              {"name": "valid_token_mask", "dtype": "bool", "shape": [3, 16]}]
    assert info["outputs"] == [{"name": "y", "dtype": "float16", "shape": [3, 16, 32]}]
    assert info["options"] == ExportOptions().to_dict() and info["dtype"] == "float16"
    assert not list(tmp_path.glob(".*.tmp"))  # the temporary name was renamed away
    # Deterministic: the same weights and options give the same bytes.
    assert export_onnx(model, SMALL, torch.float16, tmp_path / "again.onnx")["sha256"] == info["sha256"]


def test_graph_has_reference_rounding_points(tmp_path):
    _, path, info = export_small(tmp_path, torch.float16)
    hist = info["op_histogram"]
    layers = SMALL.num_layers
    assert hist["Softmax"] == layers and hist["Erf"] == layers and "Tanh" not in hist
    assert hist["Gemm"] == 6 * layers  # q, k, v, out, ffn_in, ffn_out: bias inside one GEMM
    assert hist["LayerNormalization"] == 2 * layers + 1
    assert hist["Where"] == 2 * layers + 1 + layers  # zeroed rows (2 per block + final) + score masks


def test_export_rejects_bad_requests(tmp_path):
    model = reference_model(SMALL, torch.float32)
    with pytest.raises(KKError, match="float32 and float16, not bfloat16"):
        export_onnx(model, SMALL, torch.bfloat16, tmp_path / "m.onnx")
    with pytest.raises(KKError, match="weights are float32 but the export dtype is float16"):
        export_onnx(model, SMALL, torch.float16, tmp_path / "m.onnx")
    with pytest.raises(KKError, match="opset >= 20"):
        ExportOptions(gelu="exact_op")
    with pytest.raises(KKError, match="unknown linear mode"):
        ExportOptions(linear="addmm")
    assert not (tmp_path / "m.onnx").exists()


def test_budget_refuses_before_building(tmp_path, monkeypatch):
    import exporters.export as export_module

    monkeypatch.setattr(export_module, "build_graph", lambda *a, **k: pytest.fail("graph built over budget"))
    big = TransformerConfig(2, 4096, 64, 8, 64, 1)
    assert not dense_attention_bytes_ok(big, torch.float16, budget_bytes=(1 << 30) - 1)
    assert dense_attention_bytes_ok(official_config(13), torch.float16)
    with pytest.raises(DenseAttentionTooLarge, match=r"1073741824 bytes.*kkdeploy check --shape 14 --reduced"):
        export_onnx(None, big, torch.float16, tmp_path / "m.onnx", memory_budget_bytes=(1 << 30) - 1)
    assert not (tmp_path / "m.onnx").exists()


# -- graph check ---------------------------------------------------------------------------
def node_named(graph: onnx.ModelProto, name: str) -> onnx.NodeProto:
    return next(n for n in graph.graph.node if n.name == name)


def test_graph_check_rejects_tanh_gelu_chain(tmp_path):
    model = reference_model(SMALL, torch.float32)
    with pytest.raises(GraphCheckError, match=r"node layers\.0\.gelu/Tanh \(Tanh\).*tanh-approximate"):
        export_onnx(model, SMALL, torch.float32, tmp_path / "m.onnx", ExportOptions(gelu="tanh"))
    assert not (tmp_path / "m.onnx").exists()  # a failing graph never reaches the path


def test_graph_check_rejects_gelu_op_with_tanh(tmp_path):
    _, path, _ = export_small(tmp_path, options=ExportOptions(gelu="exact_op", opset=20))
    graph = onnx.load(str(path))
    check_graph(graph, SMALL, torch.float32)
    node = node_named(graph, "layers.1.gelu/Gelu")
    node.attribute[0].s = b"tanh"
    with pytest.raises(GraphCheckError, match=r"node layers\.1\.gelu/Gelu \(Gelu\)"):
        check_graph(graph, SMALL, torch.float32)


def test_graph_check_rejects_fp16_softmax(tmp_path):
    _, path, _ = export_small(tmp_path, torch.float16)
    graph = onnx.load(str(path))
    softmax = node_named(graph, "layers.0.attention/Softmax")
    cast = node_named(graph, "layers.0.attention/softmax_in/Cast")
    softmax.input[0] = cast.input[0]  # feed the float16 scores straight in
    with pytest.raises(GraphCheckError, match=r"node layers\.0\.attention/Softmax \(Softmax\) runs on FLOAT16"):
        check_graph(graph, SMALL, torch.float16)


def test_graph_check_rejects_fp16_layernorm_statistics(tmp_path):
    _, path, _ = export_small(tmp_path, torch.float16, options=ExportOptions(fp32_pointwise=False))
    graph = onnx.load(str(path))
    check_graph(graph, SMALL, torch.float16)  # native: float16 input, stash_type=1 is allowed
    node = node_named(graph, "final_norm/LayerNormalization")
    next(a for a in node.attribute if a.name == "stash_type").i = 0
    with pytest.raises(GraphCheckError, match=r"node final_norm/LayerNormalization .*FP32 statistics"):
        check_graph(graph, SMALL, torch.float16)


def test_graph_check_rejects_dynamic_dims_and_wrong_io(tmp_path):
    _, path, _ = export_small(tmp_path)
    graph = onnx.load(str(path))
    graph.graph.input[0].type.tensor_type.shape.dim[0].dim_param = "batch"
    with pytest.raises(GraphCheckError, match=r"x:FLOAT\['batch', 16, 32\]"):
        check_graph(graph, SMALL, torch.float32)
    with pytest.raises(GraphCheckError, match="expected"):
        check_graph(str(path), SMALL, torch.float16)  # a float32 graph is not a float16 export
    graph = onnx.load(str(path))
    node_named(graph, "layers.0.attention/q/SplitHeads").input[1] = "valid_token_mask"  # shape from data
    with pytest.raises(GraphCheckError):
        check_graph(graph, SMALL, torch.float32)


# -- ONNX Runtime CPU parity -------------------------------------------------------------------
def test_float32_variants_without_casts_are_identical(tmp_path):
    """Same nodes and weights (only the recorded options in the metadata differ)."""
    def graph_bytes(variant):
        path = export_small(tmp_path, options=OPTION_VARIANTS[variant], name=f"{variant}.onnx")[1]
        return onnx.load(str(path)).graph.SerializeToString()

    default = graph_bytes("default")
    assert all(graph_bytes(v) == default for v in FLOAT32_SAME_AS_DEFAULT)
    assert graph_bytes("fp32_linear") != default


@pytest.mark.parametrize("variant", [v for v in OPTION_VARIANTS if v not in FLOAT32_SAME_AS_DEFAULT])
@pytest.mark.parametrize("config_name", list(CONFIGS))
def test_ort_cpu_parity_float32(tmp_path, config_name, variant):
    """Every variant, every config, all-valid and padded: zero strict failures (ORT_DISABLE_ALL)."""
    config = CONFIGS[config_name]
    model = reference_model(config, torch.float32)
    path = tmp_path / "model.onnx"
    export_onnx(model, config, torch.float32, path, OPTION_VARIANTS[variant])
    for padding, report in strict_reports(ort_session(path), model, config, torch.float32).items():
        assert report.passed, f"padding {padding}: {report.summary()} worst {report.worst_index}"


@pytest.mark.parametrize("level", ["disabled", "basic", "extended", "all"])
@pytest.mark.parametrize("variant", ["default", "fp32_linear"])
def test_ort_optimizer_levels_keep_float32_parity(tmp_path, level, variant):
    """Records which ORT optimizer levels keep CPU parity in float32 (shape 3): every level does."""
    config = CONFIGS["shape3"]
    model = reference_model(config, torch.float32)
    path = tmp_path / "model.onnx"
    export_onnx(model, config, torch.float32, path, OPTION_VARIANTS[variant])
    for padding, report in strict_reports(ort_session(path, level), model, config, torch.float32).items():
        assert report.passed, f"level {level} padding {padding}: {report.summary()}"


@pytest.mark.parametrize("variant", ["default", "fp32_linear", "native_pointwise"])
@pytest.mark.parametrize("config_name", list(CONFIGS))
def test_ort_cpu_parity_float16(tmp_path, config_name, variant):
    """float16 on the CPU EP: strict parity where ORT runs the graph as written.

    ORT's CPU EP has no float16 kernel for some ops; it then runs them in FP32 behind inserted
    Casts instead of refusing. A failure in that case is a statement about ORT's CPU EP, not the
    graph, so the test skips with the ops ORT moved to FP32 and the measured counts.
    """
    config = CONFIGS[config_name]
    model = reference_model(config, torch.float16)
    path = tmp_path / "model.onnx"
    export_onnx(model, config, torch.float16, path, OPTION_VARIANTS[variant])
    reports = strict_reports(ort_session(path), model, config, torch.float16)
    failed = {p: r.failed for p, r in reports.items()}
    if not any(failed.values()):
        return
    fallback = float32_fallback_nodes(path)
    if fallback:
        ops = ", ".join(f"{op} x{len(names)}" for op, names in fallback.items())
        pytest.skip(f"ONNX Runtime {ort.__version__} CPU EP has no float16 kernel for {ops}: its "
                    f"InsertCastTransformer runs them in FP32 (InsertedPrecisionFreeCast_*), so the float16 graph "
                    f"is not executed as written; strict failures (padding -> elements): {failed} of "
                    f"{reports[0.0].total}")
    pytest.fail(f"float16 strict failures with every node on its float16 kernel: {failed}")


# -- CLI ---------------------------------------------------------------------------------------
SMALL_FLAGS = ["--batch-size", "2", "--seq-len", "8", "--d-model", "16", "--heads", "2", "--ffn-dim", "16",
               "--layers", "1"]


def test_export_cli_writes_model_and_info(tmp_path, capsys):
    out = tmp_path / "exp"
    assert main(["export", *SMALL_FLAGS, "--dtype", "float16", "--linear", "fp32", "--qkv", "packed",
                 "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["export.json", "model.onnx"]
    info = json.loads((out / "export.json").read_text())
    assert info["sha256"] == hashlib.sha256((out / "model.onnx").read_bytes()).hexdigest()
    assert info["options"]["linear"] == "fp32" and info["options"]["qkv"] == "packed"
    assert info["dtype"] == "float16" and info["config"]["seq_len"] == 8 and info["shape_id"] is None
    model = build_models(TransformerConfig(2, 8, 16, 2, 16, 1), torch.float16, "cpu")[0]
    assert info["weights_sha256"] == weights_sha256(model)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging left behind
    check_graph(out / "model.onnx", TransformerConfig(2, 8, 16, 2, 16, 1), torch.float16)


def test_export_cli_non_empty_dir_needs_force(tmp_path, capsys):
    out = tmp_path / "exp"
    out.mkdir()
    (out / "keep.txt").write_text("user data")
    assert main(["export", *SMALL_FLAGS, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "not empty" in err and "--force" in err and "Traceback" not in err
    assert (out / "keep.txt").read_text() == "user data"
    assert main(["export", *SMALL_FLAGS, "--out", str(out), "--force"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["export.json", "model.onnx"]


def test_export_cli_bad_input_is_one_line(tmp_path, capsys, monkeypatch):
    import kkdeploy.commands.export as export_cmd

    monkeypatch.setattr(export_cmd, "build_models", lambda *a, **k: pytest.fail("model built for a refused request"))
    assert main(["export", "--shape", "14", "--out", str(tmp_path / "s14")]) == 2
    err = capsys.readouterr().err
    assert "20480000000000 bytes" in err and "kkdeploy check --shape 14 --reduced" in err
    assert main(["export", *SMALL_FLAGS, "--memory-budget-gb", "0.0000001", "--out", str(tmp_path / "b")]) == 2
    assert "budget" in capsys.readouterr().err
    assert main(["export", *SMALL_FLAGS, "--dtype", "bfloat16", "--out", str(tmp_path / "d")]) == 2
    assert "float32 and float16" in capsys.readouterr().err
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert main(["export", *SMALL_FLAGS, "--out", str(blocker / "sub")]) == 2
    err = capsys.readouterr().err
    assert "cannot write" in err and err.count("\n") == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]
