"""The judge-contract fused model: SDPA in every block, every mask (kkdeploy.models.fused)."""

from __future__ import annotations

import pytest
import torch

from kkdeploy.errors import KKError
from kkdeploy.models.fused import FusedTransformer, attention_mask
from kkdeploy.inputs import generate_case
from tests.conftest import SMALL, SMALL_NONCAUSAL, models_for

CPU = torch.device("cpu")


def padded_case(config, seed):
    for offset in range(100):
        x, mask = generate_case(config, CPU, torch.float32, seed + offset, padding_ratio=0.5)
        if not bool(mask.all()):
            return x, mask
    raise AssertionError("generator never padded")


@pytest.mark.parametrize("config", [SMALL, SMALL_NONCAUSAL], ids=["causal", "noncausal"])
def test_float32_fused_model_keeps_the_reference_semantics(config):
    """float32 SDPA only reorders float32 sums: far inside the strict rule, with padded rows exactly zero."""
    reference = models_for(config, torch.float32, sdpa_layers=0)[0]
    model = FusedTransformer(reference)
    x_valid, all_valid = generate_case(config, CPU, torch.float32, 1, padding_ratio=0.0)
    x_pad, mask = padded_case(config, 2)
    with torch.inference_mode():
        for x, m in ((x_valid, all_valid), (x_pad, mask)):
            expected, got = reference(x, m), model(x, m)
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
            assert not torch.equal(got, expected) or config.num_layers == 0  # SDPA really ran
        assert bool((model(x_pad, mask)[~mask] == 0).all())
        # the two routes: None (SDPA's causal path) and an all-true boolean mask agree, and model() picks
        # the causal one for an all-true mask
        causal, masked = model.fused_forward(x_valid, None), model.fused_forward(x_valid, all_valid)
        torch.testing.assert_close(causal, masked, atol=1e-6, rtol=1e-6)
        assert torch.equal(model(x_valid, all_valid), causal) and torch.equal(model(x_valid, None), causal)


def test_attention_mask_is_causal_and_drops_invalid_keys():
    mask = torch.tensor([[True, True, False], [True, True, True]])
    keep = attention_mask(mask, causal=True)
    assert keep.shape == (2, 1, 3, 3)
    assert keep[1, 0].tolist() == [[True, False, False], [True, True, False], [True, True, True]]
    assert keep[0, 0, 2].tolist() == [True, True, False]  # the padded key is dropped even for a later query
    assert attention_mask(mask, causal=False)[0, 0, 0].tolist() == [True, True, False]


def test_fully_padded_sequence_gives_zero_rows_not_nan():
    reference = models_for(SMALL, torch.float32, sdpa_layers=0)[0]
    x, mask = generate_case(SMALL, CPU, torch.float32, 3, padding_ratio=0.0)
    mask = mask.clone()
    mask[0] = False
    with torch.inference_mode():
        y = FusedTransformer(reference, (1,))(x, mask)
        assert torch.equal(y[0], torch.zeros_like(y[0]))
        assert bool(torch.isfinite(y).all())
        torch.testing.assert_close(y[1:], reference(x, mask)[1:], atol=2e-3, rtol=2e-2)


def test_float16_blocks_run_in_float16():
    reference = models_for(SMALL, torch.float32, sdpa_layers=0)[0]
    x, mask = padded_case(SMALL, 4)
    with torch.inference_mode():
        full = FusedTransformer(reference)(x, mask)
        mixed = FusedTransformer(reference, (1,))(x, mask)
    assert mixed.dtype == torch.float32
    assert not torch.equal(mixed, full)  # block 1 rounded to float16
    torch.testing.assert_close(mixed, full, atol=2e-3, rtol=2e-2)


def test_bad_arguments_are_one_line_errors():
    reference = models_for(SMALL, torch.float32, sdpa_layers=0)[0]
    with pytest.raises(KKError, match="out of range"):
        FusedTransformer(reference, (SMALL.num_layers,))
    with pytest.raises(KKError, match="float32 model"):
        FusedTransformer(models_for(SMALL, torch.float16, sdpa_layers=0)[0], (0,))
    FusedTransformer(models_for(SMALL, torch.float16, sdpa_layers=0)[0])  # no float16 blocks: any dtype


def count_calls(runner, counts: dict, key: str, masks: list | None = None) -> None:
    infer = runner.infer

    def counted(x, mask):
        counts[key] += 1
        if masks is not None:
            masks.append(mask)
        return infer(x, mask)

    runner.infer = counted


def test_compiled_fused_model_routes_each_mask_to_its_graph():
    """Two graphs: all-valid calls (None or an all-true mask) take the causal one, padded calls the
    boolean-mask one; each matches its eager route (Inductor's fusion changes float32 rounding only
    slightly) and padded rows stay zero."""
    from engines.torch_compile import compile_fused

    reference = models_for(SMALL, torch.float32, sdpa_layers=0)[0]
    fused = FusedTransformer(reference)
    runner = compile_fused(fused, CPU, name="torch-compile-fused")
    assert runner.compile_seconds > 0 and not runner.all_valid_only and runner.name == "torch-compile-fused"
    served, all_valid_masks = {"all_valid": 0, "padded": 0}, []
    for route in served:
        count_calls(getattr(runner, route), served, route, all_valid_masks if route == "all_valid" else None)
    x_pad, mask = padded_case(SMALL, 6)
    x_valid, all_valid = generate_case(SMALL, CPU, torch.float32, 7, padding_ratio=0.0)
    with torch.inference_mode():
        eager_padded, eager_valid = fused.fused_forward(x_pad, mask), fused.fused_forward(x_valid, None)
    got = runner(x_pad, mask)
    assert served == {"all_valid": 0, "padded": 1}
    torch.testing.assert_close(got, eager_padded, atol=1e-5, rtol=1e-5)
    assert bool((got[~mask] == 0).all())
    for m in (None, all_valid):
        torch.testing.assert_close(runner(x_valid, m), eager_valid, atol=1e-5, rtol=1e-5)
    assert served == {"all_valid": 2, "padded": 1}
    # the all-valid graph is all-valid-only and gets its own full mask: no second check, no mask copy
    assert runner.all_valid.all_valid_only and not runner.padded.all_valid_only
    assert all(m is runner.all_valid.full_mask() for m in all_valid_masks)


def test_fused_compiles_are_not_bound_by_the_callers_recompile_limit():
    """Every compiled fused model runs the same BoundForward code object, and Dynamo allows only
    ``recompile_limit`` graphs (8 by default) per code object: a process loading more fused artifacts than
    that must still compile them, not fail, and not recompile on a first call. Here the caller's limit is 1,
    so the second model, or a first call with inference tensors, would fail."""
    import dataclasses

    import torch._dynamo

    from engines.torch_compile import compile_fused
    from tests.test_inductor import TINY  # the smallest model: compiles stay cheap

    with torch._dynamo.config.patch(recompile_limit=1):
        for batch in (1, 2, 3):
            config = dataclasses.replace(TINY, batch_size=batch)
            reference = models_for(config, torch.float32, sdpa_layers=0)[0]
            runner = compile_fused(FusedTransformer(reference), CPU, name="torch-compile-fused")
            x, mask = generate_case(config, CPU, torch.float32, batch, padding_ratio=0.0)
            with torch.inference_mode():
                expected = reference(x, mask)
                torch.testing.assert_close(runner(x, mask), expected, atol=1e-5, rtol=1e-5)
                # inference tensors are guarded apart from normal ones: compiled up front, not on this call
                torch.testing.assert_close(runner(x.clone(), mask.clone()), expected, atol=1e-5, rtol=1e-5)
        assert torch._dynamo.config.recompile_limit == 1  # raised for our compiles only


def test_half_gemm_is_float16_inputs_with_float32_accumulation():
    """The GEMM sees float16-rounded inputs, sums exactly as a float32 GEMM of those would, adds a float32
    bias and returns float32 (no float16 output rounding)."""
    from kkdeploy.models.fused import half_gemm

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 64, generator=gen)
    weight, bias = torch.randn(48, 64, generator=gen) / 8, torch.randn(48, generator=gen)
    got = half_gemm(x, weight.half().float(), bias)  # the CPU's route: float16 values held in float32
    assert got.dtype == torch.float32 and got.shape == (2, 5, 48)
    exact = (x.half().double() @ weight.half().double().T + bias.double()).float()
    torch.testing.assert_close(got, exact, atol=1e-5, rtol=1e-6)  # float32 sums of exact products
    unrounded = torch.nn.functional.linear(x, weight, bias)
    assert (got - unrounded).abs().max() > 1e-3  # the inputs really were rounded
    assert not torch.equal(got, got.half().float())  # ...and the output was not


def test_half_gemm_runs_float16_tensor_cores_on_cuda_where_torch_can_trace_them():
    from kkdeploy.models.fused import EMULATED, MM_TO_FLOAT32, half_gemm_kernel, mm_to_float32_traceable

    assert half_gemm_kernel("cpu") == EMULATED
    assert mm_to_float32_traceable()  # this torch has aten::mm.dtype with a meta kernel
    assert half_gemm_kernel("cuda") == MM_TO_FLOAT32
    reference = models_for(SMALL, torch.float32, sdpa_layers=0)[0]
    model = FusedTransformer(reference, half_gemm=True)  # on the CPU: float16-rounded weights held in float32
    assert model.half_gemm_kernel == EMULATED and model.gemm_model.dtype == torch.float32
    weight = model.gemm_model.layers[0].ffn_in.weight
    assert torch.equal(weight, reference.layers[0].ffn_in.weight.half().float())
    assert FusedTransformer(reference).half_gemm_kernel is None


def test_half_gemm_model_keeps_the_tf32_references_rounding_points():
    """On shape 3, against the TF32 reference: the half-GEMM model passes even the strict rule and is closer
    to it than exact float32 is. A misplaced rounding point (say, a float16 residual stream or float16 GEMM
    outputs) would put it further away than float32, not closer."""
    from kkdeploy.config import official_config
    from kkdeploy.models.weights import build_models
    from validation.strict import compare_outputs
    from validation.tf32_emulation import TF32Emulation

    config = official_config(3)
    reference = build_models(config, torch.float32, CPU)[0]
    half, exact = FusedTransformer(reference, half_gemm=True), FusedTransformer(reference)
    assert half.half_gemm and half.fp16_layers == ()
    for x, mask in (generate_case(config, CPU, torch.float32, 1234, padding_ratio=0.0), padded_case(config, 1235)):
        with torch.inference_mode():
            with TF32Emulation():
                tf32 = reference(x, mask)
            got, fp32 = half(x, mask), exact(x, mask)
        assert got.dtype == torch.float32
        report = compare_outputs(tf32, got, atol=1e-3, rtol=1e-2)
        assert report.passed, report
        assert report.max_abs < compare_outputs(tf32, fp32, atol=1e-3, rtol=1e-2).max_abs
        assert bool((got[~mask] == 0).all())


def test_half_gemm_blocks_combine_with_float16_blocks():
    reference = models_for(SMALL, torch.float32, sdpa_layers=0)[0]
    x, mask = padded_case(SMALL, 9)
    with torch.inference_mode():
        half = FusedTransformer(reference, half_gemm=True)(x, mask)
        both = FusedTransformer(reference, (1,), half_gemm=True)(x, mask)
        fp16_only = FusedTransformer(reference, (1,))(x, mask)
    assert not torch.equal(both, half) and not torch.equal(both, fp16_only)  # block 0 half GEMM, block 1 float16
    torch.testing.assert_close(both, reference(x, mask), atol=2e-3, rtol=2e-2)
    with pytest.raises(KKError, match="half_gemm.*float32"):
        FusedTransformer(models_for(SMALL, torch.float16, sdpa_layers=0)[0], half_gemm=True)


def test_tf32_emulation_rounds_gemm_inputs_to_ten_mantissa_bits():
    from validation.tf32_emulation import TF32Emulation, round_to_tf32

    one_plus = torch.tensor([1 + 2**-10, 1 + 2**-11, 1 + 2**-12, -(1 + 3 * 2**-12)])
    assert round_to_tf32(one_plus).tolist() == [1 + 2**-10, 1 + 2**-10, 1.0, -(1 + 2**-10)]  # ties away from 0
    assert round_to_tf32(one_plus, "truncate").tolist() == [1 + 2**-10, 1.0, 1.0, -1.0]
    a, b = torch.tensor([[1 + 2**-12]]), torch.tensor([[1.0]])
    with TF32Emulation("truncate"):
        assert torch.matmul(a, b).item() == 1.0 and torch.nn.functional.linear(a, b).item() == 1.0
    assert torch.matmul(a, b).item() == 1 + 2**-12  # outside the mode: float32 again
    with pytest.raises(ValueError, match="unknown TF32 rounding"):
        TF32Emulation("stochastic")
