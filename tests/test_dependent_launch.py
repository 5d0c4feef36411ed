"""Programmatic dependent launches (kkdeploy/kernels/dependent_launch.py): the "-pdl" candidates, the launch options
our kernels take inside ``dependent_launches``, the refusals off Hopper, and the PDL form's arithmetic, compiled for
sm_90a here (no GPU) and compared instruction by instruction with the proven plain form."""

from __future__ import annotations

import json

import pytest
import torch

from kkdeploy.errors import KKError
from kkdeploy.kernels import dependent_launch
from kkdeploy.kernels.dependent_launch import dependent_launches, launch_options, ptx_difference, refusal
from tests.conftest import load_script


def test_the_pdl_suffix_is_part_of_the_candidate_grammar():
    from engines.recipe import parse

    for name in ("torch-compile-pdl", "torch-compile-sdpa1-pdl", "torch-compile-faithful-attention-pdl",
                 "torch-compile-faithful-kernels-pdl", "torch-compile-faithful-gemms-pdl"):
        recipe = parse(name)
        assert recipe.dependent_launch and recipe.name == name and "dependent launches" in recipe.describe()
    assert not parse("torch-compile-faithful-gemms").dependent_launch
    for name in ("torch-compile-fused-pdl", "ort-cuda-pdl", "torch-graph-pdl"):
        with pytest.raises(KKError, match="-pdl applies to torch-compile's faithful graphs"):
            parse(name)


def test_a_pdl_candidate_keeps_its_graph_kernels_and_smaller_sibling():
    from engines.torch_compile import dependent_launch_refusal, inductor_variant, kernel_kinds, uses_dependent_launch

    assert kernel_kinds("torch-compile-faithful-gemms-pdl") == kernel_kinds("torch-compile-faithful-gemms")
    assert inductor_variant("torch-compile-sdpa1-pdl") == inductor_variant("torch-compile-sdpa1") == "inductor-sdpa1"
    assert uses_dependent_launch("torch-compile-pdl") and not uses_dependent_launch("torch-compile")
    why = dependent_launch_refusal("torch-compile-faithful-gemms-pdl", torch.device("cpu"))
    assert "CUDA feature" in why and why.endswith("torch-compile-faithful-gemms is the same graph with plain launches")
    assert dependent_launch_refusal("torch-compile-faithful-gemms", torch.device("cpu")) is None


def test_launch_options_exist_only_inside_the_context(monkeypatch):
    monkeypatch.setattr(dependent_launch, "INTERPRET", False)
    assert launch_options() == {}
    with dependent_launches(True):
        assert launch_options() == {"PDL": True, "launch_pdl": True}
        with dependent_launches(False):
            assert launch_options() == {}
        assert dependent_launch.enabled()
    assert launch_options() == {} and not dependent_launch.enabled()
    monkeypatch.setattr(dependent_launch, "INTERPRET", True)  # the interpreter has no grids to overlap
    with dependent_launches(True):
        assert launch_options() == {}


def _capture_launches(monkeypatch, module) -> list[dict]:
    launches: list[dict] = []
    monkeypatch.setattr(module, "INTERPRET", False)
    monkeypatch.setattr(dependent_launch, "INTERPRET", False)
    monkeypatch.setattr(module, "launch_kernel", lambda kernel, grid, *args, **kwargs: launches.append(kwargs))
    return launches


def test_our_gemm_and_attention_launch_as_pdl_inside_the_context(monkeypatch):
    """What the custom ops hand Triton: PDL and launch_pdl inside ``dependent_launches(True)``, neither outside."""
    from kkdeploy.kernels import _faithful_attention_triton as attention
    from kkdeploy.kernels import _fused_linear_triton as linear

    x, w, b = torch.zeros(64, 32, dtype=torch.float16), torch.zeros(32, 32, dtype=torch.float16), torch.zeros(32)
    gemm = _capture_launches(monkeypatch, linear)
    linear.triton_linear(x, w, b)
    with dependent_launches(True):
        linear.triton_linear(x, w, b)
    assert "PDL" not in gemm[0] and "launch_pdl" not in gemm[0]
    assert gemm[1]["PDL"] is True and gemm[1]["launch_pdl"] is True
    assert {k: v for k, v in gemm[1].items() if k not in ("PDL", "launch_pdl")} == gemm[0]  # nothing else moves

    q = torch.zeros(1, 16, 32, dtype=torch.float16)
    attn = _capture_launches(monkeypatch, attention)
    attention.triton_attention(q, q, q, None, 2, True)
    with dependent_launches(True):
        attention.triton_attention(q, q, q, None, 2, True)
    assert "PDL" not in attn[0] and attn[1]["PDL"] is True and attn[1]["launch_pdl"] is True


def test_refusals_name_the_reason_in_one_line(monkeypatch):
    assert "CUDA feature" in refusal("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    why = refusal("cuda")
    assert "compute capability 9.0" in why and "8.0" in why and "\n" not in why
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert refusal("cuda") is None  # Triton 3.6 (the test extra) has gdc_wait and launch_pdl
    assert dependent_launch.inductor_options() == {"triton.enable_pdl": True}


def test_a_pdl_candidate_is_refused_on_the_cpu_with_its_plain_form_named():
    from engines.torch_compile import CompiledRunner
    from kkdeploy.config import TransformerConfig

    config = TransformerConfig(batch_size=1, seq_len=8, d_model=16, num_heads=2, ffn_dim=16, num_layers=1)
    with pytest.raises(KKError, match=r"torch-compile-pdl: programmatic dependent launch is a CUDA feature.*"
                                      r"torch-compile is the same graph with plain launches$"):
        CompiledRunner(torch.nn.Module(), config, torch.float32, torch.device("cpu"), name="torch-compile-pdl")


def test_build_and_bench_record_a_pdl_candidate_skipped_on_the_cpu(tmp_path):
    from kkdeploy.cli import main

    dims = ["--batch-size", "1", "--seq-len", "8", "--d-model", "16", "--heads", "2", "--ffn-dim", "16",
            "--layers", "1", "--device", "cpu"]
    assert main(["build", *dims, "--backends", "torch-compile-pdl", "--out", str(tmp_path / "a")]) == 0
    manifest = json.loads((tmp_path / "a" / "manifest.json").read_text())
    entry = next(c for c in manifest["candidates"] if c["name"] == "torch-compile-pdl")
    assert entry["status"] == "skipped" and "CUDA feature" in entry["reason"]
    assert manifest["choice"]["candidate"] == "pytorch-fallback"

    assert main(["bench", *dims, "--candidates", "torch-compile-pdl", "--processes", "1", "--rounds", "1",
                 "--warmups", "1", "--repeats", "2", "--out", str(tmp_path / "b")]) == 0
    shape = json.loads((tmp_path / "b" / "bench.json").read_text())["shapes"][0]
    assert shape["backends"]["torch-compile-pdl"]["status"] == "skipped"


def test_the_summary_pairs_each_candidate_with_its_pdl_form(tmp_path):
    script = load_script("bench_summary")
    backends = {"eager": {"status": "reference", "median_ms": 1.0},
                "torch-compile": {"status": "passed", "median_ms": 0.12, "speedup": 8.3},
                "torch-compile-pdl": {"status": "passed", "median_ms": 0.10, "speedup": 10.0},
                "torch-compile-faithful-gemms": {"status": "passed", "median_ms": 0.11, "speedup": 9.1},
                "torch-compile-faithful-gemms-pdl": {"status": "failed", "median_ms": 0.09, "speedup": 11.1}}
    text = script.dependent_launch_pairs([{"label": "shape-03", "backends": backends}])
    assert "| shape-03 | torch-compile | 0.12 (passed) | 0.1 (passed) | 1.200 |" in text
    assert "| shape-03 | torch-compile-faithful-gemms | 0.11 (passed) | 0.09 (failed) | - |" in text  # failed: no ratio
    assert "geomean 1.200" in text and "(1 pair(s))" in text
    assert script.dependent_launch_pairs([{"label": "s", "backends": {"torch-compile": backends["torch-compile"]}}]) == ""


PDL_FORMS = [("linear", {}, 8, 3),  # the plain GEMM's default launch
             ("linear", {"EPILOGUE": 5, "BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, "LN_RELOAD": True}, 8, 3),
             ("attention", {"BLOCK_M": 64, "NCACHED": 4, "FAST_DIV": True}, 4, 3),  # cached64w4_mdiv
             ("linear_tma", {}, 8, 4),  # the TMA tile
             ("ffn", {"LN_RELOAD": False}, 8, 2)]  # the feed-forward launch's "regs" tile


@pytest.mark.parametrize("kernel,constexprs,warps,stages", PDL_FORMS,
                         ids=["gemm", "gemm-layer-norm", "attention", "gemm-tma", "feed-forward"])
def test_the_pdl_form_has_the_proven_forms_arithmetic_on_sm90(kernel, constexprs, warps, stages):
    """Compiled here for sm_90a with this Triton (3.6.0, as on the H200): the same instructions, as many of each, and
    the same floating-point and MMA instructions in the same order, plus the two griddepcontrol instructions."""
    pytest.importorskip("triton")
    script = load_script("offline_ptx")
    values = {**script.KERNELS[kernel][3], **constexprs}
    plain = script.compile_ptx(kernel, values, warps, stages)
    dependent = script.compile_ptx(kernel, {**values, "PDL": True}, warps, stages)
    assert "griddepcontrol" not in plain
    assert "griddepcontrol.wait" in dependent and "griddepcontrol.launch_dependents" in dependent
    assert ptx_difference(plain, dependent) == []
    if kernel == "linear" and not constexprs:  # the comparison sees a real change: another epilogue's arithmetic
        other = script.compile_ptx(kernel, {**values, "EPILOGUE": 1}, warps, stages)
        assert ptx_difference(plain, other)


@pytest.mark.skipif(__import__("shutil").which("nvcc") is None, reason="nvcc is not on PATH on this machine")
def test_the_rows_layer_norm_pdl_form_has_the_same_arithmetic_for_sm90(tmp_path):
    """The rows LayerNorm (CUDA C++) compiled to PTX for sm_90 with the build's nvcc flags: each launch's PDL
    instantiation is its plain one plus the two griddepcontrol instructions, and the library's entry point takes the
    pdl flag."""
    from kkdeploy.kernels import layer_norm
    from tests.conftest import LAYER_NORM_KERNELS, layer_norm_ptx_entries

    kernels = layer_norm_ptx_entries(tmp_path)
    assert sorted(kernels) == sorted(f"{k}<{f}>" for k in LAYER_NORM_KERNELS for f in ("pdl", "plain"))
    for launch in LAYER_NORM_KERNELS:
        plain, dependent = kernels[f"{launch}<plain>"], kernels[f"{launch}<pdl>"]
        assert "griddepcontrol" not in plain
        assert dependent.count("griddepcontrol.wait") == 1 and dependent.count("griddepcontrol.launch_dependents") == 1
        assert ptx_difference(plain, dependent) == [], launch
    assert "int pdl" in layer_norm.SOURCE.read_text()


def test_the_compiled_runner_holds_dependent_launches_around_its_calls(monkeypatch):
    """What a -pdl runner's compile, capture and uncaptured calls run inside (the custom ops read it when they
    launch); a plain runner's run outside it."""
    from engines.torch_compile import CompiledModuleRunner

    monkeypatch.setattr(dependent_launch, "INTERPRET", False)
    seen = []
    for flag in (True, False):
        runner = CompiledModuleRunner.__new__(CompiledModuleRunner)  # the wiring only: no compile
        runner.dependent_launch = flag
        runner.compiled = lambda x, mask: seen.append((dependent_launch.enabled(), torch.is_inference_mode_enabled()))
        runner._forward(torch.zeros(1), torch.ones(1, dtype=torch.bool))
    assert seen == [(True, True), (False, True)]
    assert not dependent_launch.enabled()
