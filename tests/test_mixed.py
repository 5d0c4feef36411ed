"""Mixed precision in PyTorch (float32 model, float16 blocks) and its per-shape calibration."""

from __future__ import annotations

import pytest
import torch

from kkdeploy.errors import KKError
from kkdeploy.inputs import generate_case
from kkdeploy.models.mixed import MixedPrecisionTransformer
from kkdeploy.pipeline.calibration import calibrate_layers
from kkdeploy.models.reference import zero_invalid_rows
from tests.conftest import SMALL, models_for

CPU = torch.device("cpu")


def padded(seed):
    for offset in range(100):
        x, mask = generate_case(SMALL, CPU, torch.float32, seed + offset, padding_ratio=0.5)
        if not bool(mask.all()):
            return x, mask
    raise AssertionError("generator never padded")


@pytest.fixture(scope="module")
def reference():
    return models_for(SMALL, torch.float32, sdpa_layers=0)[0]


def test_no_fp16_layers_is_the_reference_bitwise(reference):
    model = MixedPrecisionTransformer(reference, ())
    for x, mask in (generate_case(SMALL, CPU, torch.float32, 1), padded(2)):
        with torch.inference_mode():
            assert torch.equal(model(x, mask), reference(x, mask))


def test_fp16_blocks_run_as_the_float16_model_runs_them(reference):
    fp16_reference = models_for(SMALL, torch.float16, sdpa_layers=0)[0]
    model = MixedPrecisionTransformer(reference, range(SMALL.num_layers))
    for x, mask in (generate_case(SMALL, CPU, torch.float32, 3), padded(4)):
        with torch.inference_mode():
            h = x.half()
            for layer in fp16_reference.layers:
                h = layer(h, mask)
            expected = zero_invalid_rows(reference.final_norm(h.float()), mask)
            y = model(x, mask)
        assert y.dtype == torch.float32
        assert torch.equal(y, expected)
        assert not torch.equal(y, reference(x, mask))  # float16 really ran


def test_later_layers_only_and_sdpa_path(reference):
    model = MixedPrecisionTransformer(reference, (1,), sdpa_in_fp16_layers=True)
    x, mask = generate_case(SMALL, CPU, torch.float32, 5, padding_ratio=0.0)
    with torch.inference_mode():
        fast = model.fast_forward(x)
        ordered = model.reference_forward(x, mask)
        direct = model(x, mask)
    assert torch.equal(direct, fast)
    torch.testing.assert_close(fast, ordered, atol=2e-3, rtol=2e-2)  # SDPA only reorders the float16 block


def test_bad_arguments_are_one_line_errors(reference):
    with pytest.raises(KKError, match="out of range"):
        MixedPrecisionTransformer(reference, (SMALL.num_layers,))
    with pytest.raises(KKError, match="float32"):
        MixedPrecisionTransformer(models_for(SMALL, torch.float16, sdpa_layers=0)[0], ())


def test_calibration_keeps_the_blocks_that_break_the_contract_in_float32(reference):
    """A runner that corrupts its output whenever block 0 is float16: calibration must leave block 0 out."""

    def runner_for(layers):
        model = MixedPrecisionTransformer(reference, layers)

        def run(x, mask):
            y = model(x, mask)
            return y + 0.5 if 0 in model.fp16_layers else y
        return run

    result = calibrate_layers(reference, runner_for, all_valid_only=False, contract="judge", seed=1234,
                              trials=2, padding_ratio=0.25)
    assert result["passed"] and result["fp16_layers"] == [1]
    assert result["tried"][0]["fp16_layers"] == [0, 1] and not result["tried"][0]["passed"]
    assert result["tried"][0]["failed_elements"]["all-valid"] > 0 and "reason" in result["tried"][0]
    assert result["tried"][-1] == {"fp16_layers": [1], "passed": True,
                                   "failed_elements": {"all-valid": 0, "padded": 0}}


def test_calibration_on_shape_3_judge_cpu():
    """Measured on the CPU: all four blocks in float16 pass the judge rule for shape 3."""
    from kkdeploy.config import official_config

    config = official_config(3)
    ref = models_for(config, torch.float32, sdpa_layers=0)[0]
    result = calibrate_layers(ref, lambda layers: MixedPrecisionTransformer(ref, layers), all_valid_only=False,
                              contract="judge", seed=1234, trials=2, padding_ratio=0.25)
    assert result["fp16_layers"] == [0, 1, 2, 3] and result["passed"]


def test_frozen_packed_weights_keep_results_and_state_dict():
    """``freeze_packed_qkv`` (for export/compile) changes neither the fast path's output nor the state dict."""
    _, optimized = models_for(SMALL, torch.float32, sdpa_layers=SMALL.num_layers)
    x, _ = generate_case(SMALL, CPU, torch.float32, 9, padding_ratio=0.0)
    keys = set(optimized.state_dict())
    with torch.inference_mode():
        before = optimized.fast_forward(x)
    optimized.freeze_packed_qkv(range(SMALL.num_layers))
    with torch.inference_mode():
        assert torch.equal(optimized.fast_forward(x), before)
    assert set(optimized.state_dict()) == keys
