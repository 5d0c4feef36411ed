"""The CUDA-graph variants' models, checked on the CPU (the capture itself needs a GPU)."""

import pytest
import torch

from engines.torch_graph import BACKEND, VARIANTS, model_for_variant
from kkdeploy import generate_case
from kkdeploy.models.weights import build_models
from validation import CONTRACTS, compare_outputs

from .conftest import SMALL


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_variant_models_compute_what_their_names_claim(name):
    """What each variant captures, run eagerly: reference order is bitwise, SDPA is strict (fp32)."""
    variant = VARIANTS[name]
    ref, _ = build_models(SMALL, torch.float32, "cpu")
    model = model_for_variant(variant, SMALL, torch.float32, torch.device("cpu"), ref.state_dict())
    x, mask = generate_case(SMALL, "cpu", torch.float32, 7)
    with torch.inference_mode():
        expected = ref(x, mask)
        got = model.fast_forward(x) if variant["all_valid_only"] else model.reference_forward(x, mask)
    if variant["sdpa_layers"] == 0:
        assert torch.equal(expected, got)
    else:
        assert compare_outputs(expected, got, *CONTRACTS["strict"]).passed
    assert variant["all_valid_only"] == (variant["model"] == "optimized")


def test_cuda_graphs_are_unavailable_on_the_cpu():
    assert BACKEND.unavailable_reason(torch.device("cpu"), torch.float32) == "unavailable: CUDA graphs need a CUDA device"
