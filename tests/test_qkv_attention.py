"""kkdeploy.kernels._qkv_attention_triton and kkdeploy.kernels.qkv_attention: the attention with its Q, K and V
projections in one launch (a study), and its op.

Its claim is that it computes what the two launches a build runs now compute: the packed Q|K|V GEMM tile, then the
register-cached attention launch. Under Triton's interpreter (CPU) the launch is checked against exactly those two
launches, bit for bit, on causal and non-causal rows, padded and not, head dims of 8 to 32, D not a power of two;
on a GPU ``scripts/qkv_attention_study.py`` counts its bits against ATen's composition. The refusals are one line.
"""

from __future__ import annotations

import textwrap

import pytest
import torch

from kkdeploy import TransformerConfig, generate_case
from kkdeploy.kernels import fused_blocks as fb
from kkdeploy.kernels import qkv_attention as qa
from kkdeploy.models.reference import zero_invalid_rows
from kkdeploy.models.weights import build_models
from tests.conftest import bits_equal, run_interpreter_script

CONFIG = TransformerConfig(batch_size=2, seq_len=24, d_model=32, num_heads=4, ffn_dim=32, num_layers=2, causal=True)
#: our GEMMs everywhere (their CPU kernels are the reference's ops), with and without the LayerNorm epilogues
PLANS = [{"gemms": True, "packed_qkv": True, "gelu_prologue": True, "gelu": False, "layer_norm": layer_norm,
          "qkv_attention": True} for layer_norm in (False, True)]

#: what both interpreter scripts share: the kernels, the seven cases (padded and not, S from 17 to 128, causal and
#: not) and the two launches the one launch replaces, the reference each form is compared with
SCRIPT_HEAD = textwrap.dedent(
    """
    import json
    import torch
    from kkdeploy.kernels._fused_linear_triton import triton_linear
    from kkdeploy.kernels._faithful_attention_triton import triton_attention
    from kkdeploy.kernels._qkv_attention_triton import triton_qkv_attention
    from kkdeploy.kernels.qkv_attention import LAUNCHES

    CASES = [(2, 128, 128, 4, True, True), (1, 80, 64, 2, False, True), (3, 32, 128, 4, True, False),
             (2, 17, 32, 4, True, True), (1, 100, 96, 3, True, True), (1, 65, 64, 4, True, False),
             (1, 128, 32, 4, True, True)]


    def two_launches(h, ws, bs, padded, heads, causal, g):
        b, s, d = h.shape
        mask = None
        if padded:
            lengths = torch.randint(max(1, s // 2), s + 1, (b,), generator=g)
            mask = torch.arange(s)[None, :] < lengths[:, None]
        q, k, v = triton_linear(h, torch.cat(ws), torch.cat(bs)).split(d, dim=-1)
        two = triton_attention(q, k, v, mask, heads, causal, cached=True, block_m=64, num_warps=4, fast_div=True)
        return mask, q, k, v, two
    """
)

INTERPRETER_SCRIPT = SCRIPT_HEAD + textwrap.dedent(
    """
    g = torch.Generator().manual_seed(0)
    results = []
    for b, s, d, heads, causal, padded in CASES:
        # h and the weights on grids whose products and sums are exact in float32: the interpreter's dots then
        # agree whatever their tile, and the softmax inputs are spread out
        h = torch.randint(-16, 17, (b, s, d), generator=g).half() / 16
        ws = [torch.randint(-8, 9, (d, d), generator=g).half() / 64 for _ in range(3)]
        bs = [torch.randn(d, generator=g).half() for _ in range(3)]
        mask, q, k, v, two = two_launches(h, ws, bs, padded, heads, causal, g)
        one = triton_qkv_attention(h, ws, bs, mask, heads, causal)
        forms = {"whole": triton_qkv_attention(h, ws, bs, mask, heads, causal, whole=True, early=True),
                 "pair": triton_qkv_attention(h, ws, bs, mask, heads, causal, pair=True, early=True),
                 "whole, late": triton_qkv_attention(h, ws, bs, mask, heads, causal, whole=True, early=False),
                 "pair, late": triton_qkv_attention(h, ws, bs, mask, heads, causal, pair=True, early=False),
                 "whole_w8": triton_qkv_attention(h, ws, bs, mask, heads, causal, **LAUNCHES["whole_w8"]),
                 "whole_em": triton_qkv_attention(h, ws, bs, mask, heads, causal, **LAUNCHES["whole_em"]),
                 "pair128_w8": triton_qkv_attention(h, ws, bs, mask, heads, causal, **LAUNCHES["pair128_w8"])}
        results.append(dict(case=[b, s, d, heads, causal, padded], elements=two.numel(),
                            differing=int((one.view(torch.int16) != two.view(torch.int16)).sum()),
                            forms_differing={name: int((out.view(torch.int16) != two.view(torch.int16)).sum())
                                             for name, out in forms.items()},
                            finite=bool(torch.isfinite(one).all())))
    print("RESULTS " + json.dumps(results))
    """
)


def test_one_launch_equals_the_two_it_replaces_under_the_interpreter():
    """Every form: each projection on its own (keys as the causal limit needs them); q, k and v in one walk over D
    (``whole``); and one program per head walking both row blocks on rows projected once (``pair``); each of the
    last two with its biases loaded before the walk over D (``early``, as builds run them) and after it."""
    results = run_interpreter_script(INTERPRETER_SCRIPT)
    assert len(results) == 7
    for r in results:
        assert r["differing"] == 0 and r["forms_differing"] == {"whole": 0, "pair": 0, "whole, late": 0,
                                                                "pair, late": 0, "whole_w8": 0, "whole_em": 0,
                                                                "pair128_w8": 0}, r
        assert r["finite"], r


PV64_SCRIPT = SCRIPT_HEAD + textwrap.dedent(
    """
    g = torch.Generator().manual_seed(1)
    results = []
    for b, s, d, heads, causal, padded in CASES:
        # inputs whose every P.V sum is exact in float32, whatever its order: V small integers (rows of -1/0/1
        # against sparse -1/0/1 weights, integer biases), and scores within about +-0.25, so a row's
        # probabilities span at most two binades; 11 bits of p, 3 of v, 2 binades and 7 bits of terms fit 24 bits
        h = torch.randint(-1, 2, (b, s, d), generator=g).half()
        sparse = lambda density, scale: (torch.randint(-1, 2, (d, d), generator=g)
                                         * (torch.rand(d, d, generator=g) < density)).half() * scale
        ws = [sparse(0.1, 1 / 64), sparse(0.1, 1 / 64), sparse(1.5 / d, 1.0)]
        bs = [torch.zeros(d).half(), torch.zeros(d).half(), torch.randint(-2, 3, (d,), generator=g).half()]
        mask, q, k, v, two = two_launches(h, ws, bs, padded, heads, causal, g)
        forms = {name: triton_qkv_attention(h, ws, bs, mask, heads, causal, **LAUNCHES[name])
                 for name in ("whole_em", "whole_pv", "pair128_pv_w8")}
        dh = d // heads
        qh, kh = (t.float().view(b, s, heads, dh).transpose(1, 2) for t in (q, k))
        score_max = float((qh @ kh.transpose(-1, -2)).abs().max()) / dh ** 0.5
        results.append(dict(case=[b, s, d, heads, causal, padded], v_max=float(v.abs().max()),
                            v_integer=bool((v == v.round()).all()), score_max=score_max,
                            forms_differing={name: int((out.view(torch.int16) != two.view(torch.int16)).sum())
                                             for name, out in forms.items()},
                            finite=all(bool(torch.isfinite(out).all()) for out in forms.values())))
    print("RESULTS " + json.dumps(results))
    """
)


def test_p_v_over_64_keys_equals_the_chained_chunks_on_exact_sums():
    """``whole_pv`` (each chunk pair's P.V as one 64-key dot, V not split into chunks). Triton's interpreter sums a
    dot in numpy's order, so it cannot vouch for the bits of a 64-key sum against two chained 32-key sums in
    general (only the GPU's proof can). On inputs whose every P.V sum is exact in float32 it can vouch for the
    rest: which probability meets which V row, the unscored chunks' zeros (S of 32 and less, and 65-96), the
    padded keys and the non-causal rows. ``pair128_pv_w8`` (both row blocks as one tile, P.V over 64 keys) too."""
    results = run_interpreter_script(PV64_SCRIPT)
    assert len(results) == 7
    for r in results:
        # the exactness's conditions: V integers of 3 bits, and scores within +-0.35 (exps within a factor 2 of a
        # row's largest, so its probabilities span at most two binades)
        assert r["v_integer"] and 1 <= r["v_max"] <= 7 and r["score_max"] <= 0.35, r
        assert r["forms_differing"] == {"whole_em": 0, "whole_pv": 0, "pair128_pv_w8": 0} and r["finite"], r


@pytest.mark.parametrize("s, d, heads, fragment", [
    (16, 128, 4, "takes 17 to 128 keys"),
    (129, 128, 4, "takes 17 to 128 keys"),
    (64, 130, 4, "does not split into 4 heads"),
    (64, 512, 2, "head dims up to 128"),
])
def test_refusals_name_the_limit(s, d, heads, fragment):
    from kkdeploy.kernels.qkv_attention import qkv_attention_refusal

    refusal = qkv_attention_refusal(s, d, heads)
    assert refusal is not None and fragment in refusal and "\n" not in refusal
    assert qkv_attention_refusal(128, 128, 4) is None


def test_launcher_refuses_wrong_weights_in_one_line():
    pytest.importorskip("triton")
    import torch

    from kkdeploy.errors import KKError
    from kkdeploy.kernels._qkv_attention_triton import triton_qkv_attention
    from kkdeploy.kernels.qkv_attention import LAUNCHES

    h = torch.zeros(1, 32, 64, dtype=torch.float16)
    w = torch.zeros(64, 64, dtype=torch.float16)
    bias = torch.zeros(64, dtype=torch.float16)
    with pytest.raises(KKError, match="three float16"):
        triton_qkv_attention(h, [w, w, w[:32]], [bias] * 3, None, 4, True)
    with pytest.raises(KKError, match="takes 17 to 128 keys"):
        triton_qkv_attention(torch.zeros(1, 8, 64, dtype=torch.float16), [w] * 3, [bias] * 3, None, 4, True)
    with pytest.raises(KKError, match="float16"):
        triton_qkv_attention(h.float(), [w] * 3, [bias] * 3, None, 4, True)
    with pytest.raises(KKError, match="pass whole=True or pair=True"):  # the split form has no early loads
        triton_qkv_attention(h, [w] * 3, [bias] * 3, None, 4, True, early=True)
    with pytest.raises(KKError, match="pv64 runs the whole form's P.V"):
        triton_qkv_attention(h, [w] * 3, [bias] * 3, None, 4, True, pair=True, pv64=True)


def test_compiled_for_sm90_it_runs_the_cached_launchs_tiles_and_a_pdl_form_of_the_same_arithmetic():
    """Compiled here for sm_90a (``scripts/offline_ptx.py``, this Triton): every dot is a 64-row wgmma tile of the
    cached launch's own shape (m64n32k16 at Dh = 32), the exps are as many as the cached launch's (one per score,
    each chunk taken once), and the dependent-launch form adds only the two griddepcontrol instructions."""
    pytest.importorskip("triton")
    import collections
    import re

    from kkdeploy.kernels.dependent_launch import arithmetic_opcodes, ptx_difference
    from tests.conftest import load_script

    script = load_script("offline_ptx")
    values = script.KERNELS["qkv_attention"][3]
    plain = script.compile_ptx("qkv_attention", values, 4, 3)
    cached = script.compile_ptx("attention", {**script.KERNELS["attention"][3], "NCACHED": 4, "FAST_DIV": True}, 4,
                                3)
    shapes = set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)", plain))
    assert shapes == set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)", cached)) == {"m64n32k16"}
    assert len(re.findall(r"ex2\.approx", plain)) == len(re.findall(r"ex2\.approx", cached))
    assert "mma.sync" not in plain
    assert ptx_difference(plain, script.compile_ptx("qkv_attention", {**values, "PDL": True}, 4, 3)) == []
    whole = script.compile_ptx("qkv_attention", {**values, "WHOLE": True}, 4, 3)  # one walk over D for q, k and v
    assert set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)", whole)) == {"m64n32k16"}
    assert len(re.findall(r"ex2\.approx", whole)) == len(re.findall(r"ex2\.approx", cached))
    pair = script.compile_ptx("qkv_attention", {**values, "WHOLE": True, "PAIR": True}, 4, 3)  # both row blocks
    assert set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)", pair)) == {"m64n32k16"}
    assert "mma.sync" not in pair
    assert len(re.findall(r"ex2\.approx", pair)) < 2 * len(re.findall(r"ex2\.approx", cached))  # block 0: 2 chunks
    # the biases loaded before the walk over D: the same floating-point, MMA and conversion instructions, as many of
    # each, and the same MMA chain in order (the scheduler interleaves the bias additions anew; the interpreter
    # above, and a GPU proof, compare the bits)
    mma = lambda ptx: [op for op in arithmetic_opcodes(ptx) if op.startswith("wgmma")]  # noqa: E731
    for form in (whole, pair):
        early = script.compile_ptx("qkv_attention", {**values, "WHOLE": True, "PAIR": form is pair, "EARLY": True},
                                   4, 3)
        assert collections.Counter(arithmetic_opcodes(early)) == collections.Counter(arithmetic_opcodes(form))
        assert mma(early) == mma(form)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ratio", [0.0, 0.25])
@pytest.mark.parametrize("plan", PLANS, ids=["blocks", "model"])
def test_the_forward_through_the_op_is_the_reference_on_the_cpu(dtype, ratio, plan):
    """On the CPU the op is the reference's composition: the block and model forwards through it are the reference's
    bits, all-valid and padded."""
    model = build_models(CONFIG, dtype, "cpu")[0]
    x, mask = generate_case(CONFIG, "cpu", dtype, 1234, padding_ratio=ratio)
    mask = mask if ratio else None
    with torch.no_grad():
        if plan["layer_norm"]:
            got = fb.fused_model_forward(model, x, mask, plan)
            want = model(x, mask)
        else:
            block = model.layers[0]
            got, want = fb.fused_block_forward(block, x, mask, plan), block(x, mask)
    assert bits_equal(got, want)


def test_the_op_is_the_reference_composition_and_has_a_fake():
    from torch._subclasses.fake_tensor import FakeTensorMode

    model = build_models(CONFIG, torch.float32, "cpu")[0]
    attention = model.layers[0].attention
    x, mask = generate_case(CONFIG, "cpu", torch.float32, 1236, padding_ratio=0.25)
    with torch.no_grad():
        h = model.layers[0].norm1(x)
        got = qa.qkv_attention(h, attention, mask)
        # the reference module's own forward is out_proj of this context, invalid rows zeroed
        assert bits_equal(zero_invalid_rows(attention.out_proj(got), mask), attention(h, mask))
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = qa.qkv_attention(mode.from_tensor(h), attention, mode.from_tensor(mask))
    assert fake.shape == h.shape and fake.dtype == h.dtype


def _remember(proof, op, shape, environment, chosen, ms, aten_ms=None):
    launches = [proof.LaunchResult(chosen, ms=ms, status="proven")] if chosen else []
    proof.remember_proof(proof.ProofRecord(op=op, shape=shape, environment=environment, chosen=chosen,
                                           reason="test", launches=launches, reference_ms=aten_ms))


def test_the_plan_takes_the_one_launch_where_its_proof_beats_the_two_it_replaces(monkeypatch, proof_sandbox):
    """Proven and, by the proofs' own times, faster than the packed Q|K|V GEMM plus the attention's launch: taken;
    slower (shape 6 on an H100: 1.90 ms against 0.63 + 1.10), unproven, or without the packed Q|K|V: not."""
    from kkdeploy.kernels import faithful_attention as fa
    from kkdeploy.kernels import fused_linear as fl
    from kkdeploy.kernels import paths

    monkeypatch.setattr(paths, "triton_available", lambda: True)
    monkeypatch.setattr(qa, "triton_available", lambda: True)
    monkeypatch.setattr(fl, "triton_available", lambda: True)
    config = TransformerConfig(batch_size=4, seq_len=128, d_model=128, num_heads=4, ffn_dim=128, num_layers=2)
    cuda = torch.device("cuda")
    b, s, d, h = 4, 128, 128, 4
    assert not fb.qkv_attention_in_plan(config, torch.float16, cuda, True, False)  # no proof of it here
    _remember(proof_sandbox, fl.OP, fl.proof_shape(b * s, 3 * d, d, "none"), fl.proof_environment(cuda, "none"),
              "m64n64", 0.0037, 0.0099)
    _remember(proof_sandbox, fa.OP, fa.proof_shape(b * h, s, d // h, True), fa.proof_environment(cuda),
              "cached64w4_mdiv", 0.0050, 0.040)
    shape = qa.proof_shape(b, s, d, h, True)
    _remember(proof_sandbox, qa.OP, shape, qa.proof_environment(cuda), "whole", 0.0070, 0.045)
    assert fb.qkv_attention_in_plan(config, torch.float16, cuda, True, False)  # 7.0 us against 3.7 + 5.0
    assert not fb.qkv_attention_in_plan(config, torch.float16, cuda, False, False)  # Q|K|V not packed here
    assert not fb.qkv_attention_in_plan(config, torch.float16, cuda, True, True)  # the feed-forward computes it
    assert not fb.qkv_attention_in_plan(config, torch.float32, cuda, True, False)
    assert not fb.qkv_attention_in_plan(config, torch.float16, torch.device("cpu"), True, False)
    _remember(proof_sandbox, qa.OP, shape, qa.proof_environment(cuda), "whole", 0.0090, 0.045)
    assert not fb.qkv_attention_in_plan(config, torch.float16, cuda, True, False)  # 9.0 us: slower than the two
    _remember(proof_sandbox, qa.OP, shape, qa.proof_environment(cuda), None, None, 0.045)
    assert not fb.qkv_attention_in_plan(config, torch.float16, cuda, True, False)  # refused by its proof


def test_a_gemm_candidate_proves_it_beside_its_gemms_and_records_it(monkeypatch):
    """The op shape is proven with the GEMMs (the "linear" kind) where the attention kernel runs too, for rows it
    takes (where a build proves its forms, or a study names one); its records belong to that kind and are adopted
    back from a manifest."""
    from kkdeploy.config import official_config
    from kkdeploy.kernels import model_proofs as mp

    gemms = ["attention", "layer_norm", "linear"]
    # the forms GPU builds shipped through strict validation
    assert qa.BUILD_LAUNCHES == ("whole", "pair", "whole_w8", "whole_em", "whole_pv")
    monkeypatch.setattr(qa, "BUILD_LAUNCHES", ())  # with none in builds, only a study naming one proves it
    assert "qkv_attention" not in [n for _, n, _ in mp.kernel_op_shapes(official_config(3), gemms)]
    assert "qkv_attention" in [n for _, n, _ in mp.kernel_op_shapes(official_config(3), gemms,
                                                                      {"linear": ["auto", "whole"]})]
    monkeypatch.setattr(qa, "BUILD_LAUNCHES", ("whole", "split"))
    named = lambda config, kinds: [n for _, n, _ in mp.kernel_op_shapes(config, kinds)]  # noqa: E731
    assert "qkv_attention" in named(official_config(3), gemms)
    assert "qkv_attention" in named(official_config(12), gemms)  # S = 32
    assert "qkv_attention" not in named(official_config(13), gemms)  # S = 1024: the attention launch on packed Q|K|V
    assert "qkv_attention" not in named(official_config(3), ["linear"])
    assert "qkv_attention" not in named(official_config(3), ["attention", "layer_norm"])
    config = TransformerConfig(batch_size=2, seq_len=24, d_model=32, num_heads=4, ffn_dim=32, num_layers=2)
    model = build_models(config, torch.float16, "cpu")[0]
    proofs = mp.prove_model_kernels(model, config, torch.float16, "cpu", gemms, reuse=False)
    records = [r for r in proofs.of_kind("linear") if r.op == qa.OP]
    assert len(records) == 1 and not records[0].proven and "CUDA-only" in records[0].reason
    assert records[0].shape == qa.proof_shape(2, 24, 32, 4, True)
    assert records[0] in proofs.only(["linear"]).records and records[0] not in proofs.only(["attention"]).records
    assert mp.adopt_recorded([records[0].to_dict()], "cpu") == (1, 0)


def test_the_launch_refuses_what_it_cannot_take_in_one_line():
    assert "CUDA-only" in qa.kernel_refusal(128, 128, 4, torch.float16, "cpu")
    assert "float16 reference only" in qa.kernel_refusal(128, 128, 4, torch.float32, "cuda")
    assert "17 to 128 keys" in qa.kernel_refusal(256, 128, 4, torch.float16, "cuda")
    with pytest.raises(Exception, match="unknown Q\\|K\\|V attention launch 'nope'"):
        qa.run_launch(None, (), (), None, 4, True, "nope")
    pytest.importorskip("triton")
    from kkdeploy.errors import KKError
    from kkdeploy.kernels._qkv_attention_triton import triton_qkv_attention

    h = torch.zeros(1, 32, 32, dtype=torch.float16)
    ws, bs = [torch.zeros(32, 32, dtype=torch.float16)] * 3, [torch.zeros(32, dtype=torch.float16)] * 3
    for form in ({}, {"pair": True}):  # the keys' validity loaded early is the whole form's only
        with pytest.raises(KKError, match="early_mask loads the keys' validity .* pass whole=True"):
            triton_qkv_attention(h, ws, bs, None, 4, True, early=bool(form), early_mask=True, **form)
    with pytest.raises(KKError, match="rows128 attends a pair program's two row blocks as one tile; pass pair=True"):
        triton_qkv_attention(h, ws, bs, None, 4, True, whole=True, rows128=True)
    with pytest.raises(KKError, match="pv64 runs .* pass whole=True \\(or pair=True with rows128=True\\)"):
        triton_qkv_attention(h, ws, bs, None, 4, True, pair=True, pv64=True)


def test_the_launch_bound_forms_are_proven_only_where_launches_bound():
    """``whole_w8`` and ``whole_em`` (session 49: the fastest at 32-256 programs, slower than ``pair`` at 512 and
    more) are proven where the launch's programs (head x 64-row block) fill at most two waves of the
    multiprocessors: shapes 2, 3, 4, 9, 10 and 12 on 132, not shapes 1, 5, 6 or 7. The other forms everywhere, and
    every form where the multiprocessors are not known (the CPU)."""
    from kkdeploy.config import official_config

    def shape(sid):
        c = official_config(sid)
        return qa.proof_shape(c.batch_size, c.seq_len, c.d_model, c.num_heads, c.causal)

    sids = (1, 2, 3, 4, 5, 6, 7, 9, 10, 12)
    paid = {sid: [n for n in qa.BUILD_LAUNCHES if qa.launch_pays(n, shape(sid), 132)] for sid in sids}
    assert all(paid[sid] == list(qa.BUILD_LAUNCHES) for sid in (2, 3, 4, 9, 10, 12))
    assert all(paid[sid] == ["whole", "pair"] for sid in (1, 5, 6, 7))
    assert all(qa.launch_pays(n, shape(6), None) for n in qa.BUILD_LAUNCHES)
    # the rule is part of the launches' digest: a record proven under another rule is not found
    from kkdeploy.kernels.proof import launch_table_digest

    assert qa.LAUNCHES_DIGEST != launch_table_digest(qa.LAUNCHES, qa.BUILD_LAUNCHES, qa.LAUNCH_BOUND_FORMS, 4)


def test_offline_ptx_lists_the_layout_moves_by_source_line():
    """``scripts/offline_ptx.py --layouts``: the TTGIR's layout conversions and shared-memory stagings, each by its
    source line and the calls that led there (where a short launch's time goes between its MMAs). On a made-up
    TTGIR the call sites resolve innermost first; compiled here for sm_90a, the ``whole_em`` form's V is split into
    its 32-key chunks through a conversion (``_row_halves``), which a future form could avoid."""
    from pathlib import Path

    import kkdeploy.kernels._qkv_attention_triton as kernel
    from tests.conftest import load_script

    script = load_script("offline_ptx")
    ttgir = "\n".join([
        '%0 = ttg.convert_layout %a : tensor<64x32xf32> loc(#loc3)',
        '%1 = ttg.convert_layout %b : tensor<64x32xf32> loc(#loc3)',
        '%2 = ttg.local_alloc %c : tensor<32x32xf16> loc(#loc1)',
        '%3 = arith.addf %x, %y : tensor<64x32xf32> loc(#loc1)',
        '#loc1 = loc("/x/kernels/_qkv_attention_triton.py":73:20)',
        '#loc2 = loc("/x/kernels/_qkv_attention_triton.py":261:8)',
        '#loc3 = loc(callsite(#loc1 at #loc2))'])
    assert script.layout_moves(ttgir) == [
        (2, "ttg.convert_layout", "_qkv_attention_triton.py:73 <- _qkv_attention_triton.py:261"),
        (1, "ttg.local_alloc", "_qkv_attention_triton.py:73")]
    pytest.importorskip("triton")
    asm = script.compile_asm("qkv_attention", {**script.KERNELS["qkv_attention"][3], "WHOLE": True, "EARLY": True,
                                               "EARLY_MASK": True, "NK": 128})
    moves = script.layout_moves(asm["ttgir"])
    assert sum(n for n, op, _ in moves if op == "ttg.convert_layout") >= 4
    halves = next(i for i, line in enumerate(Path(kernel.__file__).read_text().splitlines(), 1)
                  if "def _row_halves" in line)
    assert any(op == "ttg.convert_layout" and where.startswith(f"_qkv_attention_triton.py:{halves + 2}")
               for _, op, where in moves), moves


def test_both_row_blocks_in_one_tile_keep_each_warpgroups_softmax_to_itself():
    """Compiled here for sm_90a: ``pair128_w8`` (one program per head, 8 warps, both row blocks as one 128-row tile)
    issues only ``wgmma`` tiles of 64 rows and has about as many barriers as the 4-warp forms, where ``whole_w8``
    (8 warps on one 64-row block, each row's keys split across the warpgroups) has more than twice as many: each
    warpgroup's rows stay in its own warps, so a row's max and sums need no trip through shared memory."""
    pytest.importorskip("triton")
    import re

    from tests.conftest import load_script

    script = load_script("offline_ptx")
    values = {**script.KERNELS["qkv_attention"][3], "EARLY": True, "NK": 128}
    rows128 = script.compile_asm("qkv_attention", {**values, "PAIR": True, "ROWS128": True, "PV64": True}, 8)["ptx"]
    w8 = script.compile_asm("qkv_attention", {**values, "WHOLE": True}, 8)["ptx"]
    tiles = set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)", rows128))
    assert tiles and all(tile.startswith("m64") for tile in tiles) and "mma.sync" not in rows128, tiles
    assert 2 * len(re.findall(r"bar\.sync", rows128)) < len(re.findall(r"bar\.sync", w8))
    assert qa.LAUNCHES["pair128_pv_w8"] == {**qa.LAUNCHES["pair128_w8"], "pv64": True}
    assert "pair128_w8" not in qa.BUILD_LAUNCHES  # a study until a GPU proves it and a build ships it


def test_p_v_over_64_keys_issues_the_same_mmas_with_fewer_trips_through_shared_memory():
    """Compiled here for sm_90a (``scripts/offline_ptx.py``): ``whole_pv`` issues ``whole_em``'s wgmma tiles, as
    many, and as many exps, with fewer barriers and layout conversions (V is never split into its 32-key chunks):
    session 49's 14 barriers against 20 and 7 conversions against 11, at Triton 3.6.0."""
    pytest.importorskip("triton")
    import re

    from tests.conftest import load_script

    script = load_script("offline_ptx")
    values = {**script.KERNELS["qkv_attention"][3], "WHOLE": True, "EARLY": True, "EARLY_MASK": True, "NK": 128}
    em, pv = (script.compile_asm("qkv_attention", {**values, "PV64": flag}) for flag in (False, True))
    tiles = lambda ptx: re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)", ptx)  # noqa: E731
    assert set(tiles(pv["ptx"])) == set(tiles(em["ptx"])) == {"m64n32k16"} and "mma.sync" not in pv["ptx"]
    assert len(tiles(pv["ptx"])) == len(tiles(em["ptx"]))
    assert len(re.findall(r"ex2\.approx", pv["ptx"])) == len(re.findall(r"ex2\.approx", em["ptx"]))
    assert len(re.findall(r"bar\.sync", pv["ptx"])) < len(re.findall(r"bar\.sync", em["ptx"]))
    conversions = lambda asm: sum(n for n, op, _ in script.layout_moves(asm["ttgir"])  # noqa: E731
                                  if op == "ttg.convert_layout")
    assert conversions(pv) < conversions(em)
    assert qa.LAUNCHES["whole_pv"] == {**qa.LAUNCHES["whole_em"], "pv64": True}
    # in builds since a GPU proved it (session 50), proven only where launches bound, as whole_em
    assert "whole_pv" in qa.BUILD_LAUNCHES and "whole_pv" in qa.LAUNCH_BOUND_FORMS
