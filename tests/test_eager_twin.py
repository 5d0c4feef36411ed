"""The build skips a ``-sdpa<k>`` candidate whose eager twin (the fallback ``pytorch-sdpa<k>``) already failed."""

from dataclasses import replace

import torch

from engines.base import SKIPPED
from kkdeploy.models.weights import build_models
from kkdeploy.pipeline import build as build_module
from kkdeploy.pipeline.build import BuildRequest, EagerTwinCheck, print_summary, run_build
from kkdeploy.pipeline.chooser import FALLBACK

from .conftest import SMALL

CPU = torch.device("cpu")


def request_for(tmp_path, **kw) -> BuildRequest:
    return BuildRequest(config=SMALL, dtype=torch.float32, device=CPU, out=tmp_path / "out", warmups=1, repeats=3,
                        rounds=1, **kw)


def lost_mask_twin(config=SMALL):
    """The eager sdpa1 model of ``config``'s weights without the causal mask: it fails every trial."""
    _, twin = build_models(replace(config, causal=False), torch.float32, CPU, sdpa_layers=1)
    return twin


def test_a_failed_twin_refuses_the_candidates_that_compute_its_bits(tmp_path):
    reference, _ = build_models(SMALL, torch.float32, CPU, sdpa_layers=0)
    check = EagerTwinCheck(request_for(tmp_path), reference, {1: lost_mask_twin(), 0: reference})
    for name in ("torch-compile-sdpa1", "torch-graph-sdpa1", "inductor-sdpa1"):
        why = check.refusal(name)
        assert why.startswith(f"skipped: its eager twin {FALLBACK}-sdpa1 failed (")
        failed = int(why.split("(")[1].split()[0])  # the twin's own count of failed elements
        assert failed > 0 and "on the first all-valid trial" in why
    # other attention forms, other precisions, other backends and a k without a twin are built as before
    for name in ("torch-compile", "torch-compile-faithful-gemms", "torch-compile-fused", "torch-graph-nomask",
                 "inductor-sdpa2", "trt", "ort-cuda", "not-a-candidate"):
        assert check.refusal(name) is None, name
    assert list(check.verdicts) == [1]  # decided once, for every candidate of that k


def test_a_passing_twin_refuses_nothing_and_is_checked_once(tmp_path, monkeypatch):
    reference, twin = build_models(SMALL, torch.float32, CPU, sdpa_layers=1)
    calls = []
    real = build_module.EagerTwinCheck._check
    monkeypatch.setattr(EagerTwinCheck, "_check", lambda self, k: calls.append(k) or real(self, k))
    check = EagerTwinCheck(request_for(tmp_path), reference, {1: twin})
    assert check.refusal("torch-compile-sdpa1") is None and check.refusal("torch-graph-sdpa1") is None
    assert calls == [1]


def test_the_build_records_the_skip_and_never_compiles_the_candidate(tmp_path, monkeypatch, capsys):
    real = build_module.build_models

    def with_lost_mask_twin(config, dtype, device, weights=None, sdpa_layers=1, **kw):
        reference, optimized = real(config, dtype, device, weights=weights, sdpa_layers=sdpa_layers, **kw)
        if sdpa_layers == 1:
            _, optimized = real(replace(config, causal=False), dtype, device, weights=weights, sdpa_layers=1, **kw)
        return reference, optimized

    monkeypatch.setattr(build_module, "build_models", with_lost_mask_twin)
    from engines.torch_compile import BACKEND

    def no_compile(*args, **kw):
        raise AssertionError("the candidate was compiled")

    monkeypatch.setattr(BACKEND, "_compile", no_compile)
    manifest = run_build(request_for(tmp_path, backends=["torch-compile-sdpa1"]))
    entry = next(c for c in manifest["candidates"] if c["name"] == "torch-compile-sdpa1")
    assert entry["status"] == SKIPPED
    assert f"eager twin {FALLBACK}-sdpa1 failed (" in entry["reason"]
    assert manifest["choice"]["candidate"] == FALLBACK
    assert manifest["fallback"]["sdpa_layers"] == 0  # the twin failed the full validation too
    print_summary(manifest, tmp_path / "out")
    cells = "".join(capsys.readouterr().out.replace("│", " ").split())
    assert f"itseagertwin{FALLBACK}-sdpa1failed(" in cells  # the summary table says why nothing was compiled


def test_a_reason_the_table_cuts_is_printed_whole_below_it(tmp_path, capsys):
    from kkdeploy.pipeline import build as build_module

    reason = ("build failed: KKError: cached_mdiv_split_w8_regs is not bit-identical to the reference's ops: qkv0 "
              "differs in 3 elements (seed 1234, padding 0.0)")
    manifest = {"choice": {"candidate": FALLBACK, "reason": "no candidate passed the validation gate"},
                "fallback": {"latency": {"median_ms": 1.5}},
                "candidates": [{"name": "layer-graph-split", "status": "build-failed", "reason": reason},
                               {"name": "trt", "status": "unavailable", "reason": "unavailable: no tensorrt"}]}
    assert build_module.full_reasons(manifest) == [f"layer-graph-split: {reason}"]  # a short one stays in the table
    build_module.print_summary(manifest, tmp_path / "out")
    out = capsys.readouterr().out
    assert f"why, in full:\n  layer-graph-split: {reason}\n" in out and "trt: unavailable" not in out
