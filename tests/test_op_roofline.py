"""Each proven kernel op against the machine (``kkdeploy.pipeline.op_roofline``): the FLOP and byte model of each
op by hand, the fraction of what runs, and bench.json / bench.md carrying it. Shape 6's figures are session 47's
proofs on an H100 (docs/results.md)."""

from __future__ import annotations

import pytest

from kkdeploy.config import official_config
from kkdeploy.pipeline.bench import ShapeJob, aggregate_shape, markdown_table, op_roofline_lines
from kkdeploy.pipeline.op_roofline import linear_work, op_roofline, op_rooflines, op_work

#: session 47's H100 limits from shape 6's bench, rounded: 760 TFLOP/s, 2,976 GB/s, 0.78 µs a launch in a graph
LIMITS = {"gemm": {"tflop_s": 760.0, "n": 8192}, "copy": {"gb_s": 2976.0},
          "launch": {"floor_ms": 0.0094, "per_launch_ms": 0.00078}}
M = 1_280_000  # shape 6's rows


def record(op, shape, chosen, ms, aten_ms):
    launches = [{"launch": chosen, "ms": ms, "status": "proven"}] if chosen else []
    return {"op": op, "shape": dict(shape, dtype="float16"), "chosen": chosen, "launches": launches,
            "reference_ms": aten_ms}


def test_the_work_of_each_op_by_hand():
    assert linear_work(8, 16, 4, "none") == {"flops": 2 * 8 * 16 * 4, "bytes": 2 * (8 * 4 + 4 * 16 + 16 + 8 * 16)}
    residual = linear_work(8, 16, 4, "add_masked")  # the residual read, the mask's byte per row
    assert residual["bytes"] == 2 * (8 * 4 + 4 * 16 + 16 + 2 * 8 * 16) + 8
    assert linear_work(8, 16, 4, "masked_sum") == residual
    normed = linear_work(8, 16, 4, "add_masked+layer_norm")  # the normalized rows written, gamma and beta
    assert normed["bytes"] == residual["bytes"] + 2 * (8 * 16 + 2 * 16) and normed["flops"] == residual["flops"]
    assert linear_work(8, 16, 4, "gelu") == linear_work(8, 16, 4, "none")  # the GELU moves nothing more
    chain = linear_work(8, 16, 4, "ffn_chain+masked_sum+layer_norm")  # ffn_out's (M, D, F): h2 [8, 16] in
    assert chain["flops"] == 2 * 2 * 8 * 16 * 4
    assert chain["bytes"] == 2 * (8 * 16 + 2 * 16 * 4 + 4 + 16 + 8 * 16 + 8 * 16 + 8 * 16 + 2 * 16) + 8
    qkv = linear_work(8, 16, 4, "ffn_chain+masked_sum+layer_norm+qkv")
    assert qkv["flops"] == chain["flops"] + 2 * 8 * 48 * 16
    assert qkv["bytes"] == chain["bytes"] + 2 * (3 * 16 * 16 + 3 * 16 + 3 * 8 * 16)
    assert op_work("layer_norm_rows", {"rows": 8, "width": 16}) == {"flops": 0, "bytes": 2 * (2 * 8 * 16 + 2 * 16)}
    causal = op_work("faithful_attention", {"batch_heads": 2, "seq_len": 4, "head_dim": 8, "causal": True})
    assert causal == {"flops": 2 * 2 * 2 * 8 * 10, "bytes": 4 * 2 * 4 * 8 * 2}  # 10 = 4 * 5 / 2 pairs
    full = op_work("faithful_attention", {"batch_heads": 2, "seq_len": 4, "head_dim": 8, "causal": False})
    assert full["flops"] == 2 * 2 * 2 * 8 * 16
    one = op_work("qkv_attention", {"batch": 2, "seq_len": 4, "d_model": 8, "heads": 2, "causal": True})
    assert one == {"flops": 2 * 8 * 8 * 24 + 2 * 2 * 2 * 8 * 10, "bytes": 2 * (2 * 8 * 8 + 3 * 64 + 24) + 8}
    assert op_work("block_softmax", {"row_len": 8}) is None and op_work("fused_linear", {"m": 1}) is None


def test_shape_6s_attention_is_furthest_and_its_layer_norm_at_the_copy_bandwidth():
    """Session 47's shape-6 proofs: the Q|K|V attention at 1.32 ms is a sixth of its limit, the rows LayerNorm at
    0.225 ms reads and writes its 328 MB at the copy bandwidth; ATen's op where the proof kept it."""
    rows = op_rooflines([
        record("layer_norm_rows", {"rows": M, "width": 128}, "rows2_full", 0.2251, 1.3711),
        record("qkv_attention", {"batch": 10000, "seq_len": 128, "d_model": 128, "heads": 4, "causal": True},
               "pair", 1.3227, 17.6719),
        record("fused_linear", {"m": M, "n": 128, "k": 128, "form": "none"}, None, None, 0.315),
        record("block_softmax", {"row_len": 128, "rows": 8}, "bm64", 0.1, 0.2)], LIMITS)
    assert [r["op"] for r in rows] == ["qkv_attention", "fused_linear", "layer_norm_rows", "block_softmax"]
    attention, aten_gemm, norm, unknown = rows
    assert attention["runs"] == "pair" and attention["fraction"] == pytest.approx(0.167, abs=0.002)
    assert attention["bound"] == "compute" and attention["terms_ms"]["launch"] == 0.00078
    assert norm["bound"] == "memory" and norm["fraction"] == pytest.approx(0.978, abs=0.002)
    assert aten_gemm["runs"] == "aten" and aten_gemm["ms"] == 0.315 and aten_gemm["ours_ms"] is None
    assert aten_gemm["fraction"] == pytest.approx(0.2203 / 0.315, abs=0.002)
    assert unknown["fraction"] is None and unknown["reason"] == "no work model for this op"
    assert norm["shape"] == "rows=1280000 width=128"


def test_an_op_without_limits_or_timing_says_why():
    norm = record("layer_norm_rows", {"rows": 8, "width": 16}, "rows2", 0.001, 0.002)
    assert op_roofline(norm, None)["reason"] == "no limits were measured"
    untimed = record("layer_norm_rows", {"rows": 8, "width": 16}, None, None, None)  # refused: nothing timed
    assert op_roofline(untimed, LIMITS)["reason"] == "the proof did not time what runs"
    assert op_roofline(untimed, LIMITS)["runs"] == "aten"


def _worker(proofs):
    from kkdeploy.pipeline.timing import LatencyStats

    latency = LatencyStats.from_times([0.09, 0.09, 0.09], [0.09]).to_dict(include_times=True)
    eager = LatencyStats.from_times([4.0, 4.0, 4.0], [4.0]).to_dict(include_times=True)
    engine = {"status": "passed", "reason": "", "latency": latency, "failed_elements": {"all-valid": 0},
              "max_abs": 0.0, "launches": {"count": 20, "method": "CUDA-graph nodes"}, "kernel_proofs": proofs}
    return {"dtype": "float16", "limits": dict(LIMITS, device="cuda:0"), "backends": {
        "eager": {"status": "reference", "reason": "", "latency": eager, "launches": {"count": None}},
        "engine": engine, "twin": dict(engine)}}


def test_bench_json_and_md_carry_each_op_once_the_furthest_first():
    proofs = [record("layer_norm_rows", {"rows": 512, "width": 128}, "rows2_full", 0.0017, 0.0029),
              record("qkv_attention", {"batch": 4, "seq_len": 128, "d_model": 128, "heads": 4, "causal": True},
                     "whole", 0.0075, 0.0492)]
    shape = aggregate_shape(ShapeJob("shape-03", 3, official_config(3)), [_worker(proofs)], [])
    ops = shape["backends"]["engine"]["roofline"]["ops"]
    assert [r["op"] for r in ops] == ["qkv_attention", "layer_norm_rows"]  # launch-bound, the attention furthest
    assert all(r["bound"] == "launch" for r in ops)
    assert ops[0]["fraction"] == pytest.approx(0.00078 / 0.0075)
    assert ops[1]["fraction"] == pytest.approx(0.00078 / 0.0017)
    assert "ops" not in shape["backends"]["eager"]["roofline"]  # no proofs, no ops
    md = markdown_table({"created": "now", "command": "kkdeploy bench", "shapes": [shape],
                         "protocol": {"dtype": "float16", "device": "cuda", "contract": "strict", "atol": 0.001,
                                      "rtol": 0.01, "trials": 5, "seed": 1234, "padding_ratio": 0.25, "warmups": 20,
                                      "repeats": 100, "rounds": 3, "processes": 1, "timer": "CUDA events"},
                         "environment": {"device": "cuda", "gpu": "test GPU", "versions": {"torch": "x"}}})
    assert "## Kernel ops against the machine" in md
    assert md.count("| shape-03 | layer_norm_rows |") == 1  # two candidates, one proof: one row
    # the entries carry no *_path records: whether a graph computes each op is not known ("-")
    assert "| shape-03 | layer_norm_rows | rows=512 width=128 | - | rows2_full | 0.0017 | 0.0029 |" in md
    assert op_roofline_lines([dict(shape, backends={"eager": shape["backends"]["eager"]})]) == []


def test_the_bench_command_prints_each_shapes_furthest_kernel_op(capsys):
    """The console summary of `kkdeploy bench` names, per shape, the kernel op furthest from its own limit (the
    reason the shape sits where it does); a shape without timed ops prints no such line."""
    from kkdeploy.commands.bench import print_summary

    proofs = [record("layer_norm_rows", {"rows": 512, "width": 128}, "rows2_full", 0.0017, 0.0029),
              record("qkv_attention", {"batch": 4, "seq_len": 128, "d_model": 128, "heads": 4, "causal": True},
                     "whole", 0.0075, 0.0492)]
    timed = aggregate_shape(ShapeJob("shape-03", 3, official_config(3)), [_worker(proofs)], [])
    untimed = aggregate_shape(ShapeJob("shape-02", 2, official_config(2)), [_worker([])], [])
    print_summary({"shapes": [timed, untimed]})
    out = " ".join(capsys.readouterr().out.split())  # the console wraps long lines
    assert ("kernel op furthest from its limit, shape-03: qkv_attention batch=4 seq_len=128 d_model=128 heads=4 "
            "causal=True (whole) 0.0075 ms, 0.1 of its launch limit") in out
    assert "furthest from its limit, shape-02" not in out


def _plan(**over):
    plan = {"gemms": True, "linears": {"qkv": True, "out_proj": True, "ffn_in": True, "ffn_out": True},
            "packed_qkv": True, "gelu_prologue": False, "gelu": True, "layer_norm": False, "ffn_chain": False,
            "ffn_qkv": False, "qkv_attention": True}
    return dict(plan, **over)


def test_the_plan_says_which_proven_gemm_forms_a_graph_computes():
    """``fused_blocks.planned_linear_forms``: of the GEMM forms the proofs time (every one a plan might take), those
    a block plan launches. Shape 3 under session 49's plan: out_proj and ffn_out with their residuals and the GELU
    GEMM; Q|K|V inside the attention's launch, so not the packed GEMM, and no LayerNorm epilogue."""
    from kkdeploy.kernels.fused_blocks import planned_linear_forms
    from kkdeploy.kernels.fused_linear import FFN_FORM, FFN_QKV_FORM

    config = official_config(3)  # D = F = 128
    assert planned_linear_forms(config, _plan()) == {(128, 128, "add_masked"), (128, 128, "gelu"),
                                                      (128, 128, "masked_sum")}
    assert (384, 128, "none") in planned_linear_forms(config, _plan(qkv_attention=False))
    assert planned_linear_forms(config, _plan(layer_norm=True, gelu=False)) == {
        (128, 128, "add_masked+layer_norm"), (128, 128, "none"), (128, 128, "masked_sum+layer_norm"),
        (384, 128, "none")} - {(384, 128, "none")}
    assert (128, 128, "gelu_prologue+masked_sum+layer_norm") in planned_linear_forms(
        config, _plan(layer_norm=True, gelu_prologue=True, gelu=False))
    chain = planned_linear_forms(config, _plan(layer_norm=True, ffn_chain=True, ffn_qkv=True, qkv_attention=False))
    assert {(128, 128, FFN_FORM), (128, 128, FFN_QKV_FORM), (384, 128, "none")} <= chain
    assert not {(128, 128, "gelu"), (128, 128, "masked_sum+layer_norm")} & chain
    assert (128, 128, "none") in planned_linear_forms(config, _plan(packed_qkv=False, qkv_attention=False))
    assert planned_linear_forms(config, _plan(gemms=False)) == set() == planned_linear_forms(config, None)


def test_the_furthest_op_is_one_the_graph_computes():
    """Shape 7's session-49 bench named the attention launch (cached64w4_mdiv, 0.079) as its furthest op, but its
    plan ran the Q|K|V attention instead: the proof timed an op the graph never launched. ``in_plan`` marks each op
    row from the candidate's *_path records, the rows a graph computes come first, and the furthest named is one of
    them; the bench's table says which."""
    from kkdeploy.pipeline.op_roofline import furthest_in_plan, in_plan, op_rooflines

    config = official_config(3)
    proofs = [record("faithful_attention", {"batch_heads": 16, "seq_len": 128, "head_dim": 32, "causal": True},
                     "cached64w4_mdiv", 0.0097, 0.0391),
              record("qkv_attention", {"batch": 4, "seq_len": 128, "d_model": 128, "heads": 4, "causal": True},
                     "whole_em", 0.0071, 0.0490),
              record("fused_linear", {"m": 512, "n": 128, "k": 128, "form": "masked_sum+layer_norm"}, "regs_m16",
                     0.0047, 0.0070),
              record("fused_linear", {"m": 512, "n": 128, "k": 128, "form": "masked_sum"}, "m64n16", 0.0020, 0.0041),
              record("layer_norm_rows", {"rows": 512, "width": 128}, "rows2_full", 0.0017, 0.0029)]
    entry = {"attention_path": {}, "layer_norm_path": {}, "linear_path": {"plan": _plan()}}
    rows = op_rooflines(proofs, LIMITS, in_plan(entry, config))
    computed = {r["op"] + " " + r["runs"]: r["in_plan"] for r in rows}
    assert computed == {"faithful_attention cached64w4_mdiv": False, "qkv_attention whole_em": True,
                        "fused_linear regs_m16": False, "fused_linear m64n16": True, "layer_norm_rows rows2_full": True}
    assert [r["in_plan"] for r in rows] == [True, True, True, False, False]  # those computed first
    assert furthest_in_plan(rows)["runs"] == "whole_em"
    assert min(rows, key=lambda r: r["fraction"])["runs"] == "cached64w4_mdiv"  # what was named before
    unknown = op_rooflines(proofs, LIMITS, in_plan({"status": "passed"}, config))
    assert {r["in_plan"] for r in unknown} == {None} and furthest_in_plan(unknown)["runs"] == "cached64w4_mdiv"
