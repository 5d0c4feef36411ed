"""engines.registry: one descriptor per backend, and every table of backends derived from it."""

from __future__ import annotations

import pytest
import torch

import engines
from engines import BuildContext, get_backend, recipe, registry
from kkdeploy.config import TransformerConfig
from kkdeploy.pipeline import build, runtime

BUILT_IN = ("trt", "ort", "torch_graph", "inductor", "torch_compile", "layer_graph")


def test_every_built_in_backend_registers_itself_where_it_lives():
    assert tuple(registry.DESCRIPTORS) == BUILT_IN
    for key, descriptor in registry.DESCRIPTORS.items():
        assert descriptor.key == key and descriptor.module == f"engines.{key}"
        backend = get_backend(key)
        assert backend.name == key and backend is engines.import_backend(descriptor.module)
        assert get_backend(key).__class__.__module__ == descriptor.module


def test_the_tables_are_the_ones_kept_by_hand_before():
    """Derived now; their contents are what the hand-written tables held, so builds and manifests are unchanged, plus
    the layer launches' backend (added since, opt-in: no default build asks for it)."""
    assert engines.BACKEND_MODULES == {"trt": "engines.trt", "ort": "engines.ort", "torch_graph": "engines.torch_graph",
                                       "inductor": "engines.inductor", "torch_compile": "engines.torch_compile",
                                       "layer_graph": "engines.layer_graph"}
    assert build.BACKEND_CHOICES == {
        "trt": ("trt", None), "ort-cuda": ("ort", ["ort-cuda", "ort-cuda-graph"]), "ort-cpu": ("ort", ["ort-cpu"]),
        "torch-graph": ("torch_graph", None), "inductor": ("inductor", None), "torch-compile": ("torch_compile", None),
        "torch-compile-fused": ("torch_compile", ["torch-compile-fused", "torch-compile-fused-mixed",
                                                  "torch-compile-fused-half-gemm", "torch-compile-fused-half-gemm-mixed"]),
        "layer-graph": ("layer_graph", ["layer-graph"]), "layer-graph-split": ("layer_graph", ["layer-graph-split"])}
    assert build.RECIPE_BACKEND_KEYS == {"ort": "ort", "trt": "trt", "torch-graph": "torch_graph",
                                         "torch-compile": "torch_compile", "inductor": "inductor",
                                         "layer-graph": "layer_graph"}
    assert build.DEFAULT_BACKENDS == {"cpu": ["ort-cpu"], "cuda": ["trt", "ort-cuda", "torch-graph", "torch-compile"]}
    assert build.ONNX_BACKENDS == {"trt", "ort"}
    assert runtime.BACKEND_LIBRARIES == {"ort": ("onnxruntime",), "trt": ("tensorrt",), "torch_graph": ("torch",),
                                         "inductor": ("torch",), "torch_compile": ("torch",), "layer_graph": ("torch",)}
    assert set(recipe.BACKENDS) == {"ort", "trt", "torch-graph", "torch-compile", "inductor", "layer-graph"}


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("contract", ["strict", "judge"])
def test_every_variant_a_descriptor_names_is_its_own_recipe(device, dtype, contract):
    for descriptor in registry.DESCRIPTORS.values():
        names = descriptor.variants(torch.device(device), dtype, contract)
        names += [n for option in descriptor.choices for n in option.variants or ()]
        for name in names:
            parsed = recipe.parse(name)
            assert parsed.backend == descriptor.recipe_name
            assert parsed.attention in descriptor.attentions and parsed.precision in descriptor.precisions


def test_a_backend_registered_later_appears_in_every_table(monkeypatch):
    desc = registry.BackendDescriptor("toy", "tests.native_backends:FAITHFUL", recipe_name="toy",
                                      libraries=("numpy",), needs_onnx=True,
                                      choices=(registry.BackendChoice("toy", default_on=("cpu",)),
                                               registry.BackendChoice("toy-some", ("toy-nomask",))),
                                      attentions=frozenset({"reference", "reference-nomask"}))
    monkeypatch.setitem(registry.DESCRIPTORS, "toy", desc)
    assert engines.BACKEND_MODULES["toy"] == desc.module
    assert build.BACKEND_CHOICES["toy"] == ("toy", None) and build.BACKEND_CHOICES["toy-some"] == ("toy", ["toy-nomask"])
    assert build.RECIPE_BACKEND_KEYS["toy"] == "toy" and "toy" in recipe.BACKENDS
    assert build.DEFAULT_BACKENDS["cpu"] == ["ort-cpu", "toy"] and "toy" in build.ONNX_BACKENDS
    assert runtime.BACKEND_LIBRARIES["toy"] == ("numpy",)
    assert recipe.parse("toy-nomask").backend == "toy"
    assert build.backend_choice("toy-some") == ("toy", ["toy-nomask"], None)
    assert build.backend_choice("toy-nomask") == ("toy", None, ["toy-nomask"])


def test_a_name_taken_by_another_backend_is_refused():
    with pytest.raises(ValueError, match="already 'ort'"):
        registry.register(registry.BackendDescriptor("other", "x", (registry.BackendChoice("ort-cpu"),)))
    assert "other" not in registry.DESCRIPTORS


def test_unknown_backend_key_is_one_line():
    with pytest.raises(engines.registry.KKError, match="unknown backend 'nope'; registered: trt, ort"):
        get_backend("nope")


def test_a_choice_travels_as_a_typed_filter_not_an_options_key():
    """ort-cpu restricts ONNX Runtime to its CPU session through BuildContext.candidate_filter."""
    config = TransformerConfig(2, 8, 16, 2, 16, 1)
    ctx = BuildContext(config, torch.float32, torch.device("cpu"), torch.nn.Linear(1, 1), out_dir=None)
    ort = get_backend("ort")
    assert ort.candidates(ctx) == ["ort-cpu"]
    ctx.candidate_filter = tuple(build.backend_choice("ort-cuda")[1])
    assert ort.candidates(ctx) == []
    assert not any(key.endswith("_candidates") for key in ctx.options)
