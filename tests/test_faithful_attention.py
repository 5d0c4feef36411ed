"""kkdeploy.kernels.faithful_attention: the custom op, its dispatch, its fake kernel, its errors.

The GPU proof (kernel == ATen composition bit for bit) is the build's proof step (scripts/kernel_selftest.py);
here: the CPU path is the reference bit for bit, and, when Triton is importable, the kernel's logic runs
under TRITON_INTERPRET=1 against an emulation of ATen's softmax order (scores and probabilities bitwise).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from kkdeploy import OFFICIAL_SHAPES, KKError, ReferenceTransformer, TransformerConfig
from kkdeploy.kernels import (
    MAX_FUSED_SEQ_LEN,
    emulate_persistent_softmax,
    reference_attention,
    select_attention_path,
)
from kkdeploy.kernels import faithful_attention as fa
from kkdeploy.kernels.faithful_attention import faithful_attention
from tests.conftest import bits_equal, load_script, round_to_float32, run_interpreter_script

REPO = Path(__file__).resolve().parents[1]


def padded_mask(b: int, s: int, seed: int = 0, padding_ratio: float = 0.25) -> torch.Tensor:
    """design.md §4's lengths: randint(max(1, round(S*(1-ratio))), S+1)."""
    g = torch.Generator().manual_seed(seed)
    min_valid = max(1, round(s * (1 - padding_ratio)))
    lengths = torch.randint(min_valid, s + 1, (b,), generator=g)
    return torch.arange(s)[None, :] < lengths[:, None]


def projections(config: TransformerConfig, dtype: torch.dtype, seed: int = 0):
    """Layer 0's attention module of a seeded reference model and its q/k/v Linear outputs."""
    torch.manual_seed(seed)
    model = ReferenceTransformer(config).to(dtype)
    attention = model.layers[0].attention
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(config.batch_size, config.seq_len, config.d_model, generator=g).to(dtype)
    with torch.no_grad():
        h = model.layers[0].norm1(x)
        return attention, attention.q_proj(h), attention.k_proj(h), attention.v_proj(h)


CASES = [
    # B, S, D, H, causal
    (3, 16, 32, 4, True),
    (2, 33, 64, 2, True),
    (2, 20, 64, 8, False),
    (1, 1, 16, 2, True),
    (2, 40, 48, 3, False),
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("b,s,d,h,causal", CASES)
@pytest.mark.parametrize("padded", [False, True])
def test_cpu_op_is_the_reference_bit_for_bit(b, s, d, h, causal, padded, dtype):
    config = TransformerConfig(b, s, d, h, 2 * d, 1, causal=causal)
    attention, q, k, v = projections(config, dtype)
    mask = padded_mask(b, s) if padded else None
    with torch.no_grad():
        expected = attention.attend(attention.split_heads(q), attention.split_heads(k),
                                    attention.split_heads(v), mask)
        out = faithful_attention(q, k, v, mask, num_heads=h, causal=causal)
        direct = torch.ops.kkdeploy_faithful.attention(q, k, v, mask, h, causal)
        pure = reference_attention(q, k, v, mask, h, causal)
    assert out.shape == (b, s, d) and out.dtype == dtype
    assert bits_equal(out, expected)
    assert bits_equal(direct, expected)
    assert bits_equal(pure, expected)


def test_op_on_a_packed_qkv_slice_equals_contiguous_inputs():
    """q, k, v may be column slices of one packed QKV output (row stride 3D)."""
    config = TransformerConfig(2, 12, 32, 4, 64, 1)
    _, q, k, v = projections(config, torch.float16)
    packed = torch.cat([q, k, v], dim=-1)
    qs, ks, vs = packed.split(32, dim=-1)
    out = faithful_attention(qs, ks, vs, None, num_heads=4, causal=True)
    assert bits_equal(out, faithful_attention(q, k, v, None, num_heads=4, causal=True))


def test_fake_kernel_shapes_under_fake_tensor_mode():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q = torch.empty(4, 128, 64, dtype=torch.float16)
        mask = torch.ones(4, 128, dtype=torch.bool)
        out = torch.ops.kkdeploy_faithful.attention(q, q, q, mask, 4, True)
        assert out.shape == (4, 128, 64) and out.dtype == torch.float16
        assert out.is_contiguous()
        out2 = torch.ops.kkdeploy_faithful.attention(q, q, q, None, 2, False)
        assert out2.shape == (4, 128, 64)
        with pytest.raises(KKError, match="not divisible"):
            torch.ops.kkdeploy_faithful.attention(q, q, q, None, 3, True)


@pytest.mark.parametrize("with_mask", [False, True])
def test_opcheck(with_mask):
    config = TransformerConfig(2, 9, 32, 4, 64, 1)
    _, q, k, v = projections(config, torch.float32)
    mask = padded_mask(2, 9, padding_ratio=0.5) if with_mask else None
    torch.library.opcheck(torch.ops.kkdeploy_faithful.attention.default, (q, k, v, mask, 4, True))


def test_op_is_opaque_to_torch_compile():
    config = TransformerConfig(2, 8, 32, 4, 64, 1)
    _, q, k, v = projections(config, torch.float32)

    def f(q, k, v):
        return faithful_attention(q, k, v, None, num_heads=4, causal=True) + 0

    compiled = torch.compile(f, backend="eager", fullgraph=True)
    assert bits_equal(compiled(q, k, v), f(q, k, v))


# ------------------------------------------------------------------------------------------------
# dispatch
# ------------------------------------------------------------------------------------------------


@pytest.fixture
def triton_present(monkeypatch):
    monkeypatch.setattr(fa, "triton_available", lambda: True)
    monkeypatch.delenv(fa.PATH_ENV, raising=False)


def _remember(proof, key, chosen="cached64w4", causal=True, reason="test"):
    bh, s, dh = key
    record = proof.ProofRecord(op=fa.OP, shape=fa.proof_shape(bh, s, dh, causal), environment=fa.proof_environment("cuda"),
                               chosen=chosen, reason=reason)
    proof.remember_proof(record)
    return record


def test_dispatch_takes_the_kernel_only_where_a_proof_made_here_says_so(triton_present, proof_sandbox, monkeypatch):
    unproven = select_attention_path(128, 32, torch.float16, "cuda", batch_heads=256)
    assert unproven.kernel == "aten" and "no proof in this environment" in unproven.reason
    _remember(proof_sandbox, (256, 128, 32))
    path = select_attention_path(128, 32, torch.float16, "cuda", batch_heads=256)  # shape 1
    assert path.fused and path.launch == "cached64w4" and "(256, 128, 32)" in path.reason
    assert not select_attention_path(128, 32, torch.float16, "cuda", batch_heads=256, causal=False).fused
    assert not select_attention_path(128, 32, torch.float16, "cuda", batch_heads=512).fused  # another op shape
    # a proof that found no bit-identical launch (cuBLAS' P.V at (2, 333, 256) on the H200): the composition
    _remember(proof_sandbox, (2, 333, 256), chosen=None, reason="no launch was bit-identical on every case")
    differs = select_attention_path(333, 256, torch.float16, "cuda", batch_heads=2)
    assert differs.kernel == "aten" and "no launch was bit-identical" in differs.reason
    proof_sandbox.forget_proofs()  # a new process of the same environment finds the proof on disk
    assert select_attention_path(128, 32, torch.float16, "cuda", batch_heads=256).launch == "cached64w4"

    cpu = select_attention_path(128, 32, torch.float16, "cpu", batch_heads=256)
    assert cpu.kernel == "aten" and "cpu" in cpu.reason
    long = select_attention_path(MAX_FUSED_SEQ_LEN + 1, 32, torch.float16, "cuda", batch_heads=256)
    assert long.kernel == "aten" and "1024" in long.reason
    fp32 = select_attention_path(128, 32, torch.float32, "cuda", batch_heads=256)
    assert fp32.kernel == "aten" and "float32" in fp32.reason
    wide = select_attention_path(128, 512, torch.float16, "cuda", batch_heads=256)
    assert wide.kernel == "aten" and "head_dim" in wide.reason

    monkeypatch.setenv(fa.PATH_ENV, "aten")
    assert select_attention_path(128, 32, torch.float16, "cuda", batch_heads=256).kernel == "aten"
    monkeypatch.setenv(fa.PATH_ENV, "triton")
    forced = select_attention_path(333, 256, torch.float16, "cuda", batch_heads=2)
    assert forced.fused and "forced" in forced.reason and forced.launch == fa.DEFAULT_LAUNCH
    assert not select_attention_path(2048, 32, torch.float16, "cuda").fused  # never past 1024
    monkeypatch.setenv(fa.PATH_ENV, "fast")
    with pytest.raises(KKError, match="auto, aten or triton"):
        select_attention_path(128, 32, torch.float16, "cuda", batch_heads=256)


def test_a_proof_in_another_environment_does_not_count(triton_present, proof_sandbox, monkeypatch):
    """Another GPU (or torch, CUDA, Triton, kernel source) has its own key: the proof made elsewhere is not found."""
    _remember(proof_sandbox, (256, 128, 32))
    assert select_attention_path(128, 32, torch.float16, "cuda", batch_heads=256).fused
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "Other GPU")
    proof_sandbox._kernel_environment.cache_clear()
    assert not select_attention_path(128, 32, torch.float16, "cuda", batch_heads=256).fused


def test_dispatch_without_triton(monkeypatch):
    monkeypatch.setattr(fa, "triton_available", lambda: False)
    monkeypatch.delenv(fa.PATH_ENV, raising=False)
    path = select_attention_path(128, 32, torch.float16, "cuda", batch_heads=256)
    assert path.kernel == "aten" and "triton" in path.reason


def test_cuda_implementation_falls_back_to_the_composition():
    """The op's CUDA kernel, called with CPU tensors: the dispatch says 'aten', so the reference bits."""
    config = TransformerConfig(2, 12, 32, 4, 64, 1)
    _, q, k, v = projections(config, torch.float16)
    mask = padded_mask(2, 12)
    assert bits_equal(fa._attention_cuda(q, k, v, mask, 4, True), reference_attention(q, k, v, mask, 4, True))


def test_attention_path_for_splits_heads(triton_present):
    q = torch.empty(2, 128, 128, dtype=torch.float16)
    assert fa.attention_path_for(q, 4).kernel == "aten"  # a CPU tensor


def test_importing_the_package_does_not_import_triton():
    code = "import sys, kkdeploy.kernels; print('triton' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    assert out.stdout.strip() == "False"


# ------------------------------------------------------------------------------------------------
# errors
# ------------------------------------------------------------------------------------------------


def test_bad_inputs_are_named():
    q = torch.zeros(2, 4, 8, dtype=torch.float16)
    with pytest.raises(KKError, match="must be a torch.Tensor"):
        faithful_attention([1], q, q, num_heads=2)
    with pytest.raises(KKError, match=r"\[B, S, D\]"):
        faithful_attention(q[0], q[0], q[0], num_heads=2)
    with pytest.raises(KKError, match="one shape"):
        faithful_attention(q, q[:, :3], q, num_heads=2)
    with pytest.raises(KKError, match="one dtype"):
        faithful_attention(q, q.float(), q, num_heads=2)
    with pytest.raises(KKError, match="floating-point"):
        faithful_attention(q.long(), q.long(), q.long(), num_heads=2)
    with pytest.raises(KKError, match="not divisible"):
        faithful_attention(q, q, q, num_heads=3)
    with pytest.raises(KKError, match="positive integer"):
        faithful_attention(q, q, q, num_heads=0)
    with pytest.raises(KKError, match="positive integer"):
        faithful_attention(q, q, q, num_heads=True)
    with pytest.raises(KKError, match="causal"):
        faithful_attention(q, q, q, num_heads=2, causal=1)
    with pytest.raises(KKError, match="torch.bool"):
        faithful_attention(q, q, q, torch.ones(2, 4), num_heads=2)
    with pytest.raises(KKError, match=r"\[B, S\]"):
        faithful_attention(q, q, q, torch.ones(2, 5, dtype=torch.bool), num_heads=2)
    with pytest.raises(KKError, match="bool torch.Tensor"):
        faithful_attention(q, q, q, [[True] * 4] * 2, num_heads=2)
    # the op itself (not only the wrapper) checks too
    with pytest.raises(KKError, match="not divisible"):
        torch.ops.kkdeploy_faithful.attention(q, q, q, None, 3, True)


def test_kkerror_is_a_value_error():
    assert issubclass(KKError, ValueError)


# ------------------------------------------------------------------------------------------------
# ATen's softmax order, emulated
# ------------------------------------------------------------------------------------------------


def test_persistent_softmax_layout():
    assert fa.persistent_softmax_layout(1) == (1, 1)
    assert fa.persistent_softmax_layout(5) == (8, 1)
    assert fa.persistent_softmax_layout(17) == (32, 1)
    assert fa.persistent_softmax_layout(32) == (32, 1)
    assert fa.persistent_softmax_layout(33) == (32, 2)
    assert fa.persistent_softmax_layout(128) == (32, 4)
    assert fa.persistent_softmax_layout(1024) == (32, 32)
    assert fa.persistent_softmax_layout(2048) == (32, 64)


@pytest.mark.parametrize("s", [1, 3, 16, 31, 32, 33, 100, 128, 1024])
def test_emulated_softmax_is_a_softmax(s):
    g = torch.Generator().manual_seed(s)
    x = torch.randn(6, s, generator=g) * 4
    tail = max(1, s // 2)
    x[1, tail:] = float("-inf")  # masked tail (the row keeps at least one finite element)
    got = emulate_persistent_softmax(x)
    want = torch.softmax(x, dim=-1)
    torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-7)
    assert torch.all(got[1, tail:] == 0)


def test_emulated_softmax_follows_the_lane_order():
    """Lane t sums its elements t, t+32, ... first; the lanes then meet in the xor tree."""
    x = torch.full((1, 64), float("-inf"))
    x[0, 0], x[0, 32], x[0, 1] = 0.0, -20.0, -30.0
    e = torch.exp(torch.tensor([0.0, -20.0, -30.0]))
    lane0 = torch.tensor(0.0) + e[0] + e[1]  # lane 0: elements 0 and 32
    total = lane0 + e[2]  # ... meets lane 1 at the last butterfly step
    got = emulate_persistent_softmax(x)
    assert bits_equal(got[0, :2], torch.stack([e[0] / total, e[2] / total]))


def test_emulated_softmax_rejects_what_aten_runs_otherwise():
    with pytest.raises(KKError, match="float32"):
        emulate_persistent_softmax(torch.zeros(2, 4, dtype=torch.float16))
    with pytest.raises(KKError, match="2048"):
        emulate_persistent_softmax(torch.zeros(2, fa.MAX_PERSISTENT_SOFTMAX_LEN + 1))
    assert emulate_persistent_softmax(torch.zeros(1, 2048)).shape == (1, 2048)  # torch 2.11's header: up to 2048


def test_scale_is_the_float32_rounding_of_the_python_float():
    for dh in (8, 32, 64, 128, 256):
        want = torch.tensor(dh ** -0.5, dtype=torch.float32).item()
        assert fa.fp32_scale(dh) == want
    assert fa.fp32_scale(32) != 32 ** -0.5  # 1/sqrt(32) is not a float32


# ------------------------------------------------------------------------------------------------
# the Triton kernel's logic on the CPU (TRITON_INTERPRET=1), when Triton is importable
# ------------------------------------------------------------------------------------------------

INTERPRETER_SCRIPT = textwrap.dedent(
    """
    import json, os
    os.environ["TRITON_INTERPRET"] = "1"
    import numpy as np
    import torch
    from kkdeploy.kernels.faithful_attention import emulate_persistent_softmax
    from kkdeploy.kernels._faithful_attention_triton import kernel_lanes, triton_attention

    def np_exp(t):  # the interpreter's tl.exp is numpy's float32 exp
        return torch.from_numpy(np.exp(t.numpy()))

    g = torch.Generator().manual_seed(0)
    results = []
    for b, s, d, h, causal, padded, sub, block_m in [
        (2, 7, 16, 2, True, False, 1, 64), (2, 16, 32, 4, True, True, 1, 64),
        (2, 33, 64, 2, False, True, 1, 64), (1, 100, 32, 1, True, True, 2, 64),
        (2, 130, 64, 2, True, True, 2, 64), (1, 1, 16, 2, True, False, 1, 64),
        (1, 70, 128, 8, True, True, 1, 32), (1, 96, 32, 2, False, False, 1, 128),
        # one pass over the whole row (sub = "one"): 1, 2 and 4 lane iterations. (Its P.V is one tl.dot where the
        # three passes chain several: numpy's sums differ there; on the GPU faithful_attention_selftest.py decides.)
        (2, 128, 64, 2, True, True, "one", 64), (1, 50, 32, 2, False, True, "one", 64),
        (2, 20, 32, 4, True, True, "one", 64), (1, 97, 64, 1, True, False, "one", 32),
        (2, 128, 128, 4, True, True, 1, 16),  # bm16: the finest causal skipping
        # cached chunks (sub = "cached"): 4, 3, 2 and 1 chunks, causal and not, padded and not
        (2, 128, 128, 4, True, True, "cached", 64), (1, 80, 64, 2, False, True, "cached", 32),
        (2, 64, 32, 1, True, False, "cached", 16), (1, 20, 32, 2, True, True, "cached", 64),
    ]:
        dh = d // h
        # q.k exact in fp32 in any summation order (multiples of 1/256, |q.k| <= 64: 15 bits), so the
        # scores do not depend on numpy's GEMM order and the softmax inputs are spread out
        q, k = (torch.randint(-16, 17, (b, s, d), generator=g).half() / 16 for _ in range(2))
        v = torch.randn(b, s, d, generator=g).half()
        mask = None
        if padded:
            lengths = torch.randint(max(1, s // 2), s + 1, (b,), generator=g)
            mask = torch.arange(s)[None, :] < lengths[:, None]
        launch = {"one": dict(one_pass=True), "cached": dict(cached=True)}.get(sub, dict(sub=sub))
        out, scores, probs = triton_attention(q, k, v, mask, h, causal, debug=True, block_m=block_m, **launch)
        if sub == "cached":  # the same P.V chain as the three passes: the same bits, even under numpy
            three = triton_attention(q, k, v, mask, h, causal, block_m=block_m)
            assert torch.equal(out.view(torch.int16), three.view(torch.int16)), (b, s, d, h, causal, padded)
        # the division as a reciprocal and two fmas (Markstein): the same probabilities, so the same bits
        fast = triton_attention(q, k, v, mask, h, causal, block_m=block_m, fast_div=True, **launch)
        # the first pass's max from the raw dot products, rounded and scaled once per row: the same max
        raw = triton_attention(q, k, v, mask, h, causal, block_m=block_m, fast_div=True, raw_max=True, **launch)
        # the interior chunks without the bound and causal masks, then the edge chunks: the same scores and order
        inner = triton_attention(q, k, v, mask, h, causal, block_m=block_m, fast_div=True, raw_max=True,
                                 interior=True, **launch)
        # the second pass's exps kept in a scratch and read back by the third: the same exps, so the same bits
        # (three passes only; causal, the row block a multiple of the key chunk)
        chunk = kernel_lanes(s) * (sub if isinstance(sub, int) and kernel_lanes(s) == 32 else 1)
        cached_exps = None
        if isinstance(sub, int) and (not causal or block_m % chunk == 0):
            cached_exps = triton_attention(q, k, v, mask, h, causal, block_m=block_m, fast_div=True, raw_max=True,
                                           interior=True, ecache=True, **launch)
            # persistent: two programs walk the items, each reusing its one slot
            slotted = triton_attention(q, k, v, mask, h, causal, block_m=block_m, fast_div=True, raw_max=True,
                                       interior=True, ecache=True, ecache_slots=1, **launch)
            assert torch.equal(slotted.view(torch.int16), cached_exps.view(torch.int16)), (b, s, d, h, causal)
        qh, kh, vh = (t.view(b, s, h, dh).transpose(1, 2) for t in (q, k, v))
        ref_scores = torch.matmul(qh, kh.transpose(-2, -1)) * dh ** -0.5
        if causal:
            ref_scores = ref_scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
        if mask is not None:
            ref_scores = ref_scores.masked_fill(~mask[:, None, None, :], float("-inf"))
        ref_probs = emulate_persistent_softmax(ref_scores.float(), exp=np_exp).half()
        # P.V from the kernel's own probabilities in float64: the kernel's fp32 sum may differ by an ulp
        ctx64 = torch.matmul(probs.double(), vh.double()).transpose(1, 2).reshape(b, s, d)
        ulp = torch.finfo(torch.float16).eps * ctx64.abs().clamp_min(2 ** -14)
        results.append(dict(
            case=[b, s, d, h, causal, padded, sub, block_m],
            scores_diff=int((scores.view(torch.int16) != ref_scores.view(torch.int16)).sum()),
            probs_diff=int((probs.view(torch.int16) != ref_probs.view(torch.int16)).sum()),
            ctx_over_one_ulp=int(((out.double() - ctx64).abs() > ulp).sum()),
            finite=bool(torch.isfinite(out).all()),
            fast_div_same=bool(torch.equal(fast.view(torch.int16), out.view(torch.int16))),
            raw_max_same=bool(torch.equal(raw.view(torch.int16), fast.view(torch.int16))),
            interior_same=bool(torch.equal(inner.view(torch.int16), raw.view(torch.int16))),
            ecache_same=None if cached_exps is None else bool(torch.equal(cached_exps.view(torch.int16),
                                                                          inner.view(torch.int16))),
        ))
    # the raw max on scores that round: normal inputs at three scales (the largest saturate the exponentials)
    for b, s, d, h, causal, padded, scale in [(2, 150, 64, 2, True, True, 1.0), (1, 200, 32, 1, False, True, 4.0),
                                              (2, 130, 128, 4, True, False, 16.0)]:
        q, k = (torch.randn(b, s, d, generator=g).half() * scale for _ in range(2))
        v = torch.randn(b, s, d, generator=g).half()
        mask = (torch.arange(s)[None, :] < torch.tensor([s, s - 37])[:b, None]) if padded else None
        plain = triton_attention(q, k, v, mask, h, causal, fast_div=True)
        raw = triton_attention(q, k, v, mask, h, causal, fast_div=True, raw_max=True)
        inner = triton_attention(q, k, v, mask, h, causal, fast_div=True, raw_max=True, interior=True)
        cached_exps = triton_attention(q, k, v, mask, h, causal, fast_div=True, raw_max=True, interior=True,
                                       ecache=True)
        slotted = triton_attention(q, k, v, mask, h, causal, fast_div=True, raw_max=True, interior=True, ecache=True,
                                   ecache_slots=1)
        assert torch.equal(slotted.view(torch.int16), cached_exps.view(torch.int16)), (b, s, d, h, causal)
        results.append(dict(case=["raw max", b, s, d, h, causal, padded, scale],
                            raw_max_same=bool(torch.equal(raw.view(torch.int16), plain.view(torch.int16))),
                            interior_same=bool(torch.equal(inner.view(torch.int16), plain.view(torch.int16))),
                            ecache_same=bool(torch.equal(cached_exps.view(torch.int16), plain.view(torch.int16)))))
    # the custom op's CUDA implementation, made to take the kernel branch on CPU tensors
    import kkdeploy.kernels.faithful_attention as fa
    fa.select_attention_path = lambda *a, **k: fa.AttentionPath("triton", "test", fa.DEFAULT_LAUNCH)
    q, k, v = (torch.randn(2, 40, 64, generator=g).half() for _ in range(3))
    mask = torch.arange(40)[None, :] < torch.tensor([[40], [31]])
    via_op = fa._attention_cuda(q, k, v, mask, 4, True)
    direct = triton_attention(q, k, v, mask, 4, True)
    results.append(dict(case="cuda impl", same=bool(torch.equal(via_op.view(torch.int16), direct.view(torch.int16)))))
    print("RESULTS " + json.dumps(results))
    """
)


try:  # the probe of the exp cache's layout (run under the interpreter only)
    import triton
    import triton.language as tl

    from kkdeploy.kernels._faithful_attention_triton import _ecache_base, ecache_chunks

    @triton.jit
    def _ecache_probe(OUT, S, E_CHUNKS, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr, CAUSAL: tl.constexpr):
        pid_m = tl.program_id(0)
        pid_bh = tl.program_id(1)
        tl.store(OUT + pid_bh * tl.num_programs(0) + pid_m,
                 _ecache_base(pid_m, pid_bh, S, E_CHUNKS, BLOCK_M, CHUNK, CAUSAL))
except ImportError:  # pragma: no cover - no Triton: the interpreter tests skip
    _ecache_probe = None


def ecache_bases(seq_len: int, block_m: int, chunk: int, causal: bool, heads: int) -> torch.Tensor:
    """``_ecache_base`` of every program (row block, head) as the kernel computes it, under the interpreter."""
    blocks = -(-seq_len // block_m)
    out = torch.full((heads, blocks), -1, dtype=torch.int64)
    _ecache_probe[(blocks, heads)](out, seq_len, ecache_chunks(seq_len, block_m, chunk, causal), BLOCK_M=block_m,
                                   CHUNK=chunk, CAUSAL=causal)
    return out


ECACHE_LAYOUT_SCRIPT = textwrap.dedent(
    """
    import json
    from tests.test_faithful_attention import ecache_bases
    results = []
    for s, block_m, chunk, causal, heads in [(1024, 64, 32, True, 3), (150, 64, 32, True, 2), (130, 64, 64, True, 2),
                                              (100, 64, 32, False, 2), (33, 64, 32, False, 1), (1000, 128, 64, True, 2),
                                              (64, 64, 32, True, 2)]:
        results.append(dict(case=[s, block_m, chunk, causal, heads],
                            bases=ecache_bases(s, block_m, chunk, causal, heads).tolist()))
    print("RESULTS " + json.dumps(results))
    """
)


LAUNCH_TABLE_SCRIPT = textwrap.dedent(
    """
    import json
    import torch
    from kkdeploy.kernels import faithful_attention as fa
    g = torch.Generator().manual_seed(3)
    b, s, d, h = 2, 128, 64, 2
    q, k = (torch.randint(-16, 17, (b, s, d), generator=g).half() / 16 for _ in range(2))
    v = torch.randn(b, s, d, generator=g).half()
    mask = torch.arange(s)[None, :] < torch.tensor([[s], [s - 45]])
    # the P.V chain is a dot per key chunk: one of 64 keys (sub 2) sums in another order under numpy than two of 32
    base = {sub: fa.run_launch(q, k, v, mask, h, True, name).view(torch.int16)
            for sub, name in ((1, "bm64"), (2, "bm64x2"))}
    results = {name: bool(torch.equal(fa.run_launch(q, k, v, mask, h, True, name).view(torch.int16),
                                      base[opts.get("sub", 1)]))
               for name, opts in fa.LAUNCHES.items() if name != "onepass"}
    print("RESULTS " + json.dumps([results]))
    """
)


def test_every_launch_of_the_table_runs_and_gives_the_same_bits():
    """Under the interpreter every launch of LAUNCHES, with its table options as a proof passes them (the exp cache,
    its persistent slots, the cached launch's interior chunks and register cap among them), gives bm64's bits on a
    causal padded case of S = 128, where every launch fits; the launches of 64-key chunks give bm64x2's. (The
    one-pass launch's single P.V dot sums in another order under numpy: the GPU proof decides it.)"""
    results = run_interpreter_script(LAUNCH_TABLE_SCRIPT)[0]
    from kkdeploy.kernels import faithful_attention as fa

    assert set(results) == set(fa.LAUNCHES) - {"onepass"}
    assert all(results.values()), {name: same for name, same in results.items() if not same}


def test_each_program_keeps_its_exps_in_tiles_of_its_own():
    """``ecache``'s scratch: the tiles of every program (row block, head), as the kernel's ``_ecache_base`` places
    them, are disjoint and inside the scratch ``ecache_chunks`` sizes. A program visits the key chunks below
    min(S, its last row + 1) where causal, below S otherwise (the chunks its second pass stores)."""
    from kkdeploy.kernels._faithful_attention_triton import ecache_chunks

    for result in run_interpreter_script(ECACHE_LAYOUT_SCRIPT):
        s, block_m, chunk, causal, heads = result["case"]
        tile = block_m * chunk
        total = heads * ecache_chunks(s, block_m, chunk, causal) * tile
        spans = []
        for head, bases in enumerate(result["bases"]):
            for block, base in enumerate(bases):
                keys = min(s, (block + 1) * block_m) if causal else s
                spans.append((base, base + -(-keys // chunk) * tile))
        spans.sort()
        assert spans[0][0] == 0 and spans[-1][1] <= total, (result["case"], spans[-1], total)
        assert all(end <= nxt for (_, end), (nxt, _) in zip(spans, spans[1:])), result["case"]
        assert total - spans[-1][1] < heads * tile * (block_m // chunk + 1), result["case"]  # no scratch to spare


def test_ecache_refuses_what_it_cannot_hold():
    """One-line refusals: a causal row block that is not a whole number of key chunks, and a scratch above
    ECACHE_MAX_BYTES (shape 14's rows: the proof records the launch as an error and proves the others)."""
    from kkdeploy.kernels import _faithful_attention_triton as fat

    with pytest.raises(KKError, match="multiple of the key chunk"):
        fat.ecache_chunks(128, 16, 32, True)
    assert fat.ecache_chunks(1024, 64, 32, True) == 2 * 16 * 17 // 2
    assert fat.ecache_chunks(100, 64, 32, False) == 2 * 4
    q = torch.zeros(1, 1024, 128, dtype=torch.float16)
    with pytest.raises(KKError, match="GiB of scratch"):
        fat.triton_attention(q.expand(4096, 1024, 128), q.expand(4096, 1024, 128), q.expand(4096, 1024, 128), None,
                             16, True, validate=False, fast_div=True, raw_max=True, interior=True, ecache=True)


def test_triton_kernel_logic_under_the_interpreter():
    results = run_interpreter_script(INTERPRETER_SCRIPT)
    assert results[-1] == {"case": "cuda impl", "same": True}
    results, raw_max = results[:-4], results[-4:-1]
    assert len(results) == 17 and all(r["raw_max_same"] and r["interior_same"] and r["ecache_same"]
                                      for r in raw_max), raw_max
    assert sum(r["ecache_same"] is not None for r in results) >= 8, results
    for r in results:
        assert r["raw_max_same"] and r["interior_same"] and r["ecache_same"] in (None, True), r
        assert r["scores_diff"] == 0, r
        assert r["probs_diff"] == 0, r
        assert r["ctx_over_one_ulp"] == 0, r
        assert r["finite"], r
        assert r["fast_div_same"], r


def test_the_fast_division_is_the_correctly_rounded_quotient():
    """``fast_div``'s arithmetic (kkdeploy/kernels/_faithful_attention_triton.py, ``_pv_chunk``) in exact rationals:
    y = RN(1/sum), q = RN(e*y), r = RN(e - q*sum) (an fma), p = RN(q + r*y) (an fma) equals RN(e/sum) for the
    softmax's operands: e = exp(s - max) in (0, 1] (down to float32's normal range), sum in [1, 1024]."""
    from fractions import Fraction

    rng = np.random.default_rng(11)
    for i in range(20000):
        kind = i % 4
        e = np.float32([rng.random(), np.exp(-rng.random() * 80), 1.0, rng.random() * 1e-3][kind])
        total = np.float32(1 + rng.random() * 1023) if i % 3 else np.float32(rng.integers(1, 1025))
        y = np.float32(np.float32(1.0) / total)
        q = np.float32(e * y)
        r = round_to_float32(Fraction(float(e)) - Fraction(float(total)) * Fraction(float(q)))
        p = round_to_float32(Fraction(float(q)) + Fraction(r) * Fraction(float(y)))
        assert p == float(np.float32(e / total)), (e, total)


def test_a_build_proves_the_64_row_launches_that_fit():
    """Short rows (<= 128): the register-cached launches and bm64; longer rows: the streaming ones. None of the
    32- and 16-row tiles (other MMA instructions) costs a build a compile."""
    assert fa.proof_launches(128) == ["cached64w4_mdiv", "cached64w4", "bm64"]
    assert fa.proof_launches(1024) == ["bm64_mdiv_interior", "bm64_mdiv_rawmax", "bm64_mdiv", "bm64", "bm128x2"]
    for s in (1, 17, 128, 129, 1024):
        assert all(fa.launch_fits(n, s) and n in fa.LAUNCHES for n in fa.proof_launches(s))
        assert not any(fa.LAUNCHES[n].get("block_m", 64) < 64 for n in fa.proof_launches(s))


def test_the_self_test_is_the_builds_proof_step(capsys):
    """scripts/faithful_attention_selftest.py is kernel_selftest.py for the attention, whose --all-launches tries
    every launch of LAUNCHES (the proof step keeps those that fit the rows)."""
    script = load_script("kernel_selftest")
    assert script.all_launches()["attention"] == list(fa.LAUNCHES)
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the script would run")
    assert load_script("faithful_attention_selftest").main(["--out", "/dev/null", "--shapes", "3"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_the_raw_max_takes_the_roundings_out_of_the_first_pass_on_sm90():
    """Compiled here for sm_90a (``scripts/offline_ptx.py --loops``): the first pass's loop body of ``bm64_mdiv_rawmax``
    loses the per-score roundings (its conversions) and instructions; the two later passes are unchanged."""
    pytest.importorskip("triton")
    script = load_script("offline_ptx")
    values = {**script.KERNELS["attention"][3], "FAST_DIV": True}
    plain = script.loop_counts(script.compile_ptx("attention", values, 4, 3))
    raw = script.loop_counts(script.compile_ptx("attention", {**values, "RAW_MAX": True}, 4, 3))
    assert len(plain) == len(raw) == 3 and plain[1:] == raw[1:]
    assert raw[0][0] < plain[0][0] and raw[0][1] * 10 < plain[0][1]


def test_the_interior_chunks_halve_the_integer_and_select_work_on_sm90(tmp_path):
    """Compiled here for sm_90a and disassembled (``scripts/offline_ptx.py --sass``): ``bm64_mdiv_interior`` runs
    each pass twice, interior chunks then edge chunks. The edge loops are the raw-max launch's own loops (the same
    pipe mix), and each interior loop issues at most 60% of their integer/compare/select (ALU) instructions: the
    pipe ncu found binding on shape 13 (ALU 63%, FMA 39% on an H100)."""
    pytest.importorskip("triton")
    import triton

    script = load_script("offline_ptx")
    bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    if not (bin_dir / "ptxas").is_file() or not (bin_dir / "cuobjdump").is_file():
        pytest.skip("this Triton has no bundled ptxas/cuobjdump")
    values = {**script.KERNELS["attention"][3], "FAST_DIV": True, "RAW_MAX": True}

    def loops(interior: bool) -> list[dict]:
        ptx = tmp_path / f"k{int(interior)}.ptx"
        ptx.write_text(script.compile_ptx("attention", {**values, "INTERIOR": interior}, 4, 3))
        cubin = tmp_path / f"k{int(interior)}.cubin"
        subprocess.run([str(bin_dir / "ptxas"), "-arch=sm_90a", str(ptx), "-o", str(cubin)], check=True)
        return script.sass_loops(cubin, bin_dir / "cuobjdump")

    plain, split = loops(False), loops(True)
    assert len(plain) == 3 and len(split) == 6
    for k in range(3):
        interior, edge = split[2 * k], split[2 * k + 1]
        assert interior["xu"] == plain[k]["xu"] and interior["tensor"] == plain[k]["tensor"]  # the same arithmetic
        assert abs(edge["alu"] - plain[k]["alu"]) <= 0.1 * plain[k]["alu"]
        assert interior["alu"] <= 0.6 * plain[k]["alu"], (k, interior, plain[k])
