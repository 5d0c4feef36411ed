"""kkdeploy_faithful::linear: the GEMM with fused epilogues (kkdeploy/kernels/fused_linear.py).

On the CPU the op *is* the ATen composition, so these tests pin the composition to the reference's own ops (the
block forward through the op equals ``Block.forward`` bit for bit), the op's contract and errors, its path rules,
the ``torch-compile-faithful-gemms`` export, and (where Triton is importable) the Triton kernel's logic under
TRITON_INTERPRET=1 on inputs whose sums are exact. Bit-identity of the compiled kernel with cuBLAS is a GPU
fact: scripts/fused_linear_selftest.py.
"""

from __future__ import annotations

import textwrap

import pytest
import torch
import torch.nn.functional as F

from kkdeploy import TransformerConfig, generate_case
from kkdeploy.errors import KKError
from kkdeploy.kernels import fused_blocks as fb
from kkdeploy.kernels import fused_linear as fl
from kkdeploy.models.weights import build_models
from tests.conftest import bits_equal, load_script, round_to_float32, run_interpreter_script

CONFIG = TransformerConfig(batch_size=2, seq_len=16, d_model=32, num_heads=4, ffn_dim=32, num_layers=2, causal=True)


FULL_PLAN = {"gemms": True, "packed_qkv": True, "gelu_prologue": True, "gelu": False, "layer_norm": True}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ratio", [0.0, 0.25])
@pytest.mark.parametrize("plan", [FULL_PLAN, {"gemms": True, "packed_qkv": False, "gelu_prologue": False, "gelu": True,
                                            "layer_norm": False},
                                  {"gemms": True, "packed_qkv": False, "gelu_prologue": False, "gelu": False,
                                   "layer_norm": False},
                                  {"gemms": True, "packed_qkv": False, "gelu_prologue": True, "gelu": False,
                                   "layer_norm": False, "linears": {"qkv": False, "out_proj": False, "ffn_in": False,
                                                                    "ffn_out": True}},
                                  {"gemms": True, "packed_qkv": False, "gelu_prologue": False, "gelu": False,
                                   "layer_norm": False, "linears": {"qkv": True, "out_proj": False, "ffn_in": False,
                                                                    "ffn_out": False}},
                                  # the LayerNorm prologues: norm1 in the packed Q|K|V, norm2 in ffn_in (its GELU
                                  # in ffn_in's epilogue, in ffn_out's prologue, or ATen's)
                                  {"gemms": True, "packed_qkv": True, "gelu_prologue": False, "gelu": True,
                                   "layer_norm": False, "norm_ffn_in": True, "norm_qkv": True},
                                  {"gemms": True, "packed_qkv": True, "gelu_prologue": True, "gelu": False,
                                   "layer_norm": False, "norm_ffn_in": True, "norm_qkv": False},
                                  {"gemms": True, "packed_qkv": False, "gelu_prologue": False, "gelu": False,
                                   "layer_norm": False, "norm_ffn_in": True}])
def test_block_forward_through_the_op_is_the_reference_block(dtype, ratio, plan):
    model = build_models(CONFIG, dtype, "cpu")[0]
    x, mask = generate_case(CONFIG, "cpu", dtype, 1234, padding_ratio=ratio)
    mask = mask if ratio else None
    with torch.no_grad():
        for layer in model.layers:
            want = layer(x, mask)
            got = fb.fused_block_forward(layer, x, mask, plan)
            assert bits_equal(got, want)
            x = want


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ratio", [0.0, 0.25])
def test_model_forward_with_the_norms_in_the_epilogues_is_the_reference(dtype, ratio):
    model = build_models(CONFIG, dtype, "cpu")[0]
    x, mask = generate_case(CONFIG, "cpu", dtype, 1234, padding_ratio=ratio)
    mask = mask if ratio else None
    with torch.no_grad():
        assert bits_equal(fb.fused_model_forward(model, x, mask, FULL_PLAN), model(x, mask))


def test_the_layer_norm_epilogue_op():
    torch.manual_seed(1)
    x, r = torch.randn(3, 5, 8), torch.randn(3, 5, 6)
    w, b = torch.randn(6, 8), torch.randn(6)
    norm = torch.nn.LayerNorm(6)
    torch.nn.init.normal_(norm.weight)
    torch.nn.init.normal_(norm.bias)
    mask = torch.tensor([[True, False, True, True, False]] * 3)
    with torch.no_grad():
        for epilogue in fl.LN_EPILOGUES:
            total, normed = fl.linear_layer_norm(x, w, b, r, mask, norm, epilogue)
            assert torch.equal(total, fl.fused_linear(x, [w], [b], r, mask, epilogue))
            assert torch.equal(normed, norm(total))
        args = (x, w, b, r, mask, norm.weight, norm.bias, 1e-5, "masked_sum")
        torch.library.opcheck(torch.ops.kkdeploy_faithful.linear_layer_norm.default, args)
        with pytest.raises(KKError, match="follows add_masked or masked_sum"):
            fl.linear_layer_norm(x, w, b, r, mask, norm, "gelu")
        with pytest.raises(KKError, match=r"ln_weight must be \[6\]"):
            fl.linear_layer_norm(x, w, b, r, mask, torch.nn.LayerNorm(5), "add_masked")


def _remember_linear(proof, m, n, k, form, chosen="auto", reason="test", ms=None, aten_ms=None):
    launches = [proof.LaunchResult(chosen, ms=ms, status="proven")] if chosen else []
    record = proof.ProofRecord(op=fl.OP, shape=fl.proof_shape(m, n, k, form),
                               environment=fl.proof_environment("cuda", form),
                               chosen=chosen, reason=reason, launches=launches, reference_ms=aten_ms)
    proof.remember_proof(record)


def test_the_plan_follows_the_proofs_made_here(monkeypatch, proof_sandbox):
    """Each launch of a block runs our GEMM only where a proof made here found a tile bit-identical and faster; the
    plan packs Q/K/V only with the attention kernel, and puts the norms and GELU into epilogues only where those
    parts were proven too (a build proves the four plain launches; the others only if a proof exists)."""
    from kkdeploy.kernels import faithful_attention as fa

    monkeypatch.setattr(fl, "triton_available", lambda: True)
    monkeypatch.setattr(fa, "select_attention_path", lambda *a, **k: fa.AttentionPath("triton", "test", "bm64"))
    config = TransformerConfig(batch_size=64, seq_len=128, d_model=128, num_heads=4, ffn_dim=256, num_layers=1)
    m = 64 * 128
    cuda = torch.device("cuda")
    plan = fb.block_plan(config, torch.float16, cuda)
    assert plan["gemms"] is False and not any(plan["linears"].values())
    assert fb.linear_launches(config) == {"qkv": (m, 384, 128, "none"), "out_proj": (m, 128, 128, "add_masked"),
                                          "ffn_in": (m, 256, 128, "none"), "ffn_out": (m, 128, 256, "masked_sum")}
    _remember_linear(proof_sandbox, m, 128, 128, "add_masked", chosen="m64")
    plan = fb.block_plan(config, torch.float16, cuda)
    assert plan["gemms"] and plan["linears"] == {"qkv": False, "out_proj": True, "ffn_in": False, "ffn_out": False}
    assert not plan["packed_qkv"]
    path = fl.linear_path(m, 128, 128, torch.float16, cuda, epilogue="add_masked")
    assert path.fused and path.launch == "m64" and "m64" in path.reason
    _remember_linear(proof_sandbox, m, 384, 128, "none")
    assert fb.block_plan(config, torch.float16, cuda)["packed_qkv"]
    # the LayerNorm epilogues: proven, and by the proofs' timings faster than the two residual launches plus two
    # LayerNorms they replace (the rows kernel where proven)
    from kkdeploy.kernels import layer_norm as ln

    _remember_linear(proof_sandbox, m, 128, 128, "add_masked", chosen="m64", ms=0.010, aten_ms=0.020)
    _remember_linear(proof_sandbox, m, 128, 256, "masked_sum", chosen=None, aten_ms=0.015)
    proof_sandbox.remember_proof(proof_sandbox.ProofRecord(
        op=ln.OP, shape=ln.proof_shape(m, 128), environment=ln.proof_environment("cuda"), chosen="rows2",
        launches=[proof_sandbox.LaunchResult("rows2", ms=0.004, status="proven")], reference_ms=0.009))
    _remember_linear(proof_sandbox, m, 128, 128, "add_masked+layer_norm", ms=0.012, aten_ms=0.05)
    _remember_linear(proof_sandbox, m, 128, 256, "masked_sum+layer_norm", ms=0.030, aten_ms=0.05)
    assert not fb.block_plan(config, torch.float16, cuda)["layer_norm"]  # 0.042 ms against 0.010 + 0.015 + 2 x 0.004
    _remember_linear(proof_sandbox, m, 128, 256, "masked_sum+layer_norm", ms=0.016, aten_ms=0.05)
    _remember_linear(proof_sandbox, m, 128, 256, "gelu_prologue+masked_sum+layer_norm")
    plan = fb.block_plan(config, torch.float16, cuda)  # 0.028 ms against 0.033
    assert plan["layer_norm"] and plan["gelu_prologue"] and not plan["gelu"]
    # a proof that found our tile bit-identical but slower than cuBLAS keeps ATen (shape 8 on the H200)
    _remember_linear(proof_sandbox, m, 256, 128, "none", chosen=None, reason="ATen is as fast or faster")
    slower = fl.linear_path(m, 256, 128, torch.float16, cuda)
    assert not slower.fused and "ATen is as fast or faster" in slower.reason


def test_the_tiles_a_build_proves():
    # sizes unknown: the small tiles are not ruled out; the 64 x 64 one is where the row is narrower than its 64
    # columns, and the 32-column ones keep shape 7's 32-wide rows
    small = ["m64n32", "m64n16", "m32n32"]
    assert fl.proof_launches(128, k=128) == ["auto", "m64", "n64", "m64n64", *small]
    assert fl.proof_launches(384, k=768) == ["auto", "m64", "n64", "n256", "m64n64", *small]
    assert fl.proof_launches(32, k=32) == ["auto", "m64", *small]
    # shape 3's launches (512 rows: 4 "auto" tiles on 132 multiprocessors) prove them; shape 6's do not
    assert fl.proof_launches(128, k=128, m=512, sms=132) == ["auto", "m64", "n64", "m64n64", *small]
    assert "m64n64" not in fl.proof_launches(128, k=128, m=1_280_000, sms=132)
    assert fl.proof_launches(128, layer_norm=True) == ["auto", "regs", "regs_w4"]
    # studied (every tile, scripts/kernel_selftest.py --all-launches), not in builds: the TMA tiles wait for a build
    # on the GPU to ship them through the strict validation (the 64 x 64 one has, and the narrower small tiles since
    # session 49); the rest were never the fastest
    assert set(fl.TILES) - set(fl.BUILD_TILES) == {"tma", "tma_n256", "tma_persistent", "tma_ws", "tma_ws_k128", "s4",
                                                   "k128", "w4", "m256", "n256s4"}
    assert {"m64n32", "m64n16", "m32n32"} <= set(fl.SMALL_TILES) & set(fl.BUILD_TILES)
    # a launch-bound GEMM (shape 3's out_proj) proves them beside "m64n64"; shape 6's streams past them
    assert fl.proof_launches(128, k=128, m=512, sms=132)[-4:] == ["m64n64", "m64n32", "m64n16", "m32n32"]
    assert not {"m64n32", "m64n16", "m32n32"} & set(fl.proof_launches(128, k=128, m=1_280_000, sms=132))
    # the columns-first tiles only where a launch has several column tiles over rows that outgrow L2 (shape 6's Q|K|V)
    assert fl.proof_launches(384, k=128, m=1_280_000, sms=132)[-2:] == ["cols", "m64s2cols"]
    assert not {"cols", "m64s2cols"} & set(fl.proof_launches(384, k=128, m=512, sms=132))
    assert not fl.tile_fits("k128", 128, 64) and fl.tile_fits("k128", 128, 128)  # no k-step longer than K
    assert fl.tile_fits("tma", 128, 128) and fl.tile_fits("tma_n256", 384, 768)
    assert not fl.tile_fits("tma", 128, 36)  # rows of 72 bytes: TMA reads multiples of 16
    assert fl.tile_config("n64", 128, 128) == {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 4, "num_stages": 4}


def test_the_layer_norm_epilogue_s_tiles(monkeypatch):
    """The LayerNorm epilogue's tiles: the register ones apply to rows of 128 only, a build proves all three (a GPU
    build shipped them through strict validation), and each tile's settings reach the launch (and, at run time, the
    proof's choice)."""
    from kkdeploy.kernels import _fused_linear_triton, model_proofs
    from kkdeploy.kernels.paths import KernelPath

    assert fl.LN_BUILD_TILES == ("auto", "regs", "regs_w4")
    # studied until a GPU build ships them
    assert set(fl.LN_TILES) - set(fl.LN_BUILD_TILES) == {"regs_w16", "regs_e", "regs_m32", "regs_m16"}
    assert fl.ln_tile_fits("regs", 128) and not fl.ln_tile_fits("regs", 32) and fl.ln_tile_fits("auto", 32)
    assert not fl.ln_tile_fits("m64", 128)  # a GEMM tile is not one of the LayerNorm epilogue's
    assert fl.proof_launches(128, layer_norm=True) == ["auto", "regs", "regs_w4"]
    assert fl.proof_launches(32, layer_norm=True) == ["auto"]  # rows under 128 are always read back
    seen = []
    monkeypatch.setattr(_fused_linear_triton, "triton_linear_layer_norm", lambda *a, **kw: seen.append(kw) or (1, 2))
    x, w, b = torch.zeros(4, 8, dtype=torch.float16), torch.zeros(128, 8, dtype=torch.float16), torch.zeros(128)
    args = (x, w, b, None, None, None, None, 1e-5, "add_masked")
    fl.run_layer_norm_launch(*args, launch="regs_w4")
    fl.run_layer_norm_launch(*args)
    assert seen == [{"LN_RELOAD": False, "num_warps": 4, "EARLY": True}, {}]
    with pytest.raises(KKError, match="tile 'regs' does not apply to rows of 32"):
        fl.run_layer_norm_launch(x, w[:32], b[:32], None, None, None, None, 1e-5, "add_masked", launch="regs")
    # at run time the CUDA kernel launches the tile the proof chose
    launched = []
    monkeypatch.setattr(fl, "check_layer_norm_epilogue", lambda *a: (4, 128, 8))
    monkeypatch.setattr(fl, "linear_path", lambda *a, **kw: KernelPath("triton", "proven", "regs"))
    monkeypatch.setattr(fl, "run_layer_norm_launch", lambda *a: launched.append(a[-1]))
    fl._linear_layer_norm_cuda(x, w, b, None, None, None, None, 1e-5, "add_masked")
    assert launched == ["regs"]
    # the build's proof of a model (or --all-launches) hands each form the tiles of its own kind
    lists = []
    monkeypatch.setattr(fl, "prove_linear", lambda *a, launches=None, **kw: lists.append(launches))

    class Cases:
        def linear(self, name):
            return []

    every = ["auto", "m64", "tma", "regs", "regs_w4"]
    for n, form_ in ((128, "add_masked+layer_norm"), (32, "masked_sum+layer_norm"), (128, "add_masked")):
        model_proofs._prove("linear", "out_proj", fl.proof_shape(512, n, 128, form_), Cases(), None, "cpu", 1.0,
                            None, None, every)
    assert lists == [["auto", "regs", "regs_w4"], ["auto"], ["auto", "m64", "tma"]]


def test_tiles_are_proven_only_where_they_can_pay(monkeypatch):
    """With the studied tiles in BUILD_TILES, a build proves the TMA tiles only at K >= TMA_MIN_K (shape 8, the
    D = 384 and 1024 shapes) and the 64 x 64 tile only where "auto"'s grid leaves multiprocessors idle: shape 6's launches
    (K = 128, 10,000 row tiles) compile nothing more."""
    monkeypatch.setattr(fl, "BUILD_TILES", fl.BUILD_TILES + ("tma", "tma_n256"))
    # shape 6's Q|K|V: K = 128, 1.28 M rows: neither pays (the streaming and columns-first tiles do)
    assert fl.proof_launches(384, k=128, m=1_280_000, sms=132) == ["auto", "m64", "n64", "n256", "m64s2", "cols",
                                                                    "m64s2cols"]
    # shape 8's Q|K|V: K = 1024, 8192 rows (64 x 3 "auto" tiles >= 132): the TMA tiles, not the 64 x 64 one
    assert fl.proof_launches(3072, k=1024, m=8192, sms=132) == ["auto", "m64", "n64", "n256", "tma", "tma_n256"]
    # one sequence of 1024 at D = 1024 (8 x 8 "auto" tiles < 132): all the small tiles and the TMA ones
    assert fl.proof_launches(1024, k=1024, m=1024, sms=132) == ["auto", "m64", "n64", "n256", "m64n64", "m64n32",
                                                                  "m64n16", "m32n32", "tma", "tma_n256"]
    assert fl.tile_pays("m64n64", None, 1024, 1024, None)  # sizes unknown: not ruled out
    assert not fl.tile_pays("tma", 1024, 1024, 128, 132) and fl.tile_pays("tma", 3200, 384, 384, 132)
    assert fl.tile_pays("tma", 1024, 1024, None, 132)
    assert fl.multiprocessors("cpu") is None
    with pytest.raises(KKError, match="unknown GEMM tile 'm32'"):
        fl.tile_config("m32", 128, 128)


def test_the_streaming_tile_is_proven_where_rows_stream_and_computes_what_m64_computes():
    """``m64s2`` (64 rows, two stages: half the shared memory of the other tiles at K <= 128) is proven only for known
    launches that stream their rows: K <= 128 and at least 16 row tiles of 64 per multiprocessor (shape 6, not shape
    13 or the launch-bound shapes). Compiled for sm_90a it issues the proven ``m64`` tile's wgmma and floating-point
    instructions in the same order, every epilogue and the GELU prologue: only the pipeline's depth differs."""
    assert fl.proof_launches(128, k=128, m=1_280_000, sms=132) == ["auto", "m64", "n64", "m64s2"]  # shape 6
    assert "m64s2" not in fl.proof_launches(128, k=128, m=65_536, sms=132)  # shape 13: 1,024 row tiles
    assert "m64s2" not in fl.proof_launches(128, k=128)  # sizes unknown: not proven
    assert "m64s2" not in fl.proof_launches(384, k=384, m=1_280_000, sms=132)  # K past a short loop
    assert fl.tile_config("m64s2", 128, 128) == {"BLOCK_M": 64, "num_warps": 4, "num_stages": 2}
    pytest.importorskip("triton")
    import re

    from kkdeploy.kernels.dependent_launch import arithmetic_opcodes

    script = load_script("offline_ptx")
    arithmetic = lambda ptx: [op for op in arithmetic_opcodes(ptx) if "wait_group" not in op]  # noqa: E731
    for epilogue, gelu in ((0, False), (3, False), (1, False), (0, True)):
        values = {**script.KERNELS["linear"][3], "EPILOGUE": epilogue, "HAS_MASK": epilogue == 3, "BLOCK_M": 64,
                  "A_GELU": gelu}
        proven, streaming = script.compile_ptx("linear", values, 4, 4), script.compile_ptx("linear", values, 4, 2)
        assert arithmetic(streaming) == arithmetic(proven), (epilogue, gelu)
        wgmma = {"wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16"}
        assert set(re.findall(r"wgmma\.mma_async\S*", streaming)) == wgmma


def tile_race_script(seed: int, cases: str, race: str) -> str:
    """An interpreter script: for each (m, n, k, epilogue, prologue) of ``cases``, random inputs, then ``race``
    (indented code that sets ``got`` and ``want`` per ``tile`` and appends to ``results``); prints the results."""
    return f"""
import json, torch
from kkdeploy.kernels._fused_linear_triton import triton_linear
from kkdeploy.kernels.fused_linear import TILES
results = []
g = torch.Generator().manual_seed({seed})
for m, n, k, epilogue, prologue in {cases}:
    x = (torch.randn(m, k, generator=g) * 2).half()
    w, b = (torch.randn(n, k, generator=g) / 4).half(), torch.randn(n, generator=g).half()
    r = torch.randn(m, n, generator=g).half()
    mask = torch.rand(m, generator=g) > 0.3
    residual = r if epilogue in ("add_masked", "masked_sum") else None
    keep = mask if residual is not None else None
{race}
        results.append({{"case": [m, n, k, epilogue, prologue, tile],
                        "differing": int((got.view(torch.int16) != want.view(torch.int16)).sum())}})
print("RESULTS " + json.dumps(results))
"""


# several column and row tiles, K tails, every epilogue and the GELU prologue
COLUMNS_SCRIPT = tile_race_script(12, """((300, 200, 64, "add_masked", "none"), (130, 384, 32, "none", "none"),
                                    (70, 160, 48, "gelu", "none"), (200, 256, 32, "masked_sum", "gelu"))""", """
    for tile, base in (("cols", "auto"), ("m64s2cols", "m64s2")):
        got = triton_linear(x, w, b, residual, keep, epilogue, prologue, **TILES[tile])
        want = triton_linear(x, w, b, residual, keep, epilogue, prologue, **TILES[base])""")


def test_the_columns_first_tiles_are_for_launches_whose_rows_outgrow_l2():
    """A columns-first grid pays only where a launch has several column tiles and its X does not stay in L2 between
    them: shape 6's Q|K|V (three column tiles over 328 MB), not its one-tile launches, not shape 13's 16 MB, and not
    where the sizes are unknown or the row tiles pass the grid's y limit."""
    assert {"cols", "m64s2cols"} <= set(fl.BUILD_TILES)
    assert fl.proof_launches(384, k=128, m=1_280_000, sms=132)[-3:] == ["m64s2", "cols", "m64s2cols"]
    assert not {"cols", "m64s2cols"} & set(fl.proof_launches(128, k=128, m=1_280_000, sms=132))  # one column tile
    assert not {"cols", "m64s2cols"} & set(fl.proof_launches(384, k=128, m=65_536, sms=132))  # shape 13: in L2
    assert not {"cols", "m64s2cols"} & set(fl.proof_launches(384, k=128))  # sizes unknown
    assert not fl.tile_pays("cols", 128 * (fl.MAX_GRID_Y + 1), 384, 128, 132)  # more row tiles than the grid's y
    assert fl.tile_pays("cols", 128 * fl.MAX_GRID_Y, 384, 128, 132)
    assert fl.tile_config("m64s2cols", 384, 128) == {"BLOCK_M": 64, "num_warps": 4, "num_stages": 2,
                                                      "COLUMNS_FIRST": True}


def test_a_columns_first_tile_computes_what_its_tile_computes():
    """Under the interpreter, bit for bit, with row, column and K tails, every epilogue and the GELU prologue; and
    compiled here for sm_90a (Triton 3.6.0, as on the GPU) the same wgmma, floating-point and conversion
    instructions in the same order: only the integer arithmetic of which program takes which tile moves."""
    results = run_interpreter_script(COLUMNS_SCRIPT)
    assert len(results) == 8 and all(r["differing"] == 0 for r in results), results
    pytest.importorskip("triton")
    import collections
    import re

    from kkdeploy.kernels.dependent_launch import arithmetic_opcodes

    script = load_script("offline_ptx")
    for epilogue, gelu, block_m, warps, stages in ((0, False, 128, 8, 3), (3, False, 64, 4, 2), (1, False, 128, 8, 3),
                                                    (2, True, 64, 4, 2)):
        values = {**script.KERNELS["linear"][3], "EPILOGUE": epilogue, "HAS_MASK": epilogue >= 2, "A_GELU": gelu,
                  "BLOCK_M": block_m}
        rows_first = script.compile_ptx("linear", values, warps, stages)
        columns_first = script.compile_ptx("linear", {**values, "COLUMNS_FIRST": True}, warps, stages)
        assert arithmetic_opcodes(columns_first) == arithmetic_opcodes(rows_first), (epilogue, gelu)
        mma = lambda ptx: collections.Counter(re.findall(r"wgmma\.mma_async\S*", ptx))  # noqa: E731
        assert mma(columns_first) == mma(rows_first) and mma(rows_first)
        assert re.search(r"%ctaid\.y", columns_first) and re.search(r"%ctaid\.x", columns_first)


# the epilogue's operands loaded before the k-loop (``EARLY``) against the same tile loading them after it: every
# epilogue, the GELU prologue, row, column and K tails, and the LayerNorm epilogue read back and in registers
EARLY_SCRIPT = tile_race_script(13, """((300, 200, 64, "add_masked", "none"), (130, 128, 128, "add_masked", "none"),
                                  (70, 160, 48, "gelu", "none"), (200, 128, 96, "masked_sum", "gelu"),
                                  (64, 96, 32, "none", "none"))""", """
    from kkdeploy.kernels._fused_linear_triton import triton_linear_layer_norm
    from kkdeploy.kernels.fused_linear import LN_TILES
    pairs = []
    for tile in ("auto", "m64n64"):
        late = {**TILES[tile], "EARLY": False}
        pairs.append((tile, triton_linear(x, w, b, residual, keep, epilogue, prologue, **{**late, "EARLY": True}),
                      triton_linear(x, w, b, residual, keep, epilogue, prologue, **late)))
    if residual is not None and n == 128:
        lw, lb = (torch.rand(n, generator=g) + 0.5).half(), (torch.randn(n, generator=g) * 0.1).half()
        for tile in ("auto", "regs", "regs_w4", "regs_w16"):
            for zero_invalid in (False, True):
                kw = dict(prologue=prologue, zero_invalid=zero_invalid, **{**LN_TILES[tile], "EARLY": False})
                args = (x, w, b, r, mask, lw, lb, 1e-5, epilogue)
                pairs.append((tile + "+layer_norm", torch.cat(triton_linear_layer_norm(*args, **{**kw, "EARLY": True})),
                              torch.cat(triton_linear_layer_norm(*args, **kw))))
    for tile, got, want in pairs:""")


def test_the_epilogue_s_operands_loaded_early_change_no_bit():
    """``EARLY`` moves the loads of the bias, the residual and the mask ahead of the k-loop (one round trip to L2 fewer
    on a short launch's critical path). Under the interpreter, bit for bit the tile that loads them after the loop;
    compiled here for sm_90a (Triton 3.6.0, as on the GPU), the same wgmma and floating-point instructions in the
    same order for the GEMM tiles and the 8-warp LayerNorm epilogue, and the tile without it compiles as before."""
    results = run_interpreter_script(EARLY_SCRIPT)
    assert len(results) == 5 * 2 + 2 * 8 and all(r["differing"] == 0 for r in results), results
    pytest.importorskip("triton")
    from kkdeploy.kernels.dependent_launch import arithmetic_opcodes

    script = load_script("offline_ptx")
    arithmetic = lambda ptx: [op for op in arithmetic_opcodes(ptx) if "wait_group" not in op]  # noqa: E731
    for epilogue, gelu, block_m, block_n, warps, stages, reload in (
            (0, False, 64, 64, 4, 4, 0), (1, False, 64, 64, 4, 4, 0), (3, False, 64, 64, 4, 4, 0),
            (2, True, 128, 128, 8, 3, 0), (5, False, 64, 128, 8, 3, 0), (4, False, 64, 128, 8, 3, 1)):
        values = {**script.KERNELS["linear"][3], "EPILOGUE": epilogue, "HAS_MASK": epilogue >= 2, "A_GELU": gelu,
                  "BLOCK_M": block_m, "BLOCK_N": block_n, "LN_RELOAD": reload}
        late = script.compile_ptx("linear", values, warps, stages)
        early = script.compile_ptx("linear", {**values, "EARLY": True}, warps, stages)
        assert arithmetic(early) == arithmetic(late) and arithmetic(late), (epilogue, gelu, block_m)
        if epilogue >= 4:  # the LayerNorm's weight and bias loaded early too (``regs_e``); read back, ignored
            ln_early = script.compile_ptx("linear", {**values, "EARLY": True, "LN_EARLY": True}, warps, stages)
            assert arithmetic(ln_early) == arithmetic(early)
            assert (ln_early == early) == bool(reload), epilogue


# tiles under 64 rows against the proven tiles they would replace: row, column and K tails, every epilogue, the GELU
# prologue, and the LayerNorm epilogue with and without the final LayerNorm's zeros
SMALL_ROWS_SCRIPT = tile_race_script(14, """((300, 200, 64, "add_masked", "none"),
                                       (130, 128, 128, "add_masked", "none"), (70, 160, 48, "gelu", "none"),
                                       (200, 128, 96, "masked_sum", "gelu"))""", """
    from kkdeploy.kernels._fused_linear_triton import triton_linear_layer_norm
    from kkdeploy.kernels.fused_linear import LN_TILES
    pairs = [(tile, triton_linear(x, w, b, residual, keep, epilogue, prologue, **TILES[tile]),
              triton_linear(x, w, b, residual, keep, epilogue, prologue, **TILES["m64n64"]))
             for tile in ("m64n32", "m64n16", "m32n32")]
    if residual is not None and n == 128:
        lw, lb = (torch.rand(n, generator=g) + 0.5).half(), (torch.randn(n, generator=g) * 0.1).half()
        for tile in ("regs_w16", "regs_e", "regs_m32", "regs_m16"):
            for zero_invalid in (False, True):
                args = (x, w, b, r, mask, lw, lb, 1e-5, epilogue)
                got = triton_linear_layer_norm(*args, prologue=prologue, zero_invalid=zero_invalid, **LN_TILES[tile])
                want = triton_linear_layer_norm(*args, prologue=prologue, zero_invalid=zero_invalid,
                                                **LN_TILES["regs"])
                pairs.append((tile + "+layer_norm", torch.cat(got), torch.cat(want)))
    for tile, got, want in pairs:""")


def test_the_launch_bound_study_tiles_compute_what_the_proven_tiles_compute(monkeypatch):
    """Session 48's study tiles for the launch-bound shapes: the narrower GEMM tiles (``m64n32``, ``m64n16``, the
    32-row probe ``m32n32``) and the LayerNorm epilogue's ``regs_w16``, ``regs_e`` (its weight and bias loaded
    early), ``regs_m32`` and ``regs_m16``. Under the interpreter each is bit for bit the proven tile it would
    replace, masks and tails included. Compiled for sm_90a (Triton 3.6.0, as on the GPU) the 64-row ones issue
    wgmma, as every proven tile does, and the ones under 64 rows mma.sync: another instruction, the one the
    attention's 32-row launches broke by an ulp (campaign 11). The GEMM tiles are in builds since GPU builds shipped
    them (session 49); the LayerNorm tiles wait for a plan that runs them."""
    results = run_interpreter_script(SMALL_ROWS_SCRIPT)
    assert len(results) == 4 * 3 + 2 * 8 and all(r["differing"] == 0 for r in results), results
    assert {"m64n32", "m64n16", "m32n32"} <= set(fl.BUILD_TILES)  # shipped by GPU builds (session 49)
    assert not {"regs_w16", "regs_e", "regs_m32", "regs_m16"} & set(fl.LN_BUILD_TILES)  # no plan ran them yet
    # once in a build, the LayerNorm tiles under 64 rows are proven only where 64-row programs leave
    # multiprocessors idle: shape 3's 8 and shape 12's 32 of 132, not shape 13's 1,024 or shape 6's 20,000
    assert fl.ln_tile_pays("regs_m16", 512, 132) and fl.ln_tile_pays("regs_m32", 2048, 132)
    assert not fl.ln_tile_pays("regs_m16", 65_536, 132) and not fl.ln_tile_pays("regs_m32", 1_280_000, 132)
    assert fl.ln_tile_pays("regs_m16", None, None) and fl.ln_tile_pays("regs", 1_280_000, 132)
    monkeypatch.setattr(fl, "LN_BUILD_TILES", ("auto", "regs", "regs_e", "regs_m32", "regs_m16"))
    assert fl.proof_launches(128, layer_norm=True, m=512, sms=132) == ["auto", "regs", "regs_e", "regs_m32", "regs_m16"]
    assert fl.proof_launches(128, layer_norm=True, m=65_536, sms=132) == ["auto", "regs", "regs_e"]
    assert fl.proof_launches(32, layer_norm=True, m=512, sms=132) == ["auto"]  # rows under 128 are read back
    # the narrower GEMM tiles as small tiles: where "auto"'s grid leaves multiprocessors idle (shape 3, not 6)
    assert all(fl.tile_pays(t, 512, 128, 128, 132) and not fl.tile_pays(t, 1_280_000, 128, 128, 132)
               for t in ("m64n32", "m64n16", "m32n32"))
    pytest.importorskip("triton")
    import re

    script = load_script("offline_ptx")
    for epilogue, block_m, block_n, warps, mma in (
            (1, 64, 32, 4, r"wgmma\.mma_async\.sync\.aligned\.m64n32k16\.f32\.f16\.f16"),
            (1, 64, 16, 4, r"wgmma\.mma_async\.sync\.aligned\.m64n16k16\.f32\.f16\.f16"),
            (5, 64, 128, 16, r"wgmma\.mma_async\.sync\.aligned\.m64n32k16\.f32\.f16\.f16"),
            (0, 32, 32, 4, r"mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.f16\.f16\.f32"),
            (5, 32, 128, 8, r"mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.f16\.f16\.f32"),
            (5, 16, 128, 8, r"mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.f16\.f16\.f32")):
        values = {**script.KERNELS["linear"][3], "EPILOGUE": epilogue, "HAS_MASK": epilogue >= 2, "EARLY": True,
                  "BLOCK_M": block_m, "BLOCK_N": block_n, "LN_EARLY": epilogue == 5}
        ptx = script.compile_ptx("linear", values, warps, 2)
        assert re.search(mma, ptx), (block_m, block_n, warps)
        assert ("wgmma" in ptx) == (block_m == 64), (block_m, block_n)
        assert "local" not in re.sub(r"//.*", "", ptx), (block_m, block_n)  # no spills


def test_the_sass_tail_counts_what_a_thread_runs_after_its_last_mma(tmp_path):
    """``scripts/offline_ptx.py --sass``'s "after the last MMA": from the last HGMMA/HMMA to the last EXIT. Compiled
    here for sm_90a, the 16-row LayerNorm tile's chain is under half the 64-row tile's, and the 16-column GELU GEMM's
    under a third of the 64-column one's (the figures docs/fused-linear.md gives)."""
    import subprocess
    from pathlib import Path

    script = load_script("offline_ptx")
    code = [(0, "LDG", None), (16, "HGMMA", None), (32, "HGMMA", None), (48, "FFMA", None), (64, "STG", None),
            (80, "EXIT", None), (96, "BRA", 96), (112, "NOP", None)]
    assert script.sass_tail(code) == (6, 3)
    triton = pytest.importorskip("triton")
    bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    if not (bin_dir / "ptxas").is_file() or not (bin_dir / "cuobjdump").is_file():
        pytest.skip("this Triton has no bundled ptxas/cuobjdump")

    def tail(warps: int, stages: int, **values) -> int:
        ptx = tmp_path / "k.ptx"
        ptx.write_text(script.compile_ptx("linear", {**script.KERNELS["linear"][3], "EARLY": True, **values}, warps,
                                          stages))
        subprocess.run([str(bin_dir / "ptxas"), "-arch=sm_90a", str(ptx), "-o", str(tmp_path / "k.cubin")],
                       check=True)
        return script.sass_tail(script.sass_code(tmp_path / "k.cubin", bin_dir / "cuobjdump"))[1]

    layer_norm = dict(EPILOGUE=5, BLOCK_N=128, LN_RELOAD=False, LN_EARLY=True)
    assert 2 * tail(8, 3, BLOCK_M=16, **layer_norm) < tail(8, 3, BLOCK_M=64, **layer_norm)
    gelu = dict(EPILOGUE=1, BLOCK_M=64, HAS_MASK=False)
    assert 3 * tail(4, 4, BLOCK_N=16, **gelu) < tail(4, 4, BLOCK_N=64, **gelu)


def test_block_plan_on_the_cpu_is_the_reference_block():
    plan = fb.block_plan(CONFIG, torch.float16, torch.device("cpu"))
    assert plan == {"gemms": False, "packed_qkv": False, "gelu_prologue": False, "gelu": False, "layer_norm": False,
                    "ffn_chain": False, "ffn_qkv": False, "qkv_attention": False, "norm_ffn_in": False,
                    "norm_qkv": False, "linears": {"qkv": False, "out_proj": False, "ffn_in": False, "ffn_out": False}}


def test_epilogues_are_the_reference_ops():
    torch.manual_seed(0)
    x, r = torch.randn(3, 5, 8), torch.randn(3, 5, 6)
    w, b = torch.randn(6, 8), torch.randn(6)
    mask = torch.tensor([[True, True, False, True, False]] * 3)
    y = F.linear(x, w, b)
    assert torch.equal(fl.fused_linear(x, [w], [b]), y)
    assert torch.equal(fl.fused_linear(x, [w], [b], epilogue="gelu"), F.gelu(y))
    assert torch.equal(fl.fused_linear(x, [w], [b], r, mask, "add_masked"), r + y.masked_fill(~mask[..., None], 0))
    got = fl.fused_linear(x, [w], [b], r, mask, "masked_sum")
    assert torch.equal(got, (r + y).masked_fill(~mask[..., None], 0))
    assert (got[~mask] == 0).all() and not torch.signbit(got[~mask]).any()  # +0 rows, as masked_fill writes
    assert torch.equal(fl.fused_linear(x, [w], [b], r, None, "masked_sum"), r + y)
    assert torch.equal(fl.fused_linear(x, [w], [b], r, mask, "masked_sum", prologue="gelu"),
                       (r + F.linear(F.gelu(x), w, b)).masked_fill(~mask[..., None], 0))
    packed = fl.fused_linear(x, [w, 2 * w, w], [b, b, -b])
    assert torch.equal(packed, torch.cat([y, F.linear(x, 2 * w, b), F.linear(x, w, -b)], dim=-1))


def test_packed_weights_are_made_once_and_follow_in_place_updates():
    w = [torch.randn(4, 3) for _ in range(3)]
    b = [torch.randn(4) for _ in range(3)]
    first = fl.packed(w, b)
    assert torch.equal(first[0], torch.cat(w)) and torch.equal(first[1], torch.cat(b))
    assert fl.packed(w, b)[0] is first[0]  # reused: no concatenation per call
    with torch.no_grad():
        w[1].add_(1.0)  # an in-place update (load_state_dict, copy_) bumps the version counter
    again = fl.packed(w, b)
    assert again[0] is not first[0] and torch.equal(again[0], torch.cat(w))
    with torch.inference_mode():  # weights made in inference mode have no version counter: no cache, same values
        wi, bi = [t.clone() for t in w], [t.clone() for t in b]
    assert torch.equal(fl.packed(wi, bi)[0], torch.cat(w)) and fl.packed(wi, bi)[0] is not fl.packed(wi, bi)[0]


def test_op_registration_passes_opcheck():
    x, r = torch.randn(4, 8), torch.randn(4, 6)
    w, b = torch.randn(6, 8), torch.randn(6)
    mask = torch.tensor([True, False, True, True])
    for args in ((x, [w], [b], None, None, "none"), (x, [w, w], [b, b], None, None, "none"),
                 (x, [w], [b], r, mask, "add_masked"), (x, [w], [b], r, mask, "masked_sum"),
                 (x, [w], [b], None, None, "gelu"), (x, [w], [b], r, mask, "masked_sum", "gelu")):
        torch.library.opcheck(torch.ops.kkdeploy_faithful.linear.default, args)


@pytest.mark.parametrize("call, message", [
    (lambda x, w, b, r, m: fl.fused_linear(x, [w], [b], epilogue="relu"), "epilogue must be one of"),
    (lambda x, w, b, r, m: fl.fused_linear(x, [w, w], [b], epilogue="none"), "one bias per weight"),
    (lambda x, w, b, r, m: fl.fused_linear(x, [w, w], [b, b], epilogue="gelu"),
     r"\(packed projections\) take epilogue"),
    (lambda x, w, b, r, m: fl.fused_linear(x, [w.t()], [b]), "every weight must be"),
    (lambda x, w, b, r, m: fl.fused_linear(x, [w], [b], prologue="relu"), "prologue must be one of"),
    (lambda x, w, b, r, m: fl.fused_linear(x, [w], [b], None, m, "add_masked"), "needs a residual of shape"),
    (lambda x, w, b, r, m: fl.fused_linear(x, [w], [b], r, m.int(), "masked_sum"), "the mask must be bool"),
])
def test_bad_calls_get_one_line_errors(call, message):
    x, r = torch.randn(4, 8), torch.randn(4, 6)
    w, b = torch.randn(6, 8), torch.randn(6)
    with pytest.raises(KKError, match=message) as info:
        call(x, w, b, r, torch.ones(4, dtype=torch.bool))
    assert "\n" not in str(info.value)


def test_path_rules(monkeypatch, proof_sandbox):
    monkeypatch.delenv(fl.PATH_ENV, raising=False)
    assert fl.linear_path(8, 4, 4, torch.float16, "cpu").kernel == "aten"
    monkeypatch.setattr(fl, "triton_available", lambda: True)
    path = fl.linear_path(8192, 128, 128, torch.float16, "cuda")
    assert not path.fused and "no proof in this environment" in path.reason
    _remember_linear(proof_sandbox, 8192, 128, 128, "none")
    assert fl.linear_path(8192, 128, 128, torch.float16, "cuda").fused
    assert not fl.linear_path(8192, 128, 128, torch.float16, "cuda", epilogue="masked_sum").fused  # another form
    assert not fl.linear_path(8192, 128, 64, torch.float16, "cuda").fused  # another size
    assert ("dtype torch.float32: ATen's ops run (the GEMM kernels reproduce the float16 reference only)"
            in fl.linear_path(8192, 128, 128, torch.float32, "cuda").reason)
    monkeypatch.setenv(fl.PATH_ENV, "aten")
    assert not fl.linear_path(8192, 128, 128, torch.float16, "cuda").fused
    monkeypatch.setenv(fl.PATH_ENV, "triton")
    forced = fl.linear_path(8192, 128, 64, torch.float16, "cuda")
    assert forced.fused and forced.launch == "auto"
    monkeypatch.setenv(fl.PATH_ENV, "sometimes")
    with pytest.raises(KKError, match="must be auto, aten or triton"):
        fl.linear_path(8, 4, 4, torch.float16, "cuda")


@pytest.mark.parametrize("masked_final", [False, True], ids=["final-apart", "final-masked"])
@pytest.mark.parametrize("ratio", [0.0, 0.25])
def test_gemms_candidate_export_is_bitwise_on_the_cpu(ratio, masked_final, monkeypatch):
    import engines.inductor_ops  # noqa: F401
    from engines.inductor import export_variant
    from kkdeploy.kernels import layer_norm

    monkeypatch.setattr(layer_norm, "MASKED_FINAL", masked_final)

    # the GPU plan (our GEMMs, Q/K/V one by one as where ATen's attention runs, GELU in the epilogue), whose ops run
    # their CPU kernels here: the ATen composition
    monkeypatch.setattr(fb, "block_plan", lambda *a: {"gemms": True, "packed_qkv": False, "gelu_prologue": False,
                                                      "gelu": True, "layer_norm": False, "linears": {}})
    model = build_models(CONFIG, torch.float32, "cpu")[0]
    exported = export_variant(model, CONFIG, torch.float32, torch.device("cpu"), "inductor", kernel_attention=True,
                              kernel_layer_norm=True, kernel_linear=True)
    targets = [str(n.target) for n in exported.graph.nodes if n.op == "call_function"]
    assert targets.count("kkdeploy_faithful.linear.default") == 6 * CONFIG.num_layers
    assert targets.count("kkdeploy_faithful.attention.default") == CONFIG.num_layers
    assert targets.count("kkdeploy_faithful.layer_norm_rows.default") == 2 * CONFIG.num_layers + (not masked_final)
    # final_norm and zero_invalid_rows: one op where builds take it, else the rows op and the reference's masked fill
    assert targets.count("kkdeploy_faithful.layer_norm_rows_zero_invalid.default") == masked_final
    assert targets.count("aten.masked_fill.Scalar") == (not masked_final)
    assert not any("gelu" in t or "addmm" in t or "softmax" in t for t in targets)
    x, mask = generate_case(CONFIG, "cpu", torch.float32, 1234, padding_ratio=ratio)
    with torch.no_grad():
        assert torch.equal(exported.module()(x, mask), model(x, mask))


@pytest.mark.parametrize("masked_final", [False, True], ids=["final-apart", "final-masked"])
@pytest.mark.parametrize("ratio", [0.0, 0.25])
def test_a_launch_whose_proof_chose_aten_is_the_references_ops_in_the_graph(ratio, masked_final, monkeypatch):
    """A launch the proof gave to ATen is not our op (whose fallback would run the GEMM, the mask's inversion,
    masked_fill and the add as four eager kernels inside one opaque call) but the reference's own ops in the graph,
    where Inductor fuses the residual and the mask: here out_proj and ffn_out, with Q/K/V and ffn_in ours."""
    import engines.inductor_ops  # noqa: F401
    from engines.inductor import export_variant

    from kkdeploy.kernels import layer_norm

    monkeypatch.setattr(layer_norm, "MASKED_FINAL", masked_final)
    linears = {"qkv": True, "out_proj": False, "ffn_in": True, "ffn_out": False}
    monkeypatch.setattr(fb, "block_plan", lambda *a: {"gemms": True, "packed_qkv": False, "gelu_prologue": False,
                                                      "gelu": False, "layer_norm": False, "linears": linears})
    model = build_models(CONFIG, torch.float32, "cpu")[0]
    exported = export_variant(model, CONFIG, torch.float32, torch.device("cpu"), "inductor", kernel_attention=True,
                              kernel_layer_norm=True, kernel_linear=True)
    targets = [str(n.target) for n in exported.graph.nodes if n.op == "call_function"]
    assert targets.count("kkdeploy_faithful.linear.default") == 4 * CONFIG.num_layers  # Q, K, V, ffn_in
    assert targets.count("aten.linear.default") == 2 * CONFIG.num_layers  # out_proj, ffn_out
    # theirs, and the output's invalid rows (inside the final op where builds take it)
    assert targets.count("aten.masked_fill.Scalar") == 2 * CONFIG.num_layers + (not masked_final)
    x, mask = generate_case(CONFIG, "cpu", torch.float32, 1234, padding_ratio=ratio)
    with torch.no_grad():
        assert torch.equal(exported.module()(x, mask), model(x, mask))


@pytest.mark.parametrize("ratio", [0.0, 0.25])
def test_export_with_the_norms_in_the_epilogues_is_bitwise_on_the_cpu(ratio, monkeypatch):
    import engines.inductor_ops  # noqa: F401
    from engines.inductor import export_variant

    monkeypatch.setattr(fb, "block_plan", lambda *a: dict(FULL_PLAN))
    model = build_models(CONFIG, torch.float32, "cpu")[0]
    exported = export_variant(model, CONFIG, torch.float32, torch.device("cpu"), "inductor", kernel_attention=True,
                              kernel_layer_norm=True, kernel_linear=True)
    targets = [str(n.target) for n in exported.graph.nodes if n.op == "call_function"]
    assert targets.count("kkdeploy_faithful.linear_layer_norm.default") == 2 * CONFIG.num_layers
    assert targets.count("kkdeploy_faithful.layer_norm_rows.default") == 1  # the first block's norm1 only
    x, mask = generate_case(CONFIG, "cpu", torch.float32, 1234, padding_ratio=ratio)
    with torch.no_grad():
        assert torch.equal(exported.module()(x, mask), model(x, mask))


def test_candidate_name_and_paths_record():
    from engines.recipe import parse
    from engines.torch_compile import GEMMS, default_variants, kernel_paths_record, uses_kernel_layer_norm

    recipe = parse(GEMMS)
    assert recipe.attention == "faithful-gemms" and recipe.name == GEMMS
    assert uses_kernel_layer_norm(GEMMS)
    assert GEMMS in default_variants(torch.device("cuda"))
    record = kernel_paths_record(GEMMS, CONFIG, torch.float16, torch.device("cpu"))
    assert record["linear_path"]["kernel"] == "aten" and "no GEMM proven" in record["linear_path"]["reason"]
    assert all("cpu device" in p["reason"] for p in record["linear_path"]["launches"].values())
    assert record["linear_path"]["plan"]["gemms"] is False
    assert {"attention_path", "layer_norm_path", "linear_path"} <= set(record)


INTERPRETER_SCRIPT = textwrap.dedent(
    """
    import json, math, os
    os.environ["TRITON_INTERPRET"] = "1"
    import numpy as np
    import torch
    from kkdeploy.kernels._fused_linear_triton import triton_linear

    def exact(shape, denominator, gen):  # small multiples of 1/denominator: every GEMM sum is exact
        return (torch.randint(-4, 5, shape, generator=gen).float() / denominator).half()

    def np_rsqrt(t):  # the interpreter's tl.math.rsqrt: numpy's 1 / sqrt in float32 (torch's CPU 1 / sqrt differs
        return torch.from_numpy(1 / np.sqrt(t.numpy()))  # from it by an ulp on some inputs)

    def erf32(t):  # the interpreter's tl.erf: math.erf in float64, rounded to float32
        return torch.from_numpy(np.vectorize(math.erf, otypes=[np.float64])(t.double().numpy()).astype(np.float32))

    gen = torch.Generator().manual_seed(0)
    results = []
    for m, n, k, overrides in ((70, 24, 40, {}), (130, 128, 128, {}), (64, 96, 32, {"BLOCK_N": 32}),
                               (200, 40, 72, {"BLOCK_M": 64, "BLOCK_K": 16})):
        x, w = exact((m, k), 4, gen), exact((n, k), 8, gen)
        b, r = exact((n,), 32, gen), exact((m, n), 2, gen)
        mask = torch.rand(m, generator=gen) > 0.3
        y = (x.float() @ w.float().t() + b.float()).half()  # exact, so any order gives these bits
        f = y.float()
        want = {
            "none": y,
            "gelu": ((f * 0.5) * (1.0 + erf32(f * 0.7071067811865476))).half(),
            "add_masked": (r.float() + torch.where(mask[:, None], y, torch.zeros_like(y)).float()).half(),
            "masked_sum": torch.where(mask[:, None], (r.float() + y.float()).half(), torch.zeros_like(y)),
        }
        for epilogue, ref in want.items():
            got = triton_linear(x, w, b, r, mask, epilogue, **overrides)
            results.append({"m": m, "n": n, "k": k, "epilogue": epilogue,
                            "differing": int((got.view(torch.int16) != ref.view(torch.int16)).sum())})
    # the residual epilogues followed by the next LayerNorm, against the emulation of ATen's order
    from kkdeploy.kernels._fused_linear_triton import triton_linear_layer_norm
    from kkdeploy.kernels.layer_norm import emulate_layer_norm_rows
    m, k = 200, 64
    mask = torch.rand(m, generator=gen) > 0.3
    x = exact((m, k), 4, gen)
    for n in (128, 32):  # a whole warp of lanes, and 8 lanes with 24 empty ones (shape 7's rows)
        w, b = exact((n, k), 8, gen), exact((n,), 32, gen)
        r = (torch.randn(m, n, generator=gen) * 2).half()
        lw, lb = (torch.rand(n, generator=gen) + 0.5).half(), (torch.randn(n, generator=gen) * 0.1).half()
        for epilogue, reload, zero_invalid in (("add_masked", True, False), ("add_masked", False, False),
                                               ("masked_sum", True, False), ("masked_sum", False, False),
                                               ("masked_sum", True, True)):
            if n < 128 and not reload:
                continue  # rows under 128 are always read back
            total, normed = triton_linear_layer_norm(x, w, b, r, mask, lw, lb, 1e-5, epilogue, BLOCK_M=64,
                                                     LN_RELOAD=reload, zero_invalid=zero_invalid)
            want_total = triton_linear(x, w, b, r, mask, epilogue)
            want = emulate_layer_norm_rows(want_total, lw, lb, 1e-5, rsqrt=np_rsqrt)
            if zero_invalid:
                want = want.masked_fill(~mask[:, None], 0)
            results.append({"m": m, "n": n, "k": k, "epilogue": epilogue + "+layer_norm", "reload": reload,
                            "zero_invalid": zero_invalid,
                            "differing": int((total.view(torch.int16) != want_total.view(torch.int16)).sum())
                            + int((normed.view(torch.int16) != want.view(torch.int16)).sum())})
    n = 128
    r = (torch.randn(m, n, generator=gen) * 2).half()
    # the GELU prologue: the GEMM of GELU(x), against the same GEMM on GELU(x) computed apart (interpreter's erf)
    x = (torch.randn(96, 64, generator=gen) * 2).half()
    w, b = exact((128, 64), 8, gen), exact((128,), 32, gen)
    f = x.float()
    gx = ((f * 0.5) * (1.0 + erf32(f * 0.7071067811865476))).half()
    for epilogue in ("none", "masked_sum"):
        got = triton_linear(x, w, b, r[:96], mask[:96], epilogue, prologue="gelu", BLOCK_M=64)
        ref = triton_linear(gx, w, b, r[:96], mask[:96], epilogue, BLOCK_M=64)
        results.append({"m": 96, "n": 128, "k": 64, "epilogue": "gelu_prologue+" + epilogue,
                        "differing": int((got.view(torch.int16) != ref.view(torch.int16)).sum())})
    # ffn_out's whole launch in fused_model_forward: the GELU prologue, residual + mask, the next LayerNorm
    lw, lb = (torch.rand(128, generator=gen) + 0.5).half(), (torch.randn(128, generator=gen) * 0.1).half()
    total, normed = triton_linear_layer_norm(x, w, b, r[:96], mask[:96], lw, lb, 1e-5, "masked_sum", prologue="gelu",
                                             BLOCK_M=64, zero_invalid=True)
    want_total = triton_linear(gx, w, b, r[:96], mask[:96], "masked_sum", BLOCK_M=64)
    want = emulate_layer_norm_rows(want_total, lw, lb, 1e-5, rsqrt=np_rsqrt)
    want = want.masked_fill(~mask[:96, None], 0)
    results.append({"m": 96, "n": 128, "k": 64, "epilogue": "gelu_prologue+masked_sum+layer_norm",
                    "differing": int((total.view(torch.int16) != want_total.view(torch.int16)).sum())
                    + int((normed.view(torch.int16) != want.view(torch.int16)).sum())})
    print("RESULTS " + json.dumps(results))
    """
)


def test_triton_kernel_logic_under_the_interpreter():
    results = run_interpreter_script(INTERPRETER_SCRIPT)
    assert len(results) == 27
    assert all(r["differing"] == 0 for r in results), results


def test_fma32_rounds_once():
    """``layer_norm.fma32`` (the emulation's fma) against exact rationals rounded to float32, ties to even."""
    from fractions import Fraction

    from kkdeploy.kernels.layer_norm import fma32

    g = torch.Generator().manual_seed(5)
    a, b = torch.randn(3000, generator=g), torch.randn(3000, generator=g)
    c = torch.randn(3000, generator=g) * torch.logspace(-8, 2, 3000)
    got = fma32(a, b, c)
    for i in range(3000):
        exact = Fraction(float(a[i])) * Fraction(float(b[i])) + Fraction(float(c[i]))
        assert float(got[i]) == round_to_float32(exact), i


def test_the_layer_norm_emulation_is_a_layer_norm():
    """Sanity of ``emulate_layer_norm_rows`` on the CPU (its bits are checked against ATen's kernel on the GPU by
    scripts/fused_linear_selftest.py for rows of at most 128; the interpreter test above pins those rows to the
    fused epilogue bit for bit): a constant row gives the bias exactly, and every element is within one float16
    rounding of a float64 LayerNorm, at every width ATen's vector path takes."""
    from kkdeploy.kernels.layer_norm import emulate_layer_norm_rows

    g = torch.Generator().manual_seed(2)
    for width in (128, 32, 4, 132, 384, 1024):  # past 128: ATen's warps 1..3 hold data too
        x = (torch.randn(256, width, generator=g) * 3 + 1).half()
        x[0] = 1.5
        w, b = (torch.rand(width, generator=g) + 0.5).half(), (torch.randn(width, generator=g) * 0.1).half()
        got = emulate_layer_norm_rows(x, w, b, 1e-5, rsqrt=lambda t: 1 / torch.sqrt(t))
        assert torch.equal(got[0], b)
        ref = F.layer_norm(x.double(), (width,), w.double(), b.double(), 1e-5)
        ulp = torch.finfo(torch.float16).eps * ref.abs().clamp_min(2 ** -14)
        assert ((got.double() - ref).abs() <= ulp).all()


def test_the_gpu_selftest_says_it_needs_a_gpu(capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the script would run")
    assert load_script("fused_linear_selftest").main(["--out", "/dev/null"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_the_offline_compile_script_names_bad_input_in_one_line(tmp_path, capsys):
    script = load_script("offline_ptx")
    assert script.main(["linear", "--triton", str(tmp_path)]) == 2
    assert "no Triton with a bundled ptxas" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="give NAME=VALUE with NAME one of EPILOGUE"):
        script.parse_constexprs(["FOO=1"], script.KERNELS["linear"][3])
    values = script.parse_constexprs(["EPILOGUE=5", "LN_RELOAD=1"], script.KERNELS["linear"][3])
    assert values["EPILOGUE"] == 5 and values["LN_RELOAD"] is True and values["BLOCK_M"] == 128


def test_the_offline_compile_script_knows_every_kernel_argument():
    """Its signatures follow the kernels' parameter lists (read from the source: no Triton needed)."""
    import ast
    from pathlib import Path

    script = load_script("offline_ptx")
    repo = Path(__file__).resolve().parents[1]
    for module, name, runtime, constexprs in script.KERNELS.values():
        tree = ast.parse((repo / (module.replace(".", "/") + ".py")).read_text())
        fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name)
        assert sorted(a.arg for a in fn.args.args) == sorted([*runtime, *constexprs]), name


def test_the_gelu_launches_link_cuda_libdevice_and_prove_with_it(monkeypatch, tmp_path):
    """ATen's GELU is CUDA's ``erff``: the launches with a GELU part (epilogue or prologue) link CUDA's libdevice for
    themselves only, and the file is part of the GEMM proofs' environment key, so a proof made with another libdevice
    is not taken for one made with it."""
    from kkdeploy.kernels import _fused_linear_triton as kernel
    from kkdeploy.kernels import fused_linear, libdevice

    launches: list[dict] = []
    monkeypatch.setattr(kernel, "INTERPRET", False)
    monkeypatch.setattr(kernel, "launch_kernel", lambda fn, grid, *args, **kwargs: launches.append(kwargs))
    bc = tmp_path / "libdevice.10.bc"
    bc.write_bytes(b"CUDA libdevice")
    monkeypatch.setenv(libdevice.LIBDEVICE_ENV, str(bc))
    x, w, b = torch.zeros(64, 32, dtype=torch.float16), torch.zeros(32, 32, dtype=torch.float16), torch.zeros(32)
    kernel.triton_linear(x, w, b)
    kernel.triton_linear(x, w, b, epilogue="gelu")
    kernel.triton_linear(x, w, b, torch.zeros(64, 32, dtype=torch.float16), None, "masked_sum", prologue="gelu")
    assert "extern_libs" not in launches[0]
    assert launches[1]["extern_libs"] == {"libdevice": str(bc)} == launches[2]["extern_libs"]

    with_file = fused_linear.proof_environment("cpu", "gelu")
    other = tmp_path / "other.bc"
    other.write_bytes(b"another libdevice")
    monkeypatch.setenv(libdevice.LIBDEVICE_ENV, str(other))
    assert fused_linear.proof_environment("cpu", "gelu") != with_file


def test_a_build_proves_ffn_in_with_its_gelu_and_the_plan_takes_it_where_proven(monkeypatch, proof_sandbox):
    """The proof step's GELU-epilogue launch (one kernel instead of the GEMM and ATen's GELU): timed against both of
    those, and fused into the block where its proof found a tile bit-identical and faster."""
    from kkdeploy.kernels import model_proofs

    config = TransformerConfig(batch_size=4, seq_len=32, d_model=32, num_heads=2, ffn_dim=64, num_layers=1)
    m = 4 * 32
    assert fb.gelu_launches(config) == {"ffn_in_gelu": (m, 64, 32, "gelu")}
    assert ("linear", "ffn_in_gelu", fl.proof_shape(m, 64, 32, "gelu")) in \
        model_proofs.kernel_op_shapes(config, ["linear"])
    torch.manual_seed(3)
    x, w, b = torch.randn(m, 32), torch.randn(64, 32), torch.randn(64)
    (y,) = fl.compiled_baseline(x, [w], [b], epilogue="gelu")()
    assert torch.equal(y, F.gelu(F.linear(x, w, b), approximate="none"))  # the two launches the fused one replaces
    w2, b2 = torch.randn(16, 32), torch.randn(16)
    (z,) = fl.compiled_baseline(x, [w2], [b2], prologue="gelu")()
    assert torch.equal(z, F.linear(F.gelu(x, approximate="none"), w2, b2))

    monkeypatch.setattr(fl, "triton_available", lambda: True)
    cuda = torch.device("cuda")
    _remember_linear(proof_sandbox, m, 64, 32, "none", chosen="m64")
    assert fb.block_plan(config, torch.float16, cuda)["gelu"] is False  # the GELU form not proven here
    _remember_linear(proof_sandbox, m, 64, 32, "gelu", chosen="m64", ms=0.004, aten_ms=0.007)
    plan = fb.block_plan(config, torch.float16, cuda)
    assert plan["gelu"] and not plan["gelu_prologue"]


# M, N, K: tails in every dimension (rows past M, a K past the last full BLOCK_K, N under BLOCK_N); the last case has
# 6 tiles: 3 per persistent program
TMA_SCRIPT = tile_race_script(11, """((100, 48, 40, "none", "none"), (130, 96, 64, "add_masked", "none"),
                                    (64, 32, 136, "masked_sum", "gelu"), (70, 40, 32, "gelu", "none"),
                                    (300, 200, 64, "add_masked", "none"))""", """
    for tile in ("tma", "tma_n256", "tma_persistent", "tma_ws", "tma_ws_k128"):
        config = dict(TILES[tile], BLOCK_K=32) if k > 64 else dict(TILES[tile])
        got = triton_linear(x, w, b, residual, keep, epilogue, prologue, **config)
        plain = {key: v for key, v in config.items() if key not in ("TMA", "PERSISTENT", "WS")}
        want = triton_linear(x, w, b, residual, keep, epilogue, prologue, **plain)""")


def test_the_tma_tile_computes_what_the_pointer_tile_of_its_size_computes():
    """Under the interpreter: the TMA tiles (one program per tile, and persistent programs walking several tiles)
    against the pointer-load tile of the same sizes, bit for bit, with rows, columns and a K step past the ends
    (TMA's zero fill against the masked loads' ``other``), every epilogue and the GELU prologue."""
    results = run_interpreter_script(TMA_SCRIPT)
    assert len(results) == 25
    assert all(r["differing"] == 0 for r in results), results


def test_the_tma_tile_has_the_pointer_tiles_arithmetic_on_sm90():
    """Compiled here for sm_90a (Triton 3.6.0, as on the H200): the operands arrive by TMA, and the tile issues the
    pointer-load tile's wgmma instructions and floating-point arithmetic, in its order."""
    pytest.importorskip("triton")
    import re

    from kkdeploy.kernels.dependent_launch import arithmetic_opcodes

    script = load_script("offline_ptx")
    values = {**script.KERNELS["linear"][3], "EPILOGUE": 3, "HAS_MASK": True}
    tma_values = {key: values.get(key, default) for key, default in script.KERNELS["linear_tma"][3].items()}
    plain = script.compile_ptx("linear", values, 8, 4)
    tma = script.compile_ptx("linear_tma", tma_values, 8, 4)
    assert re.findall(r"cp\.async\.bulk\.tensor", tma) and not re.findall(r"cp\.async\.bulk\.tensor", plain)
    shapes = lambda ptx: sorted(set(re.findall(r"wgmma\.mma_async\S*", ptx)))  # noqa: E731
    assert shapes(tma) == shapes(plain) == ["wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16"]
    arithmetic = lambda ptx: [op for op in arithmetic_opcodes(ptx) if "wait_group" not in op]  # noqa: E731
    assert arithmetic(tma) == arithmetic(plain)


def test_the_persistent_tma_tile_has_the_tma_tiles_arithmetic_on_sm90():
    """Compiled here for sm_90a: one program walking several tiles issues the TMA tile's wgmma and floating-point
    instructions, as many of each, for every epilogue and the GELU prologue (the text's order differs: the epilogue
    is laid out before the k-loop). No ``add.rn.f16`` with zero, which the flattened loop form would add."""
    pytest.importorskip("triton")
    import collections
    import re

    from kkdeploy.kernels.dependent_launch import arithmetic_opcodes

    script = load_script("offline_ptx")
    floating = lambda ptx: collections.Counter(  # noqa: E731
        op for op in arithmetic_opcodes(ptx) if "wait_group" not in op and not re.search(r"\.[su](32|64)$", op))
    for epilogue, gelu in ((0, False), (2, False), (3, False), (1, False), (0, True)):
        change = {"EPILOGUE": epilogue, "HAS_MASK": True, "A_GELU": gelu}
        tma = script.compile_ptx("linear_tma", {**script.KERNELS["linear_tma"][3], **change}, 8, 4)
        persistent = script.compile_ptx("linear_tma_persistent",
                                        {**script.KERNELS["linear_tma_persistent"][3], **change}, 8, 4)
        assert floating(persistent) == floating(tma), (epilogue, gelu)
        assert not re.search(r"add\.rn\.f16\s", persistent)


def test_the_warp_specialized_tma_tile_has_the_tma_tiles_arithmetic_in_each_consumer_on_sm90():
    """Compiled here for sm_90a: the warp-specialized tile ("tma_ws", 4 warps a consumer) runs 384 threads, a producer
    warpgroup (its registers given back, ``setmaxnreg``) and two consumer warpgroups of 64 rows. Together the two
    issue exactly twice the 8-warp TMA tile's wgmma and floating-point instructions (each holds what one of its
    warpgroups holds), for every epilogue and the GELU prologue: the same k16 chain on each row's accumulator."""
    pytest.importorskip("triton")
    import collections
    import re

    from kkdeploy.kernels.dependent_launch import arithmetic_opcodes

    script = load_script("offline_ptx")
    floating = lambda ptx: collections.Counter(  # noqa: E731
        op for op in arithmetic_opcodes(ptx) if not re.search(r"wait_group|wgmma\.(fence|commit)|\.[su](32|64)$", op))
    cases = [(0, False, "tma_ws"), (2, False, "tma_ws"), (3, False, "tma_ws"), (1, False, "tma_ws"),
             (0, True, "tma_ws"), (2, False, "tma_ws_k128"), (0, True, "tma_ws_k128")]
    for epilogue, gelu, tile in cases:
        sizes = {key: fl.TILES[tile][key] for key in ("BLOCK_M", "BLOCK_N", "BLOCK_K") if key in fl.TILES[tile]}
        change = {"EPILOGUE": epilogue, "HAS_MASK": True, "A_GELU": gelu, **sizes}
        tma = script.compile_ptx("linear_tma", {**script.KERNELS["linear_tma"][3], **change}, 8, 4)
        specialized = script.compile_ptx("linear_tma", {**script.KERNELS["linear_tma"][3], **change, "WS": True},
                                         fl.TILES[tile]["num_warps"], fl.TILES[tile]["num_stages"])
        assert re.findall(r"\.reqntid (\d+)", specialized) == ["384"] and "setmaxnreg" in specialized
        assert "setmaxnreg" not in tma
        twice = collections.Counter({op: 2 * n for op, n in floating(tma).items()})
        assert floating(specialized) == twice, (epilogue, gelu, tile)
        assert any("m64n128k16" in op for op in twice)


def test_tma_descriptors_copy_an_unaligned_view_and_refuse_a_stride_tma_cannot_read():
    pytest.importorskip("triton")
    from kkdeploy.kernels._fused_linear_triton import tma_descriptors

    base = torch.zeros(4 * 64 + 1, dtype=torch.float16)
    x = base[1:].view(4, 64)  # 2 bytes past an aligned base
    w = torch.zeros(32, 64, dtype=torch.float16)
    xd, wd = tma_descriptors(x, w, 64, 32, 64)
    assert xd.base.data_ptr() % 16 == 0 and torch.equal(xd.base, x) and xd.base.data_ptr() != x.data_ptr()
    assert wd.base is w and wd.block_shape == [32, 64]
    wide = torch.zeros(4, 192, dtype=torch.float16)[:, 64:128]  # rows of a wider tensor: read in place
    xd, _ = tma_descriptors(wide, w, 64, 32, 64)
    assert xd.base.data_ptr() == wide.data_ptr() and xd.strides == [192, 1]
    with pytest.raises(ValueError, match="multiple of 8 float16 values, not 36"):
        tma_descriptors(torch.zeros(4, 36, dtype=torch.float16), torch.zeros(8, 36, dtype=torch.float16), 64, 8, 32)


# -- the whole feed-forward in one launch (kkdeploy_faithful::ffn_layer_norm) -------------------------------------
FFN_PLAN = {**FULL_PLAN, "gelu_prologue": False, "ffn_chain": True}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ratio", [0.0, 0.25])
@pytest.mark.parametrize("next_qkv", [False, True])
def test_model_forward_with_the_feed_forward_in_one_launch_is_the_reference(dtype, ratio, next_qkv):
    model = build_models(CONFIG, dtype, "cpu")[0]
    x, mask = generate_case(CONFIG, "cpu", dtype, 1234, padding_ratio=ratio)
    mask = mask if ratio else None
    with torch.no_grad():
        assert bits_equal(fb.fused_model_forward(model, x, mask, {**FFN_PLAN, "ffn_qkv": next_qkv}), model(x, mask))


def test_the_feed_forward_op_with_the_next_qkv_is_the_feed_forward_then_the_packed_qkv():
    torch.manual_seed(5)
    x, r = torch.randn(2, 5, 8), torch.randn(2, 5, 8)
    ffn_in, ffn_out, norm = torch.nn.Linear(8, 12), torch.nn.Linear(12, 8), torch.nn.LayerNorm(8)
    projections = [torch.nn.Linear(8, 8) for _ in range(3)]
    mask = torch.tensor([[True, False, True, True, False]] * 2)
    with torch.no_grad():
        total, qkv = fl.ffn_layer_norm_qkv(x, ffn_in, ffn_out, r, mask, norm, projections)
        want_total, normed = fl.ffn_layer_norm(x, ffn_in, ffn_out, r, mask, norm)
        assert torch.equal(total, want_total)
        assert torch.equal(qkv, torch.cat([p(normed) for p in projections], dim=-1))
        args = (x, ffn_in.weight, ffn_in.bias, ffn_out.weight, ffn_out.bias, r, mask, norm.weight, norm.bias, 1e-5,
                [p.weight for p in projections], [p.bias for p in projections])
        torch.library.opcheck(torch.ops.kkdeploy_faithful.ffn_layer_norm_qkv.default, args)
        with pytest.raises(KKError, match=r"the next Q\|K\|V takes Q, K and V's weights \[8, 8\]"):
            fl.ffn_layer_norm_qkv(x, ffn_in, ffn_out, r, mask, norm, projections[:2])


def test_the_feed_forward_op_is_ffn_in_then_ffn_out_s_layer_norm_launch():
    torch.manual_seed(4)
    x, r = torch.randn(3, 5, 8), torch.randn(3, 5, 8)
    ffn_in, ffn_out, norm = torch.nn.Linear(8, 12), torch.nn.Linear(12, 8), torch.nn.LayerNorm(8)
    torch.nn.init.normal_(norm.weight)
    mask = torch.tensor([[True, False, True, True, False]] * 3)
    with torch.no_grad():
        for zero_invalid in (False, True):
            total, normed = fl.ffn_layer_norm(x, ffn_in, ffn_out, r, mask, norm, zero_invalid)
            want = fl.linear_layer_norm(ffn_in(x), ffn_out.weight, ffn_out.bias, r, mask, norm, "masked_sum", "gelu",
                                        zero_invalid)
            assert torch.equal(total, want[0]) and torch.equal(normed, want[1])
        args = (x, ffn_in.weight, ffn_in.bias, ffn_out.weight, ffn_out.bias, r, mask, norm.weight, norm.bias, 1e-5)
        torch.library.opcheck(torch.ops.kkdeploy_faithful.ffn_layer_norm.default, args)
        with pytest.raises(KKError, match=r"ffn_out must be \[8, 12\]"):
            fl.ffn_layer_norm(x, ffn_in, torch.nn.Linear(8, 8), r, mask, norm)
        with pytest.raises(KKError, match=r"ffn_in must be \[F, 8\]"):
            fl.ffn_layer_norm(x, torch.nn.Linear(6, 12), ffn_out, r, mask, norm)
        with pytest.raises(KKError, match="residual must have x's shape"):
            fl.ffn_layer_norm(x, ffn_in, ffn_out, r[:, :4], mask, norm)
        with pytest.raises(KKError, match=r"ln_weight must be \[8\]"):
            fl.ffn_layer_norm(x, ffn_in, ffn_out, r, mask, torch.nn.LayerNorm(5))


def test_a_build_proves_the_feed_forward_launch_and_the_plan_takes_it_where_it_pays(monkeypatch, proof_sandbox):
    """The feed-forward launch is an op shape where rows fit a LayerNorm tile, of a study that names its tiles (a
    build proves none of them yet: FFN_BUILD_TILES, where the H100's end-to-end figures left it); its tiles are the
    feed-forward ones that fit; the plan takes it only with the LayerNorm epilogues, where proven and, by the proofs'
    timings, faster than ffn_in's GELU launch and ffn_out's LayerNorm launch together."""
    from kkdeploy.kernels import model_proofs
    from kkdeploy.kernels import faithful_attention as fa

    config = TransformerConfig(batch_size=4, seq_len=32, d_model=128, num_heads=2, ffn_dim=256, num_layers=1)
    m = 4 * 32
    assert fb.ffn_chain_launches(config) == {"ffn_chain_ln": (m, 128, 256, fl.FFN_FORM)}
    op = ("linear", "ffn_chain_ln", fl.proof_shape(m, 128, 256, fl.FFN_FORM))
    assert fl.FFN_BUILD_TILES == () and op not in model_proofs.kernel_op_shapes(config, ["linear"])
    assert op in model_proofs.kernel_op_shapes(config, ["linear"], {"linear": ["regs"]})  # a study names a tile
    monkeypatch.setattr(fl, "FFN_BUILD_TILES", ("auto", "regs"))
    assert op in model_proofs.kernel_op_shapes(config, ["linear"])  # ... or a build proves some
    wide = TransformerConfig(batch_size=4, seq_len=32, d_model=256, num_heads=2, ffn_dim=256, num_layers=1)
    assert fb.ffn_chain_launches(wide) == {}  # rows past a LayerNorm tile: no such launch
    assert [t for t in fl.FFN_TILES if fl.ffn_tile_fits(t, 128, 256)] == ["auto", "regs", "regs_w4", "regs_f128"]
    assert [t for t in fl.FFN_TILES if fl.ffn_tile_fits(t, 32, 64)] == ["auto"]
    assert not fl.ffn_tile_fits("regs_f128", 128, 64) and fl.ffn_tile_fits("regs_f128", 128, 128)
    with pytest.raises(KKError, match="does not apply to rows of 32"):
        fl.run_ffn_launch(torch.zeros(2, 32), torch.zeros(64, 32), torch.zeros(64), torch.zeros(32, 64),
                          torch.zeros(32), torch.zeros(2, 32), None, torch.ones(32), torch.zeros(32), 1e-5, False,
                          "regs")

    monkeypatch.setattr(fl, "triton_available", lambda: True)
    monkeypatch.setattr(fa, "select_attention_path", lambda *a, **k: fa.AttentionPath("triton", "test", "bm64"))
    cuda = torch.device("cuda")
    from kkdeploy.kernels import layer_norm as ln

    for n, k, form, ms, aten in ((384, 128, "none", 0.004, 0.005), (128, 128, "add_masked", 0.004, 0.005),
                                 (256, 128, "none", 0.004, 0.005), (128, 256, "masked_sum", 0.004, 0.005),
                                 (128, 128, "add_masked+layer_norm", 0.005, 0.02),
                                 (128, 256, "masked_sum+layer_norm", 0.006, 0.02), (256, 128, "gelu", 0.005, 0.01)):
        _remember_linear(proof_sandbox, m, n, k, form, chosen="auto", ms=ms, aten_ms=aten)
    proof_sandbox.remember_proof(proof_sandbox.ProofRecord(
        op=ln.OP, shape=ln.proof_shape(m, 128), environment=ln.proof_environment("cuda"), chosen="rows2",
        launches=[proof_sandbox.LaunchResult("rows2", ms=0.004, status="proven")], reference_ms=0.009))
    plan = fb.block_plan(config, torch.float16, cuda)
    assert plan["layer_norm"] and not plan["ffn_chain"]  # not proven here
    _remember_linear(proof_sandbox, m, 128, 256, fl.FFN_FORM, chosen="regs", ms=0.012, aten_ms=0.03)
    assert not fb.block_plan(config, torch.float16, cuda)["ffn_chain"]  # 0.012 ms against 0.005 + 0.006
    _remember_linear(proof_sandbox, m, 128, 256, fl.FFN_FORM, chosen="regs", ms=0.008, aten_ms=0.03)
    assert fb.block_plan(config, torch.float16, cuda)["ffn_chain"]
    path = fl.linear_path(m, 128, 256, torch.float16, cuda, epilogue=fl.FFN_FORM)
    assert path.fused and path.launch == "regs"
    # the next block's Q|K|V in the same launch: a model of one block has no next block; with two, it runs where its
    # proof's time is below the feed-forward launch's and the packed Q|K|V launch's together (0.008 + 0.004 ms)
    assert "ffn_chain_qkv" not in fb.ffn_chain_launches(config) and not fb.block_plan(config, torch.float16, cuda)[
        "ffn_qkv"]
    two = TransformerConfig(batch_size=4, seq_len=32, d_model=128, num_heads=2, ffn_dim=256, num_layers=2)
    assert fb.ffn_chain_launches(two)["ffn_chain_qkv"] == (m, 128, 256, fl.FFN_QKV_FORM)
    assert not fb.block_plan(two, torch.float16, cuda)["ffn_qkv"]  # not proven here
    _remember_linear(proof_sandbox, m, 128, 256, fl.FFN_QKV_FORM, chosen="regs", ms=0.013, aten_ms=0.04)
    assert not fb.block_plan(two, torch.float16, cuda)["ffn_qkv"]
    _remember_linear(proof_sandbox, m, 128, 256, fl.FFN_QKV_FORM, chosen="regs", ms=0.011, aten_ms=0.04)
    plan = fb.block_plan(two, torch.float16, cuda)
    assert plan["ffn_chain"] and plan["ffn_qkv"]


FFN_SCRIPT = """
import json, torch
from kkdeploy.kernels._fused_linear_triton import triton_linear, triton_linear_layer_norm, triton_ffn_layer_norm
from kkdeploy.kernels.fused_linear import FFN_TILES
results = []
g = torch.Generator().manual_seed(21)
# (M, D, F, tile, zero_invalid, mask): rows past M, F past its last chunk, rows under 128 (read back), no mask
CASES = ((200, 128, 128, "auto", False, True), (200, 128, 128, "regs", True, True),
         (130, 128, 256, "regs_w4", False, False), (130, 128, 128, "regs_f128", True, True),
         (70, 32, 96, "auto", False, True), (64, 64, 40, "auto", True, True))
for m, d, f, tile, zero_invalid, has_mask in CASES:
    x = torch.randn(m, d, generator=g).half()
    w1, b1 = (torch.randn(f, d, generator=g) / 8).half(), (torch.randn(f, generator=g) / 4).half()
    w2, b2 = (torch.randn(d, f, generator=g) / 8).half(), (torch.randn(d, generator=g) / 4).half()
    r = torch.randn(m, d, generator=g).half()
    mask = (torch.rand(m, generator=g) > 0.3) if has_mask else None
    lw, lb = (torch.rand(d, generator=g) + 0.5).half(), (torch.randn(d, generator=g) * 0.1).half()
    config = dict(FFN_TILES[tile])
    block_f = config.get("BLOCK_F", min(64, max(16, 1 << (f - 1).bit_length())))
    # ffn_in's launch (k-steps of 64, as its own tile), then ffn_out's LayerNorm launch with the GELU prologue, k-steps
    # of BLOCK_F
    pre = triton_linear(x, w1, b1, BLOCK_M=64, BLOCK_K=min(64, d))
    want_total, want = triton_linear_layer_norm(pre, w2, b2, r, mask, lw, lb, 1e-5, "masked_sum", prologue="gelu",
                                                zero_invalid=zero_invalid, BLOCK_M=64, BLOCK_K=block_f,
                                                LN_RELOAD=config.get("LN_RELOAD", True) or d < 128)
    total, normed = triton_ffn_layer_norm(x, w1, b1, w2, b2, r, mask, lw, lb, 1e-5, zero_invalid, **config)
    results.append({"case": [m, d, f, tile, zero_invalid, has_mask],
                    "differing": int((total.view(torch.int16) != want_total.view(torch.int16)).sum())
                    + int((normed.view(torch.int16) != want.view(torch.int16)).sum())})
print("RESULTS " + json.dumps(results))
"""


FFN_QKV_SCRIPT = """
import json, torch
from kkdeploy.kernels._fused_linear_triton import triton_linear, triton_ffn_layer_norm
from kkdeploy.kernels.fused_linear import FFN_TILES
results = []
g = torch.Generator().manual_seed(22)
for m, d, f, tile in ((200, 128, 128, "auto"), (130, 128, 256, "regs"), (70, 32, 96, "auto")):
    x = torch.randn(m, d, generator=g).half()
    w1, b1 = (torch.randn(f, d, generator=g) / 8).half(), (torch.randn(f, generator=g) / 4).half()
    w2, b2 = (torch.randn(d, f, generator=g) / 8).half(), (torch.randn(d, generator=g) / 4).half()
    wq, bq = (torch.randn(3 * d, d, generator=g) / 8).half(), (torch.randn(3 * d, generator=g) / 4).half()
    r = torch.randn(m, d, generator=g).half()
    mask = torch.rand(m, generator=g) > 0.3
    lw, lb = (torch.rand(d, generator=g) + 0.5).half(), (torch.randn(d, generator=g) * 0.1).half()
    total, normed = triton_ffn_layer_norm(x, w1, b1, w2, b2, r, mask, lw, lb, 1e-5, False, **FFN_TILES[tile])
    total2, qkv = triton_ffn_layer_norm(x, w1, b1, w2, b2, r, mask, lw, lb, 1e-5, False, wq, bq, **FFN_TILES[tile])
    want = triton_linear(normed, wq, bq, BLOCK_M=64, BLOCK_N=d, BLOCK_K=min(64, d))  # the packed Q|K|V launch alone
    results.append({"case": [m, d, f, tile],
                    "differing": int((total.view(torch.int16) != total2.view(torch.int16)).sum())
                    + int((qkv.view(torch.int16) != want.view(torch.int16)).sum())})
print("RESULTS " + json.dumps(results))
"""


def test_the_feed_forward_launch_with_the_next_qkv_computes_what_the_packed_qkv_launch_computes():
    """Under the interpreter: the sum as without the Q|K|V, and the Q|K|V as the packed Q|K|V launch computes it from
    the launch's own normalized rows, bit for bit (rows past M, rows under 128)."""
    results = run_interpreter_script(FFN_QKV_SCRIPT)
    assert len(results) == 3 and all(r["differing"] == 0 for r in results), results


def test_the_feed_forward_launch_computes_what_ffn_in_and_ffn_out_s_launches_compute():
    """Under the interpreter, every feed-forward tile against ffn_in's launch followed by ffn_out's LayerNorm launch
    with the GELU prologue (the launches a build proves apart), bit for bit: padded rows, F past its last chunk, rows
    under 128 read back, no mask, the final LayerNorm's zeroed rows."""
    results = run_interpreter_script(FFN_SCRIPT)
    assert len(results) == 6
    assert all(r["differing"] == 0 for r in results), results


NORM_SCRIPT = """
import json, torch
import numpy as np
from kkdeploy.kernels._fused_linear_triton import triton_linear, triton_norm_linear
from kkdeploy.kernels.fused_linear import NORM_TILES, norm_tile_fits
from kkdeploy.kernels.layer_norm import emulate_layer_norm_rows

def np_rsqrt(t):  # the interpreter's tl.math.rsqrt: numpy's 1 / sqrt in float32
    return torch.from_numpy(1 / np.sqrt(t.numpy()))

results = []
g = torch.Generator().manual_seed(23)
# (M, K = D, N, tile, epilogue): norm2 + ffn_in (+ GELU), norm1 + the packed Q|K|V, rows past M, rows under 128 (the
# lanes past the row), 32-row tiles
CASES = ((200, 128, 128, "ln_m64n32_w8", "gelu"), (130, 128, 384, "ln_m64_w8", "none"),
         (70, 32, 96, "ln_m32n32_w8", "none"), (64, 64, 40, "ln_m64n16_w8", "gelu"),
         (100, 16, 48, "ln_m64n16_w8", "none"), (40, 128, 64, "ln_m16n32", "gelu"))
for m, k, n, tile, epilogue in CASES:
    assert norm_tile_fits(tile, k, n)
    x = (torch.randn(m, k, generator=g) * 2 + 0.5).half()
    w, b = (torch.randn(n, k, generator=g) / 8).half(), (torch.randn(n, generator=g) / 4).half()
    lw, lb = (torch.rand(k, generator=g) + 0.5).half(), (torch.randn(k, generator=g) * 0.1).half()
    config = dict(NORM_TILES[tile])
    got = triton_norm_linear(x, lw, lb, 1e-5, w, b, epilogue, **config)
    # the rows LayerNorm in ATen's order, then the same tile without the prologue
    normed = emulate_layer_norm_rows(x, lw, lb, 1e-5, rsqrt=np_rsqrt)
    want = triton_linear(normed, w, b, epilogue=epilogue, **config)
    wrong_eps = triton_norm_linear(x, lw, lb, 1e-3, w, b, epilogue, **config)  # the comparison can see a change
    results.append({"case": [m, k, n, tile, epilogue],
                    "differing": int((got.view(torch.int16) != want.view(torch.int16)).sum()),
                    "differing_other_eps": int((wrong_eps.view(torch.int16) != want.view(torch.int16)).sum())})
print("RESULTS " + json.dumps(results))
"""


def test_the_layer_norm_prologue_computes_what_the_rows_layer_norm_and_the_tile_compute():
    """Under the interpreter, every LayerNorm-prologue tile against ATen's rows LayerNorm (its order, emulated) followed
    by the same tile without the prologue, bit for bit: rows past M, rows of 16-128 (lanes past the row), the packed
    Q|K|V's 384 columns, the GELU epilogue; and the same launch with another eps differs, so the check can fail."""
    results = run_interpreter_script(NORM_SCRIPT)
    assert len(results) == 6
    assert all(r["differing"] == 0 for r in results), results
    assert all(r["differing_other_eps"] > 0 for r in results), results


def test_the_layer_norm_prologue_op():
    """``norm_linear``: the reference's LayerNorm, then its Linear(s) and the epilogue, one op (the CPU kernel is that
    composition); its contract's refusals are one line."""
    torch.manual_seed(2)
    x = torch.randn(3, 5, 8)
    norm = torch.nn.LayerNorm(8)
    torch.nn.init.normal_(norm.weight)
    torch.nn.init.normal_(norm.bias)
    w, b = torch.randn(6, 8), torch.randn(6)
    ws, bs = [torch.randn(4, 8) for _ in range(3)], [torch.randn(4) for _ in range(3)]
    with torch.no_grad():
        assert torch.equal(fl.norm_linear(x, norm, [w], [b]), F.linear(norm(x), w, b))
        assert torch.equal(fl.norm_linear(x, norm, [w], [b], "gelu"), F.gelu(F.linear(norm(x), w, b)))
        assert torch.equal(fl.norm_linear(x, norm, ws, bs),
                           torch.cat([F.linear(norm(x), wi, bi) for wi, bi in zip(ws, bs)], dim=-1))
        args = (x, norm.weight, norm.bias, 1e-5, [w], [b], "gelu")
        torch.library.opcheck(torch.ops.kkdeploy_faithful.norm_linear.default, args)
        with pytest.raises(KKError, match="takes the epilogue none or gelu"):
            fl.norm_linear(x, norm, [w], [b], "masked_sum")
        with pytest.raises(KKError, match=r"ln_weight must be \[8\]"):
            fl.norm_linear(x, torch.nn.LayerNorm(6), [w], [b])
        with pytest.raises(KKError, match="does not apply to rows of 8"):
            fl.run_norm_launch(x, norm.weight, norm.bias, 1e-5, [w], [b], "none", "ln_m64n32_w8")
    assert fl.norm_form("gelu") == "layer_norm_prologue+gelu" and fl.NORM_PROLOGUE in fl.PARTS
    assert [t for t in fl.NORM_TILES if fl.norm_tile_fits(t, 128, 128)] == list(fl.NORM_TILES)
    assert [t for t in fl.NORM_TILES if fl.norm_tile_fits(t, 128, 16)] == ["ln_m64n16_w8", "ln_m64_w8"]
    assert [t for t in fl.NORM_TILES if fl.norm_tile_fits(t, 64, 32)] == list(fl.NORM_TILES)
    assert not any(fl.norm_tile_fits(t, 256, 128) for t in fl.NORM_TILES)  # rows past one tile's LayerNorm


def test_a_build_proves_the_layer_norm_prologue_and_the_plan_takes_it_where_it_pays(monkeypatch, proof_sandbox):
    """The LayerNorm-prologue launches are op shapes of a study that names their tiles (a build proves none yet:
    NORM_BUILD_TILES), each with its cases from the model's own rows; the plan takes norm2 inside ffn_in, and norm1
    inside the packed Q|K|V, only without the LayerNorm epilogues and where proven and, by the proofs' timings, faster
    than the rows LayerNorm's launch and the plain GEMM's together; the graph's GEMM forms and LayerNorm count
    follow."""
    from kkdeploy.kernels import faithful_attention as fa
    from kkdeploy.kernels import layer_norm as ln
    from kkdeploy.kernels import model_proofs

    config = TransformerConfig(batch_size=4, seq_len=32, d_model=128, num_heads=2, ffn_dim=256, num_layers=2)
    m = 4 * 32
    assert fb.norm_launches(config) == {"norm2_ffn_in": (m, 256, 128, fl.norm_form("none")),
                                        "norm2_ffn_in_gelu": (m, 256, 128, fl.norm_form("gelu")),
                                        "norm1_qkv": (m, 384, 128, fl.norm_form("none"))}
    assert fb.norm_launches(TransformerConfig(batch_size=4, seq_len=32, d_model=256, num_heads=2, ffn_dim=256,
                                              num_layers=1)) == {}
    op = ("linear", "norm2_ffn_in_gelu", fl.proof_shape(m, 256, 128, fl.norm_form("gelu")))
    assert fl.NORM_BUILD_TILES == () and op not in model_proofs.kernel_op_shapes(config, ["linear"])
    assert op in model_proofs.kernel_op_shapes(config, ["linear"], {"linear": ["ln_m64n32_w8"]})
    # the proof's cases: the model's own rows through each LayerNorm and Linear, all-valid and padded, and random
    model = build_models(config, torch.float32, "cpu")[0]
    cases = model_proofs._Cases(model, config, torch.float32, torch.device("cpu"), 1234)
    for name, width in (("norm2_ffn_in_gelu", 256), ("norm1_qkv", 384)):
        got = cases.linear(name)
        assert len(got) == 4 + len(model_proofs.RANDOM_INPUTS)
        assert all(tuple(case.reference().shape) == (4, 32, width) for case in got)
    layer = model.layers[0]
    with torch.no_grad():
        first = cases.linear("norm2_ffn_in_gelu")[0]
        want = F.gelu(layer.ffn_in(layer.norm2(cases.inputs[0][2][0].mid)))
        assert bits_equal(first.reference(), want)

    monkeypatch.setattr(fl, "triton_available", lambda: True)
    monkeypatch.setattr(fa, "select_attention_path", lambda *a, **k: fa.AttentionPath("triton", "test", "bm64"))
    cuda = torch.device("cuda")
    for n, k, form, ms, aten in ((384, 128, "none", 0.004, 0.005), (128, 128, "add_masked", 0.004, 0.005),
                                 (256, 128, "none", 0.004, 0.005), (128, 256, "masked_sum", 0.004, 0.005),
                                 (256, 128, "gelu", 0.003, 0.01)):
        _remember_linear(proof_sandbox, m, n, k, form, chosen="auto", ms=ms, aten_ms=aten)
    proof_sandbox.remember_proof(proof_sandbox.ProofRecord(
        op=ln.OP, shape=ln.proof_shape(m, 128), environment=ln.proof_environment("cuda"), chosen="rows2",
        launches=[proof_sandbox.LaunchResult("rows2", ms=0.002, status="proven")], reference_ms=0.009))
    plan = fb.block_plan(config, torch.float16, cuda)
    assert plan["gelu"] and not plan["norm_ffn_in"] and not plan["norm_qkv"]  # not proven here
    _remember_linear(proof_sandbox, m, 256, 128, fl.norm_form("gelu"), chosen="ln_m64n32_w8", ms=0.0055,
                     aten_ms=0.02)
    assert not fb.block_plan(config, torch.float16, cuda)["norm_ffn_in"]  # 0.0055 ms against 0.003 + 0.002
    _remember_linear(proof_sandbox, m, 256, 128, fl.norm_form("gelu"), chosen="ln_m64n32_w8", ms=0.0045,
                     aten_ms=0.02)
    _remember_linear(proof_sandbox, m, 384, 128, fl.norm_form("none"), chosen="ln_m64_w8", ms=0.005, aten_ms=0.02)
    plan = fb.block_plan(config, torch.float16, cuda)
    assert plan["norm_ffn_in"] and plan["norm_qkv"]  # 0.0045 < 0.005 and 0.005 < 0.006
    path = fl.linear_path(m, 256, 128, torch.float16, cuda, epilogue=fl.norm_form("gelu"))
    assert path.fused and path.launch == "ln_m64n32_w8"
    forms = fb.planned_linear_forms(config, plan)
    assert {(256, 128, fl.norm_form("gelu")), (384, 128, fl.norm_form("none"))} <= forms
    assert not {(256, 128, "gelu"), (384, 128, "none")} & forms
    # with the LayerNorm epilogues the norms come out of the residual GEMMs already: no prologue
    monkeypatch.setattr(fb, "layer_norm_epilogues_pay", lambda *a: True)
    plan = fb.block_plan(config, torch.float16, cuda)
    assert plan["layer_norm"] and not plan["norm_ffn_in"] and not plan["norm_qkv"]


@pytest.mark.parametrize("ratio", [0.0, 0.25])
def test_export_with_the_layer_norm_prologues_is_bitwise_on_the_cpu(ratio, monkeypatch):
    """norm1 inside the packed Q|K|V and norm2 inside ffn_in with its GELU: the graph holds no block LayerNorm of its
    own (the export's count of the reference's sensitive ops allows for them), and runs the reference's bits."""
    import engines.inductor_ops  # noqa: F401
    from engines.inductor import export_variant
    from kkdeploy.kernels import layer_norm

    monkeypatch.setattr(layer_norm, "MASKED_FINAL", False)
    monkeypatch.setattr(fb, "block_plan", lambda *a: {"gemms": True, "packed_qkv": True, "gelu_prologue": False,
                                                      "gelu": True, "layer_norm": False, "linears": {},
                                                      "norm_ffn_in": True, "norm_qkv": True})
    model = build_models(CONFIG, torch.float32, "cpu")[0]
    exported = export_variant(model, CONFIG, torch.float32, torch.device("cpu"), "inductor", kernel_attention=True,
                              kernel_layer_norm=True, kernel_linear=True)
    targets = [str(n.target) for n in exported.graph.nodes if n.op == "call_function"]
    assert targets.count("kkdeploy_faithful.norm_linear.default") == 2 * CONFIG.num_layers
    assert targets.count("kkdeploy_faithful.linear.default") == 2 * CONFIG.num_layers  # out_proj, ffn_out
    assert targets.count("kkdeploy_faithful.layer_norm_rows.default") == 1  # final_norm only
    x, mask = generate_case(CONFIG, "cpu", torch.float32, 1234, padding_ratio=ratio)
    with torch.no_grad():
        assert torch.equal(exported.module()(x, mask), model(x, mask))
