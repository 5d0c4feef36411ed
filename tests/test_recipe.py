"""engines.recipe: one grammar for candidate names, inverse to the recipe value it describes."""

import pytest

from engines.recipe import Recipe, parse, recipe_record
from kkdeploy.errors import KKError
from kkdeploy.pipeline.chooser import SIMPLICITY_ORDER

KNOWN = ["ort-cpu", "ort-cuda", "ort-cuda-graph", "ort-cpu-mixed", "ort-cuda-graph-autocast", "trt", "trt-mixed",
         "trt-autocast", "torch-graph", "torch-graph-sdpa1", "torch-graph-nomask", "torch-compile",
         "torch-compile-sdpa1", "torch-compile-sdpa3", "torch-compile-fused", "torch-compile-fused-mixed",
         "torch-compile-fused-half-gemm", "torch-compile-fused-half-gemm-mixed", "torch-compile-faithful-attention",
         "torch-compile-faithful-kernels", "inductor", "inductor-fused", "inductor-sdpa1"]


@pytest.mark.parametrize("name", KNOWN)
def test_every_known_name_round_trips(name):
    assert parse(name).name == name


def test_every_name_the_chooser_ranks_parses():
    for name in SIMPLICITY_ORDER[1:]:  # the fallback is not a candidate
        assert parse(name).name == name


def test_fields_say_what_the_name_means():
    r = parse("torch-compile-fused-half-gemm-mixed")
    assert (r.backend, r.attention, r.precision) == ("torch-compile", "fused", "half-gemm+fp16-blocks")
    r = parse("ort-cuda-graph-autocast")
    assert (r.backend, r.provider, r.graph_capture, r.precision) == ("ort", "cuda", True, "autocast")
    r = parse("torch-graph-sdpa1")
    assert (r.attention, r.sdpa_layers, r.all_valid_only) == ("sdpa-last", 1, True)
    assert not parse("torch-compile").all_valid_only
    assert parse("torch-compile-sdpa2").describe() == "sdpa-last 2"
    assert Recipe("ort", "cuda", True, precision="fp16-blocks").name == "ort-cuda-graph-mixed"


@pytest.mark.parametrize("name", ["ort", "ort-gpu", "trt-cuda", "torch-graph-mixed", "ort-cpu-graph", "inductor-half-gemm",
                                  "torch-compile-sdpa0", "torch-compile-mixed", "trt-fused", "bogus"])
def test_names_outside_the_grammar_are_one_line_errors(name):
    with pytest.raises(KKError) as info:
        parse(name)
    assert "\n" not in str(info.value) and name in str(info.value)


def test_manifest_record_of_the_fallback_is_empty():
    assert recipe_record("pytorch-fallback") == {}
    assert recipe_record("torch-compile")["backend"] == "torch-compile"


def test_backends_take_short_names_and_exact_candidate_names():
    import torch

    from kkdeploy.pipeline.build import backend_choice, parse_backends

    assert backend_choice("ort-cuda") == ("ort", ["ort-cuda", "ort-cuda-graph"], None)
    assert backend_choice("inductor-sdpa1") == ("inductor", None, ["inductor-sdpa1"])
    assert backend_choice("torch-compile-faithful-attention") == ("torch_compile", None,
                                                                  ["torch-compile-faithful-attention"])
    assert parse_backends("torch-graph,inductor-sdpa1", torch.device("cpu")) == ["torch-graph", "inductor-sdpa1"]
    with pytest.raises(KKError, match="unknown backend 'tensorrt'"):
        parse_backends("tensorrt", torch.device("cpu"))


def test_a_backends_own_name_stands_for_its_choices_on_this_device():
    """``kkdeploy env`` lists ONNX Runtime as ``ort``; a user who types that gets the device's ORT candidates."""
    import torch

    from kkdeploy.pipeline.build import parse_backends

    assert parse_backends("ort", torch.device("cpu")) == ["ort-cpu"]
    assert parse_backends("ort,torch-compile", torch.device("cuda")) == ["ort-cuda", "torch-compile"]
    assert parse_backends("ort-cpu,ort", torch.device("cpu")) == ["ort-cpu"]
    with pytest.raises(KKError, match="unknown backend 'torch_compile'"):  # a backend's key is not a user's name
        parse_backends("torch_compile", torch.device("cpu"))


def test_the_attention_kernel_form_has_its_own_name_and_old_records_still_read():
    """Once 'faithful-kernel', one letter from 'faithful-kernels'; now named as its candidate suffix."""
    recipe = parse("torch-compile-faithful-attention")
    assert recipe.attention == "faithful-attention" != parse("torch-compile-faithful-kernels").attention
    old = {**recipe.to_dict(), "attention": "faithful-kernel"}  # a manifest's recipe record before the rename
    assert Recipe(**old) == recipe and Recipe(**old).name == "torch-compile-faithful-attention"
