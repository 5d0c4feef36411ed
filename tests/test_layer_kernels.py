"""Whole blocks in one launch (kkdeploy/kernels/layer_kernels.py, issue 31).

On the CPU: the layer kernels' refusals and errors, the reference's intermediates (they are the reference's own
tensors: the last one is ``reference_forward`` bit for bit), the report that names the first differing part, and
the libdevice lookup. Where Triton is importable, the kernels themselves under TRITON_INTERPRET=1: every part a block
launch writes equals the same tile launched on its own (``triton_linear``, ``triton_attention``,
``triton_linear_layer_norm``, from the block's own inputs to that part), fused attention and split, both GELU forms.
Bit-identity with ATen on a GPU is measured by scripts/layer_kernels_h200.py (docs/layer-kernels.md).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from kkdeploy import TransformerConfig, generate_case
from kkdeploy.errors import KKError
from kkdeploy.kernels import layer_kernels as lk
from kkdeploy.models.weights import build_models
from tests.conftest import bits_equal, run_interpreter_script

CONFIG = TransformerConfig(batch_size=2, seq_len=24, d_model=32, num_heads=2, ffn_dim=64, num_layers=2, causal=True)


@pytest.mark.parametrize("ratio", [0.0, 0.25])
def test_reference_intermediates_are_the_reference_tensors(ratio):
    model = build_models(CONFIG, torch.float32, "cpu")[0]
    x, mask = generate_case(CONFIG, "cpu", torch.float32, 1234, padding_ratio=ratio)
    mask = mask if ratio else None
    with torch.no_grad():
        want = model.reference_forward(x, mask).reshape(-1, CONFIG.d_model)
        got = lk.reference_intermediates(model, x, mask)
    assert bits_equal(got["blocks"][-1]["hn"], want)
    assert got["blocks"][-1]["qkv_next"] is None and got["blocks"][0]["qkv_next"].shape == (48, 96)
    assert got["qkv0"].shape == (48, 96) and got["blocks"][0]["ff"].shape == (48, 64)
    # each block's input to the next is its x2, and the next block's norm1 of it is the hn it hands over
    assert bits_equal(got["blocks"][0]["hn"], model.layers[1].norm1(got["blocks"][0]["x2"]))


def test_the_report_names_the_first_differing_part():
    a = torch.zeros(4, 8, dtype=torch.float16)
    b = a.clone()
    b[1, 2] = 1.0
    block = {part: a for part in lk.PARTS}
    want = {"hn0": a, "qkv0": a, "blocks": [dict(block), dict(block, qkv_next=None)]}
    got = {"hn0": a, "qkv0": a, "blocks": [dict(block), dict(block, x1=b, hn=b, qkv_next=a)]}
    report = lk.compare_intermediates(got, want)
    assert report["first"] == "block 1 x1"
    assert report["blocks"][1]["x1"] == 1 and report["blocks"][1]["hn"] == 1 and "qkv_next" not in report["blocks"][1]
    assert lk.compare_intermediates(want, want)["first"] is None


@pytest.mark.parametrize("change, words", [
    (dict(d_model=96, num_heads=2), "d_model = 96"),
    (dict(seq_len=2048), "seq_len = 2048"),
    (dict(ffn_dim=40), "ffn_dim = 40"),
])
def test_refusals_name_the_reason(change, words, monkeypatch):
    monkeypatch.setattr(lk, "INTERPRET", True)
    monkeypatch.setattr(lk, "triton_available", lambda: True)
    fields = dict(batch_size=2, seq_len=24, d_model=32, num_heads=2, ffn_dim=64, num_layers=1, causal=True)
    assert words in lk.refusal(TransformerConfig(**{**fields, **change}), torch.float16, "cpu")
    assert lk.refusal(TransformerConfig(**fields), torch.float16, "cpu") is None
    assert "float16 only" in lk.refusal(TransformerConfig(**fields), torch.float32, "cpu")


def test_cpu_and_unknown_forms_are_one_line_errors(monkeypatch):
    model = build_models(CONFIG, torch.float16, "cpu")[0]
    monkeypatch.setattr(lk, "INTERPRET", False)
    with pytest.raises(KKError, match="cpu device: the layer kernels are CUDA-only"):
        lk.LayerKernels(model)
    monkeypatch.setattr(lk, "INTERPRET", True)
    monkeypatch.setattr(lk, "triton_available", lambda: True)
    with pytest.raises(KKError, match="unknown attention form 'flash'"):
        lk.LayerKernels(model, lk.LayerLaunch(attention="flash"))
    long = build_models(TransformerConfig(1, 200, 32, 2, 64, 1, causal=True), torch.float16, "cpu")[0]
    with pytest.raises(KKError, match="at most 128 keys"):
        lk.LayerKernels(long, lk.LayerLaunch(attention="cached"))
    assert lk.default_launch(long.config).attention == "three_pass_mdiv"
    assert lk.default_launch(CONFIG).attention == "cached_mdiv"


def test_cuda_libdevice_lookup(monkeypatch, tmp_path):
    from kkdeploy.kernels import libdevice

    path = tmp_path / "libdevice.10.bc"
    path.write_bytes(b"BC")
    monkeypatch.setenv(libdevice.LIBDEVICE_ENV, str(path))
    assert libdevice.cuda_libdevice() == str(path)
    assert libdevice.gelu_libdevice() == str(path) and libdevice.libdevice_sources() == (path,)
    monkeypatch.setenv(libdevice.LIBDEVICE_ENV, str(tmp_path / "missing.bc"))
    with pytest.raises(KKError, match="no such file"):
        libdevice.cuda_libdevice()
    monkeypatch.delenv(libdevice.LIBDEVICE_ENV)
    root = tmp_path / "cuda"
    (root / "nvvm" / "libdevice").mkdir(parents=True)
    (root / "nvvm" / "libdevice" / "libdevice.10.bc").write_bytes(b"BC")
    monkeypatch.setenv("CUDA_HOME", str(root))
    assert libdevice.cuda_libdevice() == str(root / "nvvm" / "libdevice" / "libdevice.10.bc")
    assert lk.cuda_libdevice is libdevice.cuda_libdevice  # the layer launches link the same file


def test_launch_names_say_what_runs():
    assert lk.LayerLaunch().name() == "cached_mdiv_split_w8"
    assert lk.LayerLaunch(split=False).name() == "cached_mdiv_w8"
    named = lk.LayerLaunch(split=True, gelu_prologue=False, num_warps=4, libdevice="triton").name()
    assert named == "cached_mdiv_split_gelu_epilogue_w4_tritonlib"


INTERPRETER_SCRIPT = textwrap.dedent(
    """
    import json, os
    os.environ["TRITON_INTERPRET"] = "1"
    import torch
    from kkdeploy.config import TransformerConfig
    from kkdeploy.models.reference import ReferenceTransformer
    from kkdeploy.kernels.layer_kernels import LayerKernels, LayerLaunch, reference_intermediates
    from kkdeploy.kernels.proof import differing_elements as differing
    from kkdeploy.kernels._fused_linear_triton import triton_linear, triton_linear_layer_norm
    from kkdeploy.kernels._faithful_attention_triton import triton_attention

    results = []
    for (b, s, d, h, f, l, padded, attention, prologue) in [
            (2, 40, 32, 2, 64, 2, True, "cached_mdiv", True),
            (1, 70, 64, 4, 128, 1, False, "three_pass", False), (2, 40, 32, 2, 64, 2, True, "cached_mdiv:split", True),
            (2, 70, 32, 2, 160, 2, True, "cached_mdiv:persistent", True),
            # the block launch's parts B-E with the rows in registers, split and with the attention fused
            (2, 40, 128, 4, 128, 2, True, "cached_mdiv:split:regs", True),
            (1, 70, 64, 4, 256, 2, False, "three_pass:regs", True)]:
        torch.manual_seed(0)
        config = TransformerConfig(b, s, d, h, f, l, causal=True)
        model = ReferenceTransformer(config)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        model = model.half().eval()
        x = torch.randn(b, s, d).half()
        mask = (torch.arange(s)[None, :] < torch.tensor([s, s - 13])[:b, None]) if padded else None
        split, persistent, regs = (f":{form}" in attention for form in ("split", "persistent", "regs"))
        attention = attention.split(":")[0]
        kernels = LayerKernels(model, LayerLaunch(attention=attention, gelu_prologue=prologue, split=split,
                                                  persistent=persistent, chain_in_registers=regs))
        with torch.no_grad():
            out = kernels(x, mask).clone()
        got = kernels.intermediates(b, s)
        pw = lambda n: 1 << (n - 1).bit_length()
        bk_d, bk_f, bn_f, bn_qkv = min(64, max(16, pw(d))), min(64, max(16, pw(f))), min(128, max(16, pw(f))), min(128, pw(3 * d))
        fast = attention.endswith("mdiv")
        cached = attention.startswith("cached")
        # each part again as its own launch, from the layer kernels' own inputs to that part
        parts = {"qkv0": differing(got["qkv0"], triton_linear(got["hn0"], kernels.qkv_weights[0], kernels.qkv_biases[0],
                                                              BLOCK_M=64, BLOCK_N=bn_qkv, BLOCK_K=bk_d))}
        layer_in = x.reshape(b * s, d)
        m2 = mask.reshape(-1) if mask is not None else None
        for i, block in enumerate(model.layers):
            last = i + 1 == l
            gi = got["blocks"][i]
            qkv = got["qkv0"] if i == 0 else got["blocks"][i - 1]["qkv_next"]
            q, k, v = (t.reshape(b, s, d) for t in qkv.split(d, dim=-1))
            ctx = triton_attention(q, k, v, mask, h, True, block_m=64, cached=cached, fast_div=fast).reshape(b * s, d)
            att = block.attention
            x1, h2 = triton_linear_layer_norm(gi["ctx"], att.out_proj.weight, att.out_proj.bias, layer_in, m2,
                                              block.norm2.weight, block.norm2.bias, block.norm2.eps, "add_masked",
                                              BLOCK_K=bk_d)
            ff = triton_linear(gi["h2"], block.ffn_in.weight, block.ffn_in.bias, epilogue="none" if prologue else "gelu",
                               BLOCK_M=64, BLOCK_N=bn_f, BLOCK_K=bk_d)
            norm = model.final_norm if last else model.layers[i + 1].norm1
            x2, hn = triton_linear_layer_norm(gi["ff"], block.ffn_out.weight, block.ffn_out.bias, gi["x1"], m2,
                                              norm.weight, norm.bias, norm.eps, "masked_sum",
                                              prologue="gelu" if prologue else "none", zero_invalid=last, BLOCK_K=bk_f)
            for name, want, have in (("ctx", ctx, gi["ctx"]), ("x1", x1, gi["x1"]), ("h2", h2, gi["h2"]),
                                     ("ff", ff, gi["ff"]), ("x2", x2, gi["x2"]), ("hn", hn, gi["hn"])):
                parts[f"block{i}.{name}"] = differing(want, have)
            if not last:
                wq = kernels.qkv_weights[i + 1]
                parts[f"block{i}.qkv_next"] = differing(triton_linear(gi["hn"], wq, kernels.qkv_biases[i + 1],
                                                                      BLOCK_M=64, BLOCK_N=bn_qkv, BLOCK_K=bk_d),
                                                        gi["qkv_next"])
            layer_in = gi["x2"]
        with torch.no_grad():
            ref = model.float()(x.float(), mask)
        valid = torch.ones(b, s, dtype=torch.bool) if mask is None else mask
        results.append({"case": [b, s, d, h, f, l, padded, attention, prologue], "parts": parts,
                        "max_err": float((out.float() - ref).abs().max()),
                        "invalid_rows_zero": bool((out[~valid] == 0).all()),
                        "out_is_hn": bool(torch.equal(out.reshape(b * s, d), got["blocks"][-1]["hn"]))})
    print("RESULTS " + json.dumps(results))
    """
)


def test_layer_kernels_under_the_interpreter():
    results = run_interpreter_script(INTERPRETER_SCRIPT)
    assert len(results) == 6
    for r in results:
        assert r["parts"] and all(n == 0 for n in r["parts"].values()), r
        assert r["max_err"] < 0.01, r  # the float32 reference: the kernels compute the model, not just themselves
        assert r["invalid_rows_zero"] and r["out_is_hn"], r


def test_persistent_launch_names_and_refusals(monkeypatch):
    from kkdeploy.kernels import _model_triton

    assert lk.LayerLaunch(persistent=True).name() == "persistent_cached_mdiv_w8_p1"
    assert lk.LayerLaunch(persistent=True, num_warps=4, programs_per_sm=2).name() == "persistent_cached_mdiv_w4_p2"
    assert lk.LayerLaunch(persistent=True, row_chain=False).name() == "persistent_cached_mdiv_w8_p1_nochain"
    assert lk.LayerLaunch(persistent=True, chain_in_registers=True).name() == "persistent_cached_mdiv_w8_p1_regs"
    assert lk.LayerLaunch(persistent=True, chain_in_registers=True, qkv_in_chain=True).name() == \
        "persistent_cached_mdiv_w8_p1_regs_qkv"
    wide = lk.LayerLaunch(persistent=True, chain_in_registers=True)
    monkeypatch.setattr(lk, "INTERPRET", True)  # the arithmetic's rules (Triton's interpreter runs every width)
    assert lk.chain_in_registers_refusal(TransformerConfig(2, 24, 128, 4, 128, 2), wide) is None
    assert lk.chain_in_registers_refusal(CONFIG, wide) is None  # D = 32: eight lanes of four
    assert "d_model = 256" in lk.chain_in_registers_refusal(TransformerConfig(2, 24, 256, 4, 128, 2), wide)
    assert "ffn_dim = 160" in lk.chain_in_registers_refusal(TransformerConfig(2, 24, 128, 4, 160, 2), wide)
    assert lk.chain_in_registers_refusal(TransformerConfig(2, 24, 64, 4, 384, 2), wide) is None  # 3 tiles of 128
    assert lk.chain_in_registers_refusal(CONFIG, lk.LayerLaunch(chain_in_registers=True)) is None  # block launches
    assert "row_chain=True" in lk.chain_in_registers_refusal(CONFIG, lk.LayerLaunch(
        persistent=True, row_chain=False, chain_in_registers=True))
    assert "gelu_prologue=True" in lk.chain_in_registers_refusal(CONFIG, lk.LayerLaunch(
        gelu_prologue=False, chain_in_registers=True))
    assert "persistent launch's" in lk.chain_in_registers_refusal(CONFIG, lk.LayerLaunch(
        chain_in_registers=True, qkv_in_chain=True))
    assert "chain_in_registers=True" in lk.chain_in_registers_refusal(CONFIG, lk.LayerLaunch(qkv_in_chain=True))
    # on a GPU, only the widths where each form has run without a fault (shape 7's persistent one faulted)
    monkeypatch.setattr(lk, "INTERPRET", False)
    assert lk.chain_in_registers_refusal(TransformerConfig(2, 24, 128, 4, 128, 2), wide) is None
    why = lk.chain_in_registers_refusal(CONFIG, wide)
    assert why == ("d_model = 32: on a GPU the persistent launch keeps its chain in registers only at the widths "
                   "where it has run without a fault (d_model 128)")
    assert lk.chain_in_registers_refusal(CONFIG, lk.LayerLaunch(chain_in_registers=True)) is None  # split, D = 32
    assert "split launch" in lk.chain_in_registers_refusal(TransformerConfig(2, 24, 64, 4, 256, 2),
                                                           lk.LayerLaunch(chain_in_registers=True))
    assert "(d_model none yet)" in lk.chain_in_registers_refusal(CONFIG, lk.LayerLaunch(
        split=False, chain_in_registers=True))
    # the ticket, the exit count, the stall count, then five counters per (block, row tile)
    assert _model_triton.sync_size(layers=4, row_tiles=8) == 3 + 5 * 4 * 8
    model = build_models(CONFIG, torch.float16, "cpu")[0]
    monkeypatch.setattr(lk, "INTERPRET", True)
    monkeypatch.setattr(lk, "triton_available", lambda: True)
    with pytest.raises(KKError, match="GELU on ffn_out's input only"):
        lk.LayerKernels(model, lk.LayerLaunch(persistent=True, gelu_prologue=False))
    with pytest.raises(KKError, match="programs_per_sm = 0: at least 1"):
        lk.LayerKernels(model, lk.LayerLaunch(persistent=True, programs_per_sm=0))
    kernels = lk.LayerKernels(model, lk.LayerLaunch(persistent=True))
    assert kernels.stacked["wqkv"].shape == (2, 96, 32) and kernels.stacked["lnn_g"].shape == (2, 32)
    assert torch.equal(kernels.stacked["lnn_g"][1], model.final_norm.weight)  # the last block's next norm
    assert torch.equal(kernels.stacked["lnn_g"][0], model.layers[1].norm1.weight)
    assert kernels.stacked["eps2"].dtype == torch.float32
    buf = kernels.buffers(2, 24)  # one tensor per kind, the blocks' buffers its views
    assert buf["stacks"]["ff"].shape == (2, 48, 64) and buf["ff"][1].data_ptr() == buf["stacks"]["ff"][1].data_ptr()
    assert kernels.sync(2, 24).shape == (3 + 5 * 2 * 2, ) and int(kernels.sync(2, 24).abs().sum()) == 0
    assert kernels.stalls() == 0
    kernels.sync(2, 24)[_model_triton.STALLS.value] = 2  # as a wait that gave up twice would leave it
    assert kernels.stalls() == 2


PERSISTENT_SCRIPT = textwrap.dedent(
    """
    import json
    import torch
    from kkdeploy.config import TransformerConfig
    from kkdeploy.models.reference import ReferenceTransformer
    from kkdeploy.kernels.layer_kernels import LayerKernels, LayerLaunch, compare_intermediates

    def frozen(report):
        return {"hn0": report["hn0"].clone(), "qkv0": report["qkv0"].clone(),
                "blocks": [{k: None if v is None else v.clone() for k, v in blk.items()} for blk in report["blocks"]]}

    results = []
    for (b, s, d, h, f, l, padded, attention, causal, chain) in [
            (2, 70, 32, 2, 64, 2, True, "cached_mdiv", True, True),
            (2, 70, 32, 2, 64, 2, True, "cached_mdiv", True, False),
            (2, 24, 32, 2, 160, 2, True, "three_pass_mdiv", False, True),  # two ffn_in tiles: never chained
            (1, 40, 64, 4, 128, 1, False, "three_pass", True, True),
            # the row chain in registers (D = 128): ffn_in of one k-step (F = 64), then of two (F = 128)
            (2, 70, 128, 4, 64, 2, True, "cached_mdiv", True, "regs"),
            (1, 40, 128, 2, 128, 1, False, "three_pass", True, "regs"),
            # and the next block's Q|K|V in the chain (and the first block's in the entry): no Q|K|V items
            (2, 70, 128, 4, 64, 2, True, "cached_mdiv", True, "qkv"),
            # rows of 8 and 16 lanes (D = 32, 64): the levels of ATen's tree that merge only empty lanes left out
            (2, 70, 32, 2, 32, 2, True, "cached_mdiv", True, "qkv"),
            (1, 40, 64, 4, 128, 2, False, "three_pass", True, "qkv"),
            # ffn_in in three column tiles of 128, ffn_out's k-steps over them in order
            (2, 24, 64, 2, 384, 1, True, "three_pass_mdiv", True, "qkv")]:
        torch.manual_seed(0)
        model = ReferenceTransformer(TransformerConfig(b, s, d, h, f, l, causal=causal))
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        model = model.half().eval()
        split = LayerKernels(model, LayerLaunch(attention=attention))
        persistent = LayerKernels(model, LayerLaunch(attention=attention, persistent=True, row_chain=bool(chain),
                                                     chain_in_registers=chain in ("regs", "qkv"),
                                                     qkv_in_chain=chain == "qkv"))
        calls = []
        for seed in (1, 2):  # two calls: the second runs on the counters the first one's last program zeroed
            torch.manual_seed(seed)
            x = torch.randn(b, s, d).half()
            mask = (torch.arange(s)[None, :] < torch.tensor([s, s - 13])[:b, None]) if padded else None
            with torch.no_grad():
                want_out = split(x, mask).clone()
                want = frozen(split.intermediates(b, s))
                got_out = persistent(x, mask).clone()
            calls.append({"report": compare_intermediates(persistent.intermediates(b, s), want),
                          "out_equal": bool(torch.equal(got_out, want_out)),
                          "sync_zero": bool((persistent.sync(b, s) == 0).all()), "stalls": persistent.stalls()})
        results.append({"case": [b, s, d, h, f, l, padded, attention, causal, chain], "calls": calls})
    print("RESULTS " + json.dumps(results))
    """
)


def test_persistent_launch_equals_the_split_launches_under_the_interpreter():
    """Every buffer of the one-launch model equals the split launches' (which equal the tiles launched one by one,
    above): causal and not, padded and not, two row tiles per sequence, two ffn_in column tiles, the row chain and
    not, the row chain in registers (one and two k-steps per GEMM; rows of 32, 64 and 128; ffn_in in one and in
    three column tiles) and with the next block's Q|K|V in it, two calls."""
    results = run_interpreter_script(PERSISTENT_SCRIPT)
    assert len(results) == 10
    for r in results:
        for call in r["calls"]:
            assert call["report"]["first"] is None, r
            assert all(n == 0 for n in call["report"]["blocks"][0].values()), r
            assert call["out_equal"] and call["sync_zero"] and call["stalls"] == 0, r


def test_the_persistent_launch_s_trace_says_where_the_time_went(monkeypatch):
    """The items' kinds in ticket order match the launch's count, and a trace (program, taken, ready, the row chain's
    two inner marks, done, in ns) becomes waits and runs per kind, the row chain's parts, each block's window, and how
    busy the programs were. Tracing reads the GPU's clock, so the interpreter refuses it in one line."""
    kinds = lk.item_kinds(row_tiles=8, layers=4, qkv_tiles=3, heads=4, ffn_tiles=1, chain=True)
    assert len(kinds) == 8 * (1 + 4 * (3 + 4 + 1))  # shape 3's items
    assert kinds[:8] == [("entry", -1)] * 8 and kinds[8] == ("qkv", 0) and kinds[-1] == ("row_chain", 3)
    chained = lk.item_kinds(row_tiles=8, layers=4, qkv_tiles=0, heads=4, ffn_tiles=1, chain=True)  # Q|K|V in it
    assert len(chained) == 8 * (1 + 4 * (4 + 1)) and ("qkv", 0) not in chained and chained[8] == ("attention", 0)
    unchained = lk.item_kinds(row_tiles=2, layers=1, qkv_tiles=1, heads=2, ffn_tiles=2, chain=False)
    assert [k for k, _ in unchained] == (["entry"] * 2 + ["qkv"] * 2 + ["attention"] * 4 + ["out_proj"] * 2
                                         + ["ffn_in"] * 4 + ["ffn_out"] * 2)
    layout = lk.item_kinds(row_tiles=1, layers=1, qkv_tiles=1, heads=1, ffn_tiles=1, chain=True)
    # program, taken, ready, out_proj done, ffn_in done, done (the middle two written for the row chain only)
    rows = torch.tensor([[0, 1000, 1000, 0, 0, 3000],             # entry: 2 us
                         [1, 1100, 3500, 0, 0, 5500],             # qkv: waited 2.4 us, ran 2 us
                         [0, 3100, 6000, 0, 0, 10000],            # attention
                         [1, 5600, 10500, 11700, 12300, 14000]])  # the row chain: 1.2 + 0.6 + 1.7 us
    summary = lk.trace_summary(rows, layout)
    assert summary["span_us"] == 13.0 and summary["programs"] == 2 and summary["items"] == 4
    assert summary["kinds"]["qkv"] == {"items": 1, "wait_us_median": 2.4, "run_us_median": 2.0, "run_us_sum": 2.0}
    assert summary["kinds"]["row_chain"]["run_us_median"] == 3.5
    assert summary["kinds"]["row_chain"]["stages_us_median"] == {"out_proj_norm2": 1.2, "ffn_in": 0.6,
                                                                 "ffn_out_gelu_norm": 1.7}
    assert summary["blocks"] == {"entry": {"from_us": 0.0, "to_us": 2.0}, "block 0": {"from_us": 0.1, "to_us": 13.0}}
    assert summary["busy"] == round((2000 + 2000 + 4000 + 3500) / (13000 * 2), 4)
    # a trace without the row chain's marks (4 columns) still reads, without its parts
    old = lk.trace_summary(rows[:, [0, 1, 2, 5]], layout)
    assert old["span_us"] == 13.0 and "stages_us_median" not in old["kinds"]["row_chain"]
    with pytest.raises(KKError, match="a trace of 4 items for a layout of 8"):
        lk.trace_summary(rows, layout * 2)
    model = build_models(CONFIG, torch.float16, "cpu")[0]
    monkeypatch.setattr(lk, "INTERPRET", True)
    monkeypatch.setattr(lk, "triton_available", lambda: True)
    with pytest.raises(KKError, match="tracing reads the GPU's clock"):
        lk.LayerKernels(model, lk.LayerLaunch(persistent=True, trace=True))
    assert lk.LayerLaunch(persistent=True, trace=True).name() == "persistent_cached_mdiv_w8_p1_trace"
    with pytest.raises(KKError, match="no traced call"):
        lk.LayerKernels(model, lk.LayerLaunch(persistent=True)).trace()


def test_the_persistent_launch_compiles_for_sm90_with_its_hand_offs_on_one_thread():
    """Compiled here for sm_90a (Triton 3.6.0, as on the H200), specialized as the JIT specializes a launch: each
    ticket, release and acquire is one thread's atomic (``@%p``-predicated) whose value reaches the others through
    shared memory behind ``bar.sync``; the traced twin reads ``%globaltimer`` and the plain launch never does."""
    pytest.importorskip("triton")
    import re

    from tests.conftest import load_script

    script = load_script("offline_ptx")
    values = dict(script.KERNELS["model"][3])
    ptx = script.compile_ptx("model", values, 8, 2)
    assert re.findall(r"@%p\d+ atom\.global\.gpu\.acq_rel\.add\.u32", ptx)  # the ticket and the exit count
    assert re.findall(r"@%p\d+ atom\.global\.gpu\.release\.add\.u32", ptx)  # each hand-off
    assert re.findall(r"@%p\d+ ld\.global\.gpu\.acquire\.b32", ptx)  # each wait's poll
    assert re.findall(r"wgmma\.mma_async", ptx) and "globaltimer" not in ptx
    traced = script.compile_ptx("model", {**values, "TRACE": True}, 8, 2)
    assert "%globaltimer" in traced


def test_the_register_chain_s_gemms_stay_wgmma():
    """The row chain in registers feeds ``tl.dot`` from registers (norm2's rows, the GELU's, norm1's for Q|K|V).
    Compiled for sm_90a at shape 3's sizes (64-row tiles), every one of its GEMMs is still Hopper's wgmma, the
    instruction the split tiles were proven with: none falls back to mma.sync, which the attention's 16- and 32-row
    launches lower to and which was not bit-identical there. Shape 7's sizes (rows of 32, F = 32) too."""
    pytest.importorskip("triton")
    import re

    from tests.conftest import load_script

    script = load_script("offline_ptx")
    values = dict(script.KERNELS["model"][3])
    chained = {**values, "CHAIN_REGS": True, "CHAIN_QKV": True}
    shape7 = {**chained, "D": 32, "F": 32, "HEAD_DIM": 8, "DH_PAD": 16, "BK_D": 32, "BK_F": 32, "BN_F": 32}
    wgmma = lambda ptx: len(re.findall(r"wgmma\.mma_async", ptx))  # noqa: E731
    counts = []
    for sizes in (chained, shape7):
        ptx = script.compile_ptx("model", sizes, 8, 2)
        assert not re.findall(r"\bmma\.sync", ptx) and wgmma(ptx) > 0
        counts.append(wgmma(ptx))
    # at shape 3's sizes the chain adds its own GEMMs (out_proj, ffn_in, ffn_out, the next Q|K|V) beside the tiles'
    assert counts[0] > wgmma(script.compile_ptx("model", values, 8, 2))


def test_the_offline_compile_specializes_as_the_jit_does():
    """Pointers and the integer arguments divisible by 16 get Triton's divisibility hint, as the JIT gives them on
    a launch: the attention's K and V chunks then load as vectors, not as one 16-bit value per thread and element
    (without it the PTX and its register counts are not what the GPU runs)."""
    pytest.importorskip("triton")
    import re

    from tests.conftest import load_script

    script = load_script("offline_ptx")
    for kernel, names in script.DIVISIBLE.items():
        assert set(names) <= set(script.KERNELS[kernel][2]), kernel
    values = {**script.KERNELS["attention"][3], "NCACHED": 4, "FAST_DIV": True}
    vectors = lambda ptx: len(re.findall(r"ld\.global(?:\.\w+)*\.v[248]", ptx))  # noqa: E731
    assert vectors(script.compile_ptx("attention", values, 4, 3)) > 0
    assert vectors(script.compile_ptx("attention", values, 4, 3, specialize=False)) == 0


def test_the_gpu_study_script_runs_its_whole_flow_under_the_interpreter(tmp_path):
    """The next GPU session's first call runs scripts/layer_kernels_h200.py with persistent launches: its flow
    (launch specs, checks, standalone Q|K|V, the JSON) runs here first, under Triton's interpreter. Its differing
    counts are against the CPU's float16 ATen ops, so only their agreement between launches is asserted."""
    pytest.importorskip("triton")
    out = tmp_path / "layers.json"
    run = subprocess.run(
        [sys.executable, "scripts/layer_kernels_h200.py", "--device", "cpu", "--shapes", "", "--dims", "2,40,32,2,64,2",
         "--weights", "own:5", "--launches", "cached_mdiv:1:4:persistent,cached_mdiv:1:4:split,"
         "cached_mdiv:1:4:persistent:nochain:p2", "--trace", "--json", str(out)],
        capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1], timeout=600,
        env=dict(os.environ, TRITON_INTERPRET="1"))
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["device"].startswith("cpu")
    rows = report["rows"]
    assert [r["launch"] for r in rows] == ["persistent_cached_mdiv_w4_p1", "cached_mdiv_split_w4",
                                           "persistent_cached_mdiv_w4_p2_nochain"]
    assert all("error" not in r and len(r["checks"]) == 4 and "eager_ms" not in r for r in rows), rows
    # the three launches compute the same bits (each check's differing count against the same reference)
    counts = [[c["output_differing"] for c in r["checks"]] for r in rows]
    assert counts[0] == counts[1] == counts[2], counts
    assert all(c["strict_failed"] == 0 for r in rows for c in r["checks"])
    assert "--device cpu runs Triton's interpreter" in subprocess.run(
        [sys.executable, "scripts/layer_kernels_h200.py", "--device", "cpu", "--dims", "2,40,32,2,64,2"],
        capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1], timeout=120,
        env={k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}).stderr
