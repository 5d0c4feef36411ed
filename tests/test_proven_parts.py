"""scripts/proven_parts.py: what a GPU self-test proved bit-identical and faster becomes the kernels' environment.

The reports are built here in the self-tests' own format (the same keys their scripts write), so each rule is
tested by changing one number: a differing element, a missing check or a slower time keeps a part out.
"""

from __future__ import annotations

import copy
import json

import pytest

from kkdeploy.kernels import faithful_attention as fa
from kkdeploy.kernels import fused_linear as fl
from tests.conftest import load_script

pp = load_script("proven_parts")
LINEAR_FORMS = ("q", "qkv_packed", "add_masked", "masked_sum", "gelu", "gelu_fpfusion", "gelu_prologue",
                "gelu_prologue_fpfusion", "ln_emulation", "add_masked_ln", "masked_sum_ln", "gelu_prologue_ln",
                "gelu_prologue_ln_fpfusion")


def form(differing=0):
    return {"calls": 8, "elements": 1000, "differing": differing, "first": None}


def linear_report() -> dict:
    rows = [{"check": "gelu_exhaustive", "enable_fp_fusion": f, "values": 63486, "differing": 0, **extra}
            for f in (False, True) for extra in ({}, {"prologue": True})]
    rows += [{"check": "model", "shape": s, "padding_ratio": r, "gemm": [64, 128, 128],
              "forms": {f: form() for f in LINEAR_FORMS}} for s in range(1, 14) for r in (0.0, 0.25)]
    rows.append({"check": "random", "gemm": [64, 128, 128], "scale": 10.0, "forms": {f: form() for f in LINEAR_FORMS}})
    rows.append({"check": "timing", "shape": 6, "separate_masked_sum_then_ln_ms": 0.60,
                 "kernel_masked_sum_ln_bm64_w8_reload_ms": 0.40, "kernel_ffn_aten_gelu_ms": 0.80,
                 "kernel_ffn_gelu_prologue_ms": 0.55, "kernel_ffn_gelu_prologue_fpfusion_ms": 0.54,
                 "aten_gelu_ms": 0.5, "kernel_gelu_ms": 0.3})
    return {"rows": rows}


def attention_report() -> dict:
    shapes = {}
    for sid in range(1, 14):
        s = 1024 if sid == 8 else 128
        cell = {n: {"elements": 10, "differing": 0} for n in ("op", "bm64", "cached64w4", "bm64_mdiv")
                if n == "op" or fa.launch_fits(n, s)}
        entry = {"config": {"seq_len": s}, **{k: copy.deepcopy(cell) for k in (
            "model_all_valid", "model_padded", "random_all_valid", "random_padded")}}
        entry["time_padded"] = {"aten_ms": 5.0, "op_ms": 2.0, "bm64_ms": 2.0, "cached64w4_ms": 1.8 if sid == 6 else 2.0,
                                "bm64_mdiv_ms": 1.9}
        shapes[str(sid)] = entry
    return {"shapes": shapes}


def exports(tmp_path, capsys, linear=None, attention=None) -> dict:
    args = []
    for name, report in (("linear", linear), ("attention", attention)):
        if report is not None:
            path = tmp_path / f"{name}.json"
            path.write_text(json.dumps(report))
            args += [f"--{name}", str(path)]
    assert pp.main(args) == 0
    out = capsys.readouterr().out
    exports.out = out
    return dict(line[len("export "):].split("=", 1) for line in out.splitlines() if line.startswith("export "))


def test_everything_bitwise_and_faster_is_taken(tmp_path, capsys):
    env = exports(tmp_path, capsys, linear_report(), attention_report())
    # the prologue without contraction comes first; the GELU epilogue is not needed then
    assert env == {fl.PARTS_ENV: "layer_norm,gelu_prologue", fa.LAUNCH_ENV: "cached64w4"}
    fl_parts = env[fl.PARTS_ENV]
    assert set(dict(p.partition(":")[::2] for p in fl_parts.split(","))) <= set(fl.PARTS)


def test_one_differing_element_or_a_slower_time_keeps_a_part_out(tmp_path, capsys):
    report = linear_report()
    report["rows"][5]["forms"]["masked_sum_ln"]["differing"] = 1
    assert exports(tmp_path, capsys, report) == {fl.PARTS_ENV: "gelu_prologue"}
    report = linear_report()
    report["rows"][0 + 3]["differing"] = 2  # the prologue, contraction on: exhaustive fails
    report["rows"][7]["forms"]["gelu_prologue"]["differing"] = 1  # and off: one model element
    assert exports(tmp_path, capsys, report) == {fl.PARTS_ENV: "layer_norm,gelu"}
    report = linear_report()
    report["rows"][-1]["kernel_masked_sum_ln_bm64_w8_reload_ms"] = 0.7
    report["rows"][7]["forms"]["gelu_prologue"]["differing"] = 1
    assert exports(tmp_path, capsys, report) == {fl.PARTS_ENV: "gelu_prologue:fp_fusion"}
    report = linear_report()  # the prologue passes alone but not in the launch with the LayerNorm
    report["rows"][9]["forms"]["gelu_prologue_ln"]["differing"] = 3
    report["rows"][9]["forms"]["gelu_prologue_ln_fpfusion"]["differing"] = 3
    assert exports(tmp_path, capsys, report) == {fl.PARTS_ENV: "layer_norm,gelu"}


def test_a_report_missing_shapes_takes_nothing(tmp_path, capsys):
    report = linear_report()
    report["rows"] = [r for r in report["rows"] if r.get("shape") != 13]
    att = attention_report()
    del att["shapes"]["13"]
    assert exports(tmp_path, capsys, report, att) == {}
    assert exports.out.count("not 1-13: nothing taken") == 2


@pytest.mark.parametrize("change, taken", [
    (lambda r: r["shapes"]["3"]["random_padded"]["cached64w4"].update(differing=4), "bm64_mdiv"),
    (lambda r: r["shapes"]["2"]["time_padded"].update(cached64w4_ms=2.2), "bm64_mdiv"),  # 10% slower elsewhere
    (lambda r: r["shapes"]["6"]["time_padded"].update(cached64w4_ms=1.99, bm64_mdiv_ms=1.98), None),  # < 3% faster
    (lambda r: r["shapes"]["4"]["model_padded"].pop("bm64_mdiv") and r["shapes"]["6"]["time_padded"].update(
        cached64w4_ms=2.0), None),  # an unchecked shape
])
def test_the_attention_launch_rules(tmp_path, capsys, change, taken):
    report = attention_report()
    change(report)
    env = exports(tmp_path, capsys, attention=report)
    assert env.get(fa.LAUNCH_ENV) == taken


def test_an_unreadable_report_is_one_line(tmp_path, capsys):
    assert pp.main(["--linear", str(tmp_path / "missing.json")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("proven_parts: cannot read") and len(err.strip().splitlines()) == 1
