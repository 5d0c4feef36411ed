"""The in-process torch.compile candidate: faithful on the CPU, cache file, load-time fingerprint."""

from __future__ import annotations

import json

import pytest
import torch

from engines.base import AllValidRouter, BuildContext, Runner
from engines.base import FINGERPRINT_PADDING
from engines.torch_compile import BACKEND, CompiledRunner, inductor_variant, output_fingerprint
from kkdeploy.config import TransformerConfig
from kkdeploy.errors import KKError
from kkdeploy.inputs import generate_case
from kkdeploy.models.weights import build_models
from validation.strict import compare_outputs, contract
from tests.test_inductor import CPU, TINY, assert_load_serves_bitwise, padded_case

pytestmark = pytest.mark.skipif(BACKEND.unavailable_reason(CPU, torch.float32) is not None,
                                reason=str(BACKEND.unavailable_reason(CPU, torch.float32)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_compiled_graph_is_bitwise_equal_to_the_reference(dtype):
    reason = BACKEND.unavailable_reason(CPU, dtype)
    if reason:
        pytest.skip(reason)
    reference, _ = build_models(TINY, dtype, CPU)
    runner = CompiledRunner(reference, TINY, dtype, CPU)
    assert not runner.all_valid_only
    for x, mask in (generate_case(TINY, CPU, dtype, 3), padded_case(dtype, 4)):
        with torch.no_grad():
            y = runner(x, mask)
            assert torch.equal(y, reference(x, mask))
        assert runner(x, mask).data_ptr() != y.data_ptr()


def test_sdpa_variant_refuses_padded_calls():
    reference, _ = build_models(TINY, torch.float32, CPU)
    runner = CompiledRunner(reference, TINY, torch.float32, CPU, name="torch-compile-sdpa1")
    assert runner.all_valid_only
    x, mask = padded_case(torch.float32, 5)
    with pytest.raises(KKError, match="all-valid masks only"):
        runner(x, mask)
    x, mask = generate_case(TINY, CPU, torch.float32, 6, padding_ratio=0.0)
    _, optimized = build_models(TINY, torch.float32, CPU, sdpa_layers=1)
    with torch.no_grad():
        torch.testing.assert_close(runner(x, mask), optimized(x, mask), rtol=1e-5, atol=1e-5)


class ScaledRunner(Runner):
    """``x * scale`` with padded rows zeroed: a runner whose output says which route served it."""

    def __init__(self, scale: float):
        super().__init__(TINY, torch.float32, CPU)
        self.scale = scale

    def infer(self, x, mask):
        return (x * self.scale).masked_fill(~mask[..., None], 0)


def test_router_serves_each_mask_by_content_and_the_fingerprint_sees_both_routes():
    router = AllValidRouter(ScaledRunner(2.0), ScaledRunner(3.0))
    x, mask = padded_case(torch.float32, 5)
    assert torch.equal(router(x, mask), (x * 3).masked_fill(~mask[..., None], 0))
    for all_valid in (None, torch.ones_like(mask)):
        assert torch.equal(router(x, all_valid), x * 2)
    wrong_padded = AllValidRouter(ScaledRunner(2.0), ScaledRunner(4.0))

    def fingerprint(runner, ratios):
        return output_fingerprint(runner, TINY, torch.float32, CPU, padding_ratios=ratios)

    # the all-valid case alone cannot tell the two apart; with the padded case it can
    assert fingerprint(router, FINGERPRINT_PADDING[:1]) == fingerprint(wrong_padded, FINGERPRINT_PADDING[:1])
    assert fingerprint(router, FINGERPRINT_PADDING) != fingerprint(wrong_padded, FINGERPRINT_PADDING)


def test_variant_names_are_checked():
    assert inductor_variant("torch-compile") == "inductor"
    assert inductor_variant("torch-compile-sdpa2") == "inductor-sdpa2"
    reference, _ = build_models(TINY, torch.float32, CPU)
    ctx = BuildContext(TINY, torch.float32, CPU, reference, out_dir=None, options={})
    assert BACKEND.candidates(ctx) == ["torch-compile"]
    for bad in ("torch-compile-sdpa3", "torch-compile-fast"):
        ctx.options["torch_compile_variants"] = bad
        with pytest.raises(KKError, match=bad.split("-")[-1]):
            BACKEND.candidates(ctx)


@pytest.fixture(scope="module")
def shipped(tmp_path_factory):
    from kkdeploy.pipeline.build import BuildRequest, run_build

    out = tmp_path_factory.mktemp("compiled") / "artifacts"

    def no_second_compile(*args, **kwargs):
        raise AssertionError("the build compiled its candidate again to load it")

    with pytest.MonkeyPatch.context() as patch:  # the build validates the runner it compiled, as it is
        patch.setattr(BACKEND, "load", no_second_compile)
        run_build(BuildRequest(TINY, torch.float32, CPU, out, backends=["torch-compile"], trials=2,
                               warmups=1, repeats=3, rounds=1))
    manifest = json.loads((out / "manifest.json").read_text())
    entry = next(c for c in manifest["candidates"] if c["name"] == "torch-compile")
    assert entry["status"] == "passed", entry
    assert entry["options"]["cache_file"] in manifest["files"]
    assert len(entry["options"]["fingerprint"]["sha256"]) == 64
    assert entry["options"]["fingerprint"]["padding_ratios"] == [0.0, 0.25]  # it serves padded calls too
    # Pin the choice: which of engine and fallback timed faster on a shared CPU is not the subject here.
    manifest["choice"] = {**manifest["choice"], "candidate": "torch-compile", "backend": "torch_compile",
                          "all_valid_only": False}
    (out / "manifest.json").write_text(json.dumps(manifest))
    return out, manifest


def test_load_recompiles_and_serves_bitwise(shipped):
    assert_load_serves_bitwise(shipped[0], "torch-compile")


@pytest.mark.parametrize("field,value,message", [
    ("fingerprint", {"seed": 1234, "sha256": "0" * 64}, "does not reproduce the validated output"),
    ("torch", "0.0.0+other", "compiled with torch 0.0.0+other"),
])
def test_load_refuses_what_it_cannot_reproduce(shipped, field, value, message):
    import kkdeploy

    out, manifest = shipped
    edited = json.loads(json.dumps(manifest))
    for entry in edited["candidates"]:
        if entry["name"] == "torch-compile":
            entry["options"][field] = value
    (out / "manifest.json").write_text(json.dumps(edited))
    try:
        runner = kkdeploy.load(out, device="cpu")
        assert runner.backend != "torch-compile"
        assert message in runner.reason
        x, mask = generate_case(TINY, CPU, torch.float32, 9)
        reference, _ = build_models(TINY, torch.float32, CPU)
        with torch.no_grad():
            # the fallback (packed SDPA in the validated last layer) still serves a strict-passing answer
            assert compare_outputs(reference(x, mask), runner(x, mask), *contract("strict")).passed
    finally:
        (out / "manifest.json").write_text(json.dumps(manifest))


def test_cpu_outputs_are_the_callers_in_and_out_of_inference_mode():
    reference, _ = build_models(TINY, torch.float32, CPU)
    runner = CompiledRunner(reference, TINY, torch.float32, CPU)
    x, mask = generate_case(TINY, CPU, torch.float32, 11)
    y = runner(x, mask)
    assert not y.is_inference()
    y.add_(1)  # a normal tensor outside inference mode: in-place use works
    with torch.inference_mode():
        first = runner(x, mask)
        second = runner(x, mask)
    assert first.data_ptr() != second.data_ptr() and torch.equal(first, second)


def test_a_default_gpu_build_times_the_dependent_launch_graph_only_where_activations_are_small(monkeypatch, tmp_path):
    """Dependent launches were faster where launches dominate (small activations) and slower elsewhere: a default
    build compiles the "-pdl" GEMMs graph only for the former, and only where the GPU can launch dependently."""
    import engines.torch_compile as tc
    from engines.base import BuildContext

    cuda = torch.device("cuda")
    monkeypatch.setattr(tc, "pdl_refusal", lambda device: None)
    shape3 = TransformerConfig(batch_size=4, seq_len=128, d_model=128, num_heads=4, ffn_dim=128, num_layers=4)
    shape1 = TransformerConfig(batch_size=64, seq_len=128, d_model=128, num_heads=4, ffn_dim=128, num_layers=4)
    assert tc.dependent_launch_default(shape3, cuda, torch.float16)
    assert not tc.dependent_launch_default(shape1, cuda, torch.float16)  # 2 MiB per activation
    assert not tc.dependent_launch_default(shape3, cuda, torch.float32)
    assert not tc.dependent_launch_default(shape3, CPU, torch.float16)

    def candidates(config, options=None):
        ctx = BuildContext(config, torch.float16, cuda, None, tmp_path, options=options or {})
        return tc.BACKEND.candidates(ctx)

    assert candidates(shape3)[-2:] == [tc.GEMMS, f"{tc.GEMMS}-pdl"]
    assert f"{tc.GEMMS}-pdl" not in candidates(shape1)
    assert candidates(shape3, {"torch_compile_variants": tc.GEMMS}) == [tc.GEMMS]  # named variants: as named
    from kkdeploy.pipeline.bench import default_candidates

    assert default_candidates(cuda, torch.float16, "strict", shape3)[-1] == f"{tc.GEMMS}-pdl"  # the bench follows
    assert f"{tc.GEMMS}-pdl" not in default_candidates(cuda, torch.float16, "strict", shape1)
    monkeypatch.setattr(tc, "pdl_refusal", lambda device: "this GPU is 8.0")
    assert f"{tc.GEMMS}-pdl" not in candidates(shape3)


def test_fused_variants_are_float32_judge_defaults_on_cuda_only():
    from engines.torch_compile import FUSED, FUSED_VARIANTS, check_variant, default_variants

    cuda = torch.device("cuda")
    assert default_variants(cuda, torch.float32, "judge")[-4:] == list(FUSED_VARIANTS)
    assert FUSED not in default_variants(cuda, torch.float16, "strict")  # SDPA everywhere fails strict (§6)
    assert FUSED not in default_variants(cuda, torch.float32, "strict")
    assert default_variants(CPU, torch.float32, "judge") == ["torch-compile"]
    check_variant(FUSED, TINY, torch.float16)
    assert list(FUSED_VARIANTS) == ["torch-compile-fused", "torch-compile-fused-mixed", "torch-compile-fused-half-gemm",
                                    "torch-compile-fused-half-gemm-mixed"]
    for name in ("torch-compile-fused-mixed", "torch-compile-fused-half-gemm"):
        with pytest.raises(KKError, match="--dtype float32"):
            check_variant(name, TINY, torch.float16)


@pytest.fixture(scope="module")
def shipped_fused(tmp_path_factory):
    """``--backends torch-compile-fused``, float32, judge contract: the four fused candidates are built and validated."""
    from kkdeploy.pipeline.build import BuildRequest, run_build

    out = tmp_path_factory.mktemp("fused") / "artifacts"
    # named twice (as `--backends torch-compile,torch-compile-fused` does on a float32 judge GPU build): built once
    manifest = run_build(BuildRequest(TINY, torch.float32, CPU, out, backends=["torch-compile-fused"] * 2, trials=2,
                                      contract="judge", warmups=1, repeats=3, rounds=1))
    return out, manifest


def test_fused_build_calibrates_validates_and_records_its_recipe(shipped_fused):
    _, manifest = shipped_fused
    entries = {c["name"]: c for c in manifest["candidates"]}
    assert [c["name"] for c in manifest["candidates"]] == ["torch-compile-fused", "torch-compile-fused-mixed",
                                                           "torch-compile-fused-half-gemm",
                                                           "torch-compile-fused-half-gemm-mixed"]
    assert manifest["tf32"] is False  # float32 on the CPU: no TF32 there
    fused, half = entries["torch-compile-fused"], entries["torch-compile-fused-half-gemm"]
    assert fused["status"] == "passed" and fused["options"]["fp16_layers"] == []
    assert fused["options"]["inductor_configs"] == {} and fused["options"]["calibration"] is None
    assert fused["validation"]["max_abs"] < 1e-4  # float32 throughout: SDPA and fusion reorder float32 sums only
    assert not fused["options"]["half_gemm"] and half["options"]["half_gemm"]
    # float16 GEMM inputs: TF32-sized rounding, far above float32's reordering but inside the judge rule
    assert half["status"] == "passed" and half["validation"]["max_abs"] > 1e-4
    assert half["options"]["fp16_layers"] == [] and half["options"]["calibration"] is None
    assert half["options"]["half_gemm_kernel"] == "float32 GEMM of float16-rounded inputs"  # CPU: no tensor cores
    assert fused["options"]["half_gemm_kernel"] is None
    for name in ("torch-compile-fused-mixed", "torch-compile-fused-half-gemm-mixed"):
        mixed = entries[name]
        assert mixed["status"] == "passed" and mixed["options"]["mask_modes"] == ["all-valid", "padded"]
        calibration = mixed["options"]["calibration"]
        assert calibration["passed"] and mixed["options"]["fp16_layers"] == calibration["fp16_layers"]
        assert calibration["tried"][-1]["failed_elements"] == {"all-valid": 0, "padded": 0}
        assert "eager twin" in calibration["calibrated_on"]
        assert mixed["options"]["half_gemm"] == ("half-gemm" in name)


@pytest.mark.parametrize("name", ["torch-compile-fused", "torch-compile-fused-mixed", "torch-compile-fused-half-gemm"])
def test_fused_load_recompiles_and_serves_within_the_judge_rule(shipped_fused, name):
    import kkdeploy

    out, manifest = shipped_fused
    edited = json.loads(json.dumps(manifest))
    edited["choice"] = {**edited["choice"], "candidate": name, "backend": "torch_compile", "all_valid_only": False}
    (out / "manifest.json").write_text(json.dumps(edited))
    try:
        runner = kkdeploy.load(out, device="cpu")  # fingerprint checked: a refusal would serve the fallback
        assert runner.backend == name, runner.reason
        reference, _ = build_models(TINY, torch.float32, CPU)
        for x, mask in (generate_case(TINY, CPU, torch.float32, 7), padded_case(torch.float32, 8)):
            with torch.no_grad():
                assert compare_outputs(reference(x, mask), runner(x, mask), *contract("judge")).passed
    finally:
        (out / "manifest.json").write_text(json.dumps(manifest))


def test_fused_choice_in_a_float16_build_skips_the_variants_with_float16_inside(tmp_path):
    from engines.torch_compile import FUSED, FUSED_VARIANTS

    reference, _ = build_models(TINY, torch.float16, CPU)
    ctx = BuildContext(TINY, torch.float16, CPU, reference, out_dir=tmp_path,
                       candidate_filter=tuple(FUSED_VARIANTS))
    assert BACKEND.candidates(ctx) == [FUSED]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_faithful_attention_variant_is_one_kernel_op_per_block_and_bitwise(dtype):
    """torch-compile-faithful-attention: each block's attention core is one kkdeploy_faithful::attention
    call (no softmax left for Inductor), and its output equals the reference bit for bit, any mask."""
    from engines.inductor import export_variant

    reason = BACKEND.unavailable_reason(CPU, dtype)
    if reason:
        pytest.skip(reason)
    reference, _ = build_models(TINY, dtype, CPU)
    exported = export_variant(reference, TINY, dtype, CPU, inductor_variant("torch-compile-faithful-attention"),
                              kernel_attention=True)
    targets = [str(n.target) for n in exported.graph.nodes if n.op == "call_function"]
    assert sum("kkdeploy_faithful.attention" in t for t in targets) == TINY.num_layers
    assert not any("softmax" in t and "kkdeploy" not in t for t in targets)
    assert "attend" not in vars(reference.layers[0].attention)  # the swap lasted only while exporting
    runner = CompiledRunner(reference, TINY, dtype, CPU, name="torch-compile-faithful-attention")
    assert not runner.all_valid_only
    for x, mask in (generate_case(TINY, CPU, dtype, 3), padded_case(dtype, 4)):
        with torch.no_grad():
            assert torch.equal(runner(x, mask), reference(x, mask))


@pytest.mark.parametrize("masked_final", [False, True], ids=["final-apart", "final-masked"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_faithful_kernels_variant_swaps_every_layer_norm_for_the_rows_op_and_stays_bitwise(dtype, masked_final,
                                                                                           monkeypatch):
    """torch-compile-faithful-kernels: the attention op of -faithful-attention plus every LayerNorm as
    kkdeploy_faithful::layer_norm_rows, the final one with the reference's zero_invalid_rows as
    kkdeploy_faithful::layer_norm_rows_zero_invalid once builds take it (ATen's own ops off the proven GPU path, so
    bitwise here)."""
    from engines.inductor import export_variant
    from engines.torch_compile import KERNELS, kernel_paths_record, uses_kernel_layer_norm
    from kkdeploy.kernels import layer_norm

    monkeypatch.setattr(layer_norm, "MASKED_FINAL", masked_final)

    reason = BACKEND.unavailable_reason(CPU, dtype)
    if reason:
        pytest.skip(reason)
    assert uses_kernel_layer_norm(KERNELS) and not uses_kernel_layer_norm("torch-compile-faithful-attention")
    reference, _ = build_models(TINY, dtype, CPU)
    exported = export_variant(reference, TINY, dtype, CPU, inductor_variant(KERNELS), kernel_attention=True,
                              kernel_layer_norm=True)
    targets = [str(n.target) for n in exported.graph.nodes if n.op == "call_function"]
    # the blocks' norms, then the final LayerNorm: with the invalid rows' zeros as one op (one launch on a GPU)
    # where builds take it, else the rows op and the reference's masked fill
    masked = "kkdeploy_faithful.layer_norm_rows_zero_invalid.default"
    assert targets.count("kkdeploy_faithful.layer_norm_rows.default") == 2 * TINY.num_layers + (not masked_final)
    assert targets.count(masked) == masked_final
    if masked_final:
        assert "aten.masked_fill.Scalar" not in targets[targets.index(masked):]
    assert sum("kkdeploy_faithful.attention" in t for t in targets) == TINY.num_layers
    assert not any("layer_norm" in t and "kkdeploy" not in t for t in targets)
    runner = CompiledRunner(reference, TINY, dtype, CPU, name=KERNELS)
    for x, mask in (generate_case(TINY, CPU, dtype, 3), padded_case(dtype, 4)):
        with torch.no_grad():
            assert torch.equal(runner(x, mask), reference(x, mask))
    record = kernel_paths_record(KERNELS, TINY, dtype, CPU)
    assert record["layer_norm_path"]["kernel"] == "aten" and record["attention_path"]["kernel"] == "aten"


def test_faithful_kernels_is_a_default_cuda_candidate_and_benchable():
    from engines.torch_compile import KERNELS, default_variants
    from kkdeploy.pipeline.bench import COMPILE_CANDIDATES

    assert KERNELS in default_variants(torch.device("cuda"), torch.float16, "strict")
    assert KERNELS not in default_variants(CPU, torch.float16, "strict")
    assert KERNELS in COMPILE_CANDIDATES


def test_load_runners_takes_the_built_runner_and_closes_the_failed_ones(tmp_path):
    from engines.base import CandidateResult
    from kkdeploy.pipeline.build import BuildRequest, load_runners
    from kkdeploy.status import BUILD_FAILED, BUILT

    class Held:
        closed = False

        def close(self):
            self.closed = True

    kept, dropped, stray = Held(), Held(), Held()
    results = [CandidateResult("a", "no-such-backend", BUILT), CandidateResult("b", "no-such-backend", BUILD_FAILED)]
    built = {"a": kept, "b": dropped, "not-a-result": stray}
    runners = load_runners(BuildRequest(TINY, torch.float32, CPU, tmp_path), tmp_path, results, built)
    assert runners == {"a": kept} and not kept.closed and dropped.closed and built == {}
    assert stray.closed  # nothing validates a runner under a name no result carries: never served, closed
