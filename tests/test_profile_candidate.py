"""scripts/profile_candidate.py: where a candidate's time goes, by kernel class (run on the CPU here)."""

from __future__ import annotations

import json

import pytest

from kkdeploy.models.fused import EMULATED
from tests.conftest import load_script


@pytest.fixture(scope="module")
def profiler():
    return load_script("profile_candidate")


@pytest.mark.parametrize("name, cls", [
    ("sm90_xmma_gemm_f16f16_f32f32_f32_tn_n_tilesize128x128x64", "gemm"),
    ("nvjet_hsh_128x256_64x4_1x2_h_bz_coopA_NTN", "gemm"),
    ("void cutlass::Kernel2<cutlass_80_tensorop_s1688gemm_64x64_16x6_tn_align4>(Params)", "gemm"),
    ("fmha_cutlassF_f16_aligned_64x64_rf_sm80(PyTorchMemEffAttention::AttentionKernel)", "attention"),
    ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<32, 128, 128, 4, cutlass::half_t>>", "attention"),
    ("triton_poi_fused__to_copy_add_native_layer_norm_0", "triton"),
    ("void at::native::elementwise_kernel<128, 2, direct_copy_kernel_cuda>", "copy/cast"),
    ("Memcpy DtoD (Device -> Device)", "copy/cast"),
    ("aten::addmm", "gemm"),
    ("aten::_scaled_dot_product_flash_attention_for_cpu", "attention"),
    ("aten::native_layer_norm", "layer norm"),
    ("layer_norm_rows2_f16_kernel", "layer norm"),
    ("_fused_linear_kernel", "gemm"),
    ("_faithful_attention_kernel", "attention"),
    ("aten::_softmax", "other"), ("causal_block_softmax_kernel", "attention"),
])
def test_kernel_class(profiler, name, cls):
    assert profiler.kernel_class(name) == cls


def test_profiles_eager_and_the_fused_candidate_on_the_cpu(profiler, tmp_path, capsys):
    out = tmp_path / "prof"
    code = profiler.main(["--shape", "3", "--device", "cpu", "--candidate", "fused-half-gemm", "--calls", "2",
                          "--warmups", "1", "--out", str(out)])
    assert code == 0
    report = json.loads((out / "profile.json").read_text())
    assert report["shape_id"] == 3 and report["dtype"] == "float32" and report["tf32"] is False
    assert report["candidate_info"]["fused-half-gemm"]["half_gemm_kernel"] == EMULATED  # the candidate bench would run here
    eager, fused = report["backends"]["eager"], report["backends"]["fused-half-gemm"]
    for result in (eager, fused):
        classes = result["classes_ms_per_call"]
        assert set(classes) == set(profiler.CLASSES)
        assert sum(classes.values()) == pytest.approx(result["kernel_ms_per_call"])
        assert classes["gemm"] > 0
        assert json.loads((out / result["trace"]).read_text())["traceEvents"]
        times = [r["ms_per_call"] for r in result["kernels"]]
        assert times == sorted(times, reverse=True)
    # the fused model attends through SDPA in every block; the reference computes scores with bmm + softmax
    assert fused["classes_ms_per_call"]["attention"] > 0
    assert eager["classes_ms_per_call"]["attention"] == 0
    assert {r["name"] for r in eager["kernels"]} >= {"aten::bmm", "aten::_softmax"}
    # a CPU profile has no device kernels to lay out as a timeline: said, not guessed (trace_gaps on a GPU)
    assert "no device kernels" in fused["timeline"]["unavailable"]
    assert "eager vs fused-half-gemm" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["--shape", "99"], "unknown shape id 99"),
    (["--shape", "14"], "shape 14 is long-context"),
    (["--shape", "3", "--candidate", "tensorrt"], "unknown bench candidate"),
    (["--shape", "3", "--calls", "0"], "--calls must be >= 1"),
    (["--dims", "2,16,32"], "--dims takes six integers B,S,D,H,F,L"),
    (["--dims", "2,16,33,2,64,2"], "d_model 33 is not divisible by num_heads 2"),
    (["--dims", "2,16,32,2,64,2", "--weights", "/nonexistent.safetensors"], "does not exist"),
])
def test_bad_arguments_get_one_line(profiler, tmp_path, capsys, argv, message):
    assert profiler.main(argv + ["--device", "cpu", "--out", str(tmp_path / "p")]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1
    assert not (tmp_path / "p").exists()


def test_profiles_a_custom_shape_with_a_weights_file_and_two_candidates(profiler, tmp_path, capsys):
    """What a user's own model would run: --dims and --weights, several candidates beside one eager run."""
    import torch

    from kkdeploy.config import TransformerConfig
    from kkdeploy.models.weights import build_models

    config = TransformerConfig(batch_size=2, seq_len=16, d_model=32, num_heads=2, ffn_dim=64, num_layers=2)
    reference, _ = build_models(config, torch.float32, torch.device("cpu"), seed=77)
    weights = tmp_path / "w.pt"
    torch.save(reference.state_dict(), weights)
    out = tmp_path / "prof"
    code = profiler.main(["--dims", "2,16,32,2,64,2", "--weights", str(weights), "--device", "cpu",
                          "--candidate", "fused,fused-half-gemm", "--calls", "2", "--warmups", "1", "--out", str(out)])
    assert code == 0
    report = json.loads((out / "profile.json").read_text())
    assert report["shape_id"] is None and report["weights"] == str(weights)
    assert report["config"]["d_model"] == 32 and report["config"]["num_layers"] == 2
    assert list(report["backends"]) == ["eager", "fused", "fused-half-gemm"]
    assert set(report["candidate_info"]) == {"fused", "fused-half-gemm"}
    assert "custom shape" in capsys.readouterr().out


def test_a_candidate_that_cannot_run_here_is_recorded_and_the_others_are_profiled(profiler, tmp_path, capsys):
    """One refusal (here a CUDA feature on the CPU) must not cost the other candidates' profiles: on the GPU an
    unproven our-kernel candidate is refused the same way."""
    out = tmp_path / "prof"
    code = profiler.main(["--dims", "2,16,32,2,64,2", "--device", "cpu", "--candidate", "torch-compile-pdl,fused",
                          "--calls", "2", "--warmups", "1", "--out", str(out)])
    assert code == 0
    report = json.loads((out / "profile.json").read_text())
    assert list(report["backends"]) == ["eager", "fused"]
    assert "dependent launch" in report["skipped"]["torch-compile-pdl"]
    assert "torch-compile-pdl: skipped:" in capsys.readouterr().out


def test_when_no_candidate_can_run_the_error_is_one_line_naming_each_reason(profiler, tmp_path, capsys):
    assert profiler.main(["--dims", "2,16,32,2,64,2", "--device", "cpu", "--candidate", "torch-compile-pdl",
                          "--out", str(tmp_path / "p")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: none of the candidates can run here (torch-compile-pdl: skipped:")
    assert len(err.splitlines()) == 1 and not (tmp_path / "p").exists()
