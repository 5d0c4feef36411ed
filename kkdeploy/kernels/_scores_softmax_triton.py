"""Triton kernels behind the long-row attention softmax without stored scores (imported lazily: it imports triton).

The reference's causal attention over rows longer than 1024 keys (shape 14) computes, per query row,
``p = fp16(softmax(float(fp16(fp16(q.k) * scale) masked)))`` in ATen's block-softmax order, then ``p @ v``
(``kkdeploy.kernels.block_softmax``: one logical block of 1024 threads per row; thread t folds the 4-wide vectors
t, t + 1024, ... in order, then the row's last ``tail`` elements one at a time, then cuda_utils::BlockReduce).
The CUDA kernel in ``csrc/block_softmax.cu`` reproduces that order from the raw fp16 Q.K^T, which a cuBLAS GEMM
writes to memory and the kernel reads three times. These kernels recompute the scores from q and k instead
(``tl.dot`` with fp32 accumulation rounded to fp16, as the GEMM rounds: K = head_dim), so the raw scores never
reach memory. Three launches per tile:

1. ``_raw_max_kernel``: each program takes a share of the key chunks of BLOCK_M rows and writes their max raw
   score (order-free: the score map raw -> fp16(fp16(raw) * scale) is monotone for scale > 0, and so is the
   rounding of the fp32 accumulator to fp16, which is therefore applied once, to the max).
2. ``_warp_sums_kernel``: program ``c`` is ATen's warp c (threads 32c .. 32c + 31), whose threads own keys
   4096 i + 128 c + 4 l + j: it adds ``expf(s - max)`` per thread in ATen's element order (j, then i, then the
   scalar tail), then runs the warp's shuffle-down tree. Warps are independent until BlockReduce, so the 32 warps
   of a row run in 32 programs.
3. ``_probs_kernel``: BlockReduce's second tree over the 32 warp sums, then ``p = fp16(expf(s - max) / sum)``
   (IEEE division, or Markstein's reciprocal-and-two-fmas, each proven before it runs). It stores the
   probabilities for cuBLAS's ``p @ v`` or, with ``FUSE_PV``, chains ``tl.dot(p, v)`` over the keys in order
   (bit-identical to cuBLAS only where a proof says so).

Compiled with ``enable_fp_fusion=False`` and ``enable_reflect_ftz=False`` (as ``_faithful_attention_triton``):
libdevice's accurate ``expf`` without flush-to-zero, no mul+add contraction. Under ``TRITON_INTERPRET=1`` (CPU)
the kernels use ``tl.exp`` so their logic can be checked against ``block_softmax.emulate_block_softmax``.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kkdeploy.errors import KKError

from ._faithful_attention_triton import COMPILE_FLAGS, _exp, _row_sum

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

THREADS = 1024  # ATen's block for rows of 1024 elements or more
WARPS = THREADS // 32
VEC = 4
BLOCK_KEYS = THREADS * VEC  # one pass of the block over its vectors


@triton.jit
def _row_bounds(pid_bh, m0, T, first_query, row_len, LENGTHS, H, BLOCK_M: tl.constexpr, CAUSAL: tl.constexpr,
                HAS_LEN: tl.constexpr):
    """Rows m0 .. m0 + BLOCK_M of head pid_bh: their tile positions, flat row indices and visible key counts."""
    offs_m = m0 + tl.arange(0, BLOCK_M)
    row_ok = offs_m < T
    if CAUSAL:
        visible = tl.minimum(first_query + offs_m + 1, row_len)
    else:
        visible = tl.zeros((BLOCK_M, ), tl.int64) + row_len
    if HAS_LEN:
        valid = tl.load(LENGTHS + pid_bh // H)
        visible = tl.minimum(visible, valid)
    visible = tl.where(row_ok, visible, 0)
    rows = pid_bh.to(tl.int64) * T + offs_m
    return offs_m, row_ok, visible, rows


@triton.jit
def _scores(q, K, k_base, stride_ks, offs_n, offs_d, width, visible, scale, HEAD_DIM: tl.constexpr,
            SCALE_F16: tl.constexpr = False):
    """The reference's float32 softmax input: fp16(fp16(raw) * scale), -inf at keys a row cannot see.
    ``SCALE_F16`` (the scale is a float16 value, e.g. 0.125 for head_dim 64): the product of two float16 values is
    exact in float32, so fp16(fp32 product) is the correctly rounded float16 product, one fp16 multiply."""
    kmask = (offs_n[:, None] < width) & (offs_d[None, :] < HEAD_DIM)
    k = tl.load(K + k_base + offs_n[:, None].to(tl.int64) * stride_ks + offs_d[None, :], mask=kmask, other=0.0)
    raw = tl.dot(q, tl.trans(k)).to(tl.float16)
    if SCALE_F16:
        s = (raw * tl.cast(scale, tl.float16)).to(tl.float32)
    else:
        s = (raw.to(tl.float32) * scale).to(tl.float16).to(tl.float32)
    return tl.where(offs_n[None, :] < visible[:, None], s, float("-inf"))


@triton.jit
def _row_max(MAXP, rows, row_ok, n_rows, NSPLIT: tl.constexpr, scale):
    """The row max as ATen's softmax sees it: max(-FLT_MAX, score of the largest raw value)."""
    raw_max = tl.load(MAXP + rows, mask=row_ok, other=float("-inf"))
    for sp in range(1, NSPLIT):
        raw_max = tl.maximum(raw_max, tl.load(MAXP + sp * n_rows + rows, mask=row_ok, other=float("-inf")))
    top = (raw_max * scale).to(tl.float16).to(tl.float32)
    return tl.maximum(top, -3.4028234663852886E38)


@triton.jit
def _load_q(Q, pid_bh, H, offs_m, row_ok, offs_d, stride_qb, stride_qh, stride_qs, HEAD_DIM: tl.constexpr):
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    ptrs = Q + b * stride_qb + h * stride_qh + offs_m[:, None].to(tl.int64) * stride_qs + offs_d[None, :]
    return tl.load(ptrs, mask=row_ok[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)


@triton.jit
def _head_base(pid_bh, H, stride_b, stride_h):
    return (pid_bh // H).to(tl.int64) * stride_b + (pid_bh % H).to(tl.int64) * stride_h


@triton.jit
def _program_rows(Q, LENGTHS, pid_m, pid_bh, T, H, first_query, row_len, stride_qb, stride_qh, stride_qs, stride_kb,
                  stride_kh, HEAD_DIM: tl.constexpr, DH_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
                  CAUSAL: tl.constexpr, HAS_LEN: tl.constexpr):
    """A program's rows (``_row_bounds``), its queries [BLOCK_M, DH_PAD] and the offset of its head's keys."""
    offs_m, row_ok, visible, rows = _row_bounds(pid_bh, pid_m * BLOCK_M, T, first_query, row_len, LENGTHS, H,
                                                BLOCK_M, CAUSAL, HAS_LEN)
    offs_d = tl.arange(0, DH_PAD)
    q = _load_q(Q, pid_bh, H, offs_m, row_ok, offs_d, stride_qb, stride_qh, stride_qs, HEAD_DIM)
    return offs_m, row_ok, visible, rows, offs_d, q, _head_base(pid_bh, H, stride_kb, stride_kh)


@triton.jit
def _raw_max_kernel(Q, K, MAXP, LENGTHS,
                    stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks,
                    T, H, width, row_len, first_query, n_rows,
                    HEAD_DIM: tl.constexpr, DH_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    NSPLIT: tl.constexpr, CAUSAL: tl.constexpr, HAS_LEN: tl.constexpr):
    pid_m, pid_bh, sp = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m, row_ok, visible, rows, offs_d, q, k_base = _program_rows(
        Q, LENGTHS, pid_m, pid_bh, T, H, first_query, row_len, stride_qb, stride_qh, stride_qs, stride_kb, stride_kh,
        HEAD_DIM, DH_PAD, BLOCK_M, CAUSAL, HAS_LEN)
    n_end = tl.max(visible, axis=0)
    run = tl.full((BLOCK_M, BLOCK_N), float("-inf"), tl.float32)
    for n0 in range(sp * BLOCK_N, n_end, NSPLIT * BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        kmask = (offs_n[:, None] < width) & (offs_d[None, :] < HEAD_DIM)
        k = tl.load(K + k_base + offs_n[:, None].to(tl.int64) * stride_ks + offs_d[None, :], mask=kmask, other=0.0)
        acc = tl.dot(q, tl.trans(k))  # fp32: rounding to fp16 is monotone, so it is applied once, to the max
        run = tl.maximum(run, tl.where(offs_n[None, :] < visible[:, None], acc, float("-inf")))
    raw_max = tl.max(run, axis=1).to(tl.float16).to(tl.float32)  # max of the rounded = rounding of the max
    tl.store(MAXP + sp * n_rows + rows, raw_max, mask=row_ok)


@triton.jit
def _warp_sums_kernel(Q, K, MAXP, WSUM, LENGTHS,
                      stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks,
                      T, H, width, row_len, main_end, first_query, n_rows, scale,
                      HEAD_DIM: tl.constexpr, DH_PAD: tl.constexpr, BLOCK_M: tl.constexpr, NSPLIT: tl.constexpr,
                      GROUP: tl.constexpr, CAUSAL: tl.constexpr, HAS_LEN: tl.constexpr, ACCURATE: tl.constexpr,
                      STRIDED: tl.constexpr = False, SCALE_F16: tl.constexpr = False):
    """Program ``pid`` holds ATen's warps c0 .. c0 + GROUP - 1 (c0 = pid * GROUP) of BLOCK_M rows: lane column
    32 (c - c0) + l is thread 32 c + l, which owns keys 4096 i + 128 c + 4 l + j."""
    pid_m, pid_bh, pid_c = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m, row_ok, visible, rows, offs_d, q, k_base = _program_rows(
        Q, LENGTHS, pid_m, pid_bh, T, H, first_query, row_len, stride_qb, stride_qh, stride_qs, stride_kb, stride_kh,
        HEAD_DIM, DH_PAD, BLOCK_M, CAUSAL, HAS_LEN)
    row_max = _row_max(MAXP, rows, row_ok, n_rows, NSPLIT, scale)
    n_end = tl.max(visible, axis=0)
    c0 = pid_c * GROUP
    lane = tl.zeros((BLOCK_M, 32 * GROUP), tl.float32)
    # the vectors: added j = 0..3 for one i, then the next i
    for n0 in range(c0 * 128, tl.minimum(n_end, main_end), 4096):
        if STRIDED:  # one [rows, threads] score tile per j: keys n0 + 4 t + j (no regrouping of a wide tile)
            first = n0 + 4 * tl.arange(0, 32 * GROUP)
            for j in tl.static_range(4):
                s = _scores(q, K, k_base, stride_ks, first + j, offs_d, width, visible, scale, HEAD_DIM, SCALE_F16)
                lane = lane + _exp(s - row_max[:, None], ACCURATE)
        else:
            offs_n = n0 + tl.arange(0, 128 * GROUP)
            s = _scores(q, K, k_base, stride_ks, offs_n, offs_d, width, visible, scale, HEAD_DIM, SCALE_F16)
            e = _exp(s - row_max[:, None], ACCURATE)
            x = tl.reshape(e, (BLOCK_M, 32 * GROUP, 2, 2))  # [rows, thread, j // 2, j % 2]
            even, odd = tl.split(x)  # j % 2 == 0 and 1: [rows, thread, j // 2]
            e0, e2 = tl.split(even)
            e1, e3 = tl.split(odd)
            lane = lane + e0
            lane = lane + e1
            lane = lane + e2
            lane = lane + e3
    # the scalar tail: key main_end + t + 1024 k goes to thread t, in k order
    for kk in range(0, 4):
        tail0 = main_end + kk * 1024 + c0 * 32
        if tail0 < n_end:
            offs_t = tail0 + tl.arange(0, 32 * GROUP)
            s_t = _scores(q, K, k_base, stride_ks, offs_t, offs_d, width, visible, scale, HEAD_DIM, SCALE_F16)
            lane = lane + _exp(s_t - row_max[:, None], ACCURATE)
    warp_sums = tl.reshape(_row_sum(tl.reshape(lane, (BLOCK_M * GROUP, 32)), BLOCK_M * GROUP, 32), (BLOCK_M, GROUP))
    cols = c0 + tl.arange(0, GROUP)
    tl.store(WSUM + rows[:, None] * 32 + cols[None, :], warp_sums, mask=row_ok[:, None])


@triton.jit
def _probs_kernel(Q, K, V, MAXP, WSUM, P, OUT, LENGTHS,
                  stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks,
                  stride_vb, stride_vh, stride_vs, stride_ob, stride_oh, stride_os, stride_p,
                  T, H, width, row_len, first_query, n_rows, scale,
                  HEAD_DIM: tl.constexpr, DH_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  NSPLIT: tl.constexpr, PSPLIT: tl.constexpr, CAUSAL: tl.constexpr, HAS_LEN: tl.constexpr,
                  ACCURATE: tl.constexpr, FAST_DIV: tl.constexpr, FUSE_PV: tl.constexpr,
                  SCALE_F16: tl.constexpr = False):
    pid_m, pid_bh, sp = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m, row_ok, visible, rows, offs_d, q, k_base = _program_rows(
        Q, LENGTHS, pid_m, pid_bh, T, H, first_query, row_len, stride_qb, stride_qh, stride_qs, stride_kb, stride_kh,
        HEAD_DIM, DH_PAD, BLOCK_M, CAUSAL, HAS_LEN)
    row_max = _row_max(MAXP, rows, row_ok, n_rows, NSPLIT, scale)
    # BlockReduce's second tree: warp w's sum goes to lane w of warp 0, the same shuffle-down tree
    warp_sums = tl.load(WSUM + rows[:, None] * 32 + tl.arange(0, 32)[None, :], mask=row_ok[:, None], other=0.0)
    row_sum = _row_sum(warp_sums, BLOCK_M, 32)
    row_sum = tl.where(row_ok, row_sum, 1.0)
    inverse = tl.math.div_rn(tl.full((BLOCK_M, ), 1.0, tl.float32), row_sum)
    n_end = tl.max(visible, axis=0)
    if FUSE_PV:
        v_base = _head_base(pid_bh, H, stride_vb, stride_vh)
        acc = tl.zeros((BLOCK_M, DH_PAD), tl.float32)
        for n0 in range(0, n_end, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            s = _scores(q, K, k_base, stride_ks, offs_n, offs_d, width, visible, scale, HEAD_DIM, SCALE_F16)
            e = _exp(s - row_max[:, None], ACCURATE)
            if FAST_DIV:
                quo = e * inverse[:, None]
                p = tl.fma(tl.fma(-quo, row_sum[:, None], e), inverse[:, None], quo).to(tl.float16)
            else:
                p = tl.math.div_rn(e, row_sum[:, None]).to(tl.float16)
            vmask = (offs_n[:, None] < width) & (offs_d[None, :] < HEAD_DIM)
            v = tl.load(V + v_base + offs_n[:, None].to(tl.int64) * stride_vs + offs_d[None, :], mask=vmask,
                        other=0.0)
            acc = tl.dot(p, v, acc)
        o_base = _head_base(pid_bh, H, stride_ob, stride_oh)
        o_ptrs = OUT + o_base + offs_m[:, None].to(tl.int64) * stride_os + offs_d[None, :]
        tl.store(o_ptrs, acc.to(tl.float16), mask=row_ok[:, None] & (offs_d[None, :] < HEAD_DIM))
    else:
        for n0 in range(sp * BLOCK_N, width, PSPLIT * BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            if n0 < n_end:
                s = _scores(q, K, k_base, stride_ks, offs_n, offs_d, width, visible, scale, HEAD_DIM, SCALE_F16)
                e = _exp(s - row_max[:, None], ACCURATE)
                if FAST_DIV:
                    quo = e * inverse[:, None]
                    p = tl.fma(tl.fma(-quo, row_sum[:, None], e), inverse[:, None], quo).to(tl.float16)
                else:
                    p = tl.math.div_rn(e, row_sum[:, None]).to(tl.float16)
            else:
                p = tl.zeros((BLOCK_M, BLOCK_N), tl.float16)
            ptrs = P + rows[:, None] * stride_p + offs_n[None, :]
            tl.store(ptrs, p, mask=row_ok[:, None] & (offs_n[None, :] < width))


def _heads_view(x: torch.Tensor, name: str) -> torch.Tensor:
    if x.dim() != 4 or x.dtype != torch.float16:
        raise KKError(f"scores_softmax: {name} must be [b, H, rows, head_dim] float16, got {tuple(x.shape)} {x.dtype}")
    return x if x.stride(-1) == 1 else x.contiguous()


def scores_softmax(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None, scale: float, row_len: int, tail: int,
                   first_query: int, causal: bool = True, lengths: torch.Tensor | None = None, *,
                   fast_div: bool = True, fuse_pv: bool = False, block_m: int = 64, block_n: int = 128,
                   nsplit: int = 8, psplit: int = 8, group: int = 1, num_warps: int = 4,
                   num_stages: int | None = None, max_launch: dict | None = None, sum_launch: dict | None = None,
                   prob_launch: dict | None = None, strided: bool = False, scale_f16: bool | None = None,
                   stats: bool = False):
    """Probabilities [b*H*T, width] fp16 of a causal tile, or with ``fuse_pv`` the context [b, H, T, Dh].

    q [b, H, T, Dh] holds queries first_query .. first_query + T; k (and v) [b, H, width, Dh] the keys the tile
    stores (every visible key lies below ``width``); ``row_len`` the logical row length of ATen's softmax (the
    reference's whole key row) and ``tail`` its scalar tail (``block_softmax.block_softmax_layout``); ``lengths``
    [b] each sequence's valid-prefix length (padded calls). The result equals the raw-GEMM path
    ``causal_block_softmax(q @ k^T, ...)`` where a proof found it bit-identical. ``block_m``, ``block_n``,
    ``num_warps``, ``num_stages`` configure the three kernels; ``max_launch``, ``sum_launch``, ``prob_launch``
    override them per kernel (rows are independent, so each kernel may tile them its own way). ``stats``: also the
    row sums [b*H*T] (for the CPU tests of the order). ``strided``: the sum pass scores one [rows, threads] tile
    per vector element j instead of regrouping a wide tile. ``scale_f16`` (default: whenever the float32 scale is a
    float16 value): scale the fp16 scores with one fp16 multiply."""
    q, k = _heads_view(q, "q"), _heads_view(k, "k")
    b, heads, T, dh = q.shape
    width = k.shape[2]
    if k.shape[:2] != (b, heads) or k.shape[3] != dh:
        raise KKError(f"scores_softmax: k {tuple(k.shape)} does not match q {tuple(q.shape)}")
    if not (row_len > 1024 and 0 <= tail < BLOCK_KEYS and (row_len - tail) % BLOCK_KEYS == 0 and scale > 0):
        raise KKError(f"scores_softmax: rows of {row_len} keys with tail {tail} are not ATen's regular block softmax")
    if dh > 256 or dh < 16:
        raise KKError(f"scores_softmax: head_dim {dh} outside 16..256")
    dh_pad = max(16, 1 << (dh - 1).bit_length())
    n_rows = b * heads * T
    device = q.device
    maxp = torch.empty((nsplit, n_rows), dtype=torch.float32, device=device)
    wsum = torch.empty((n_rows, 32), dtype=torch.float32, device=device)
    has_len = lengths is not None
    lens = lengths.to(device=device, dtype=torch.int64).contiguous() if has_len else maxp
    base = dict(block_m=block_m, block_n=block_n, num_warps=num_warps, num_stages=num_stages)

    def config(override):
        cfg = dict(base, **(override or {}))
        launch = dict(num_warps=cfg["num_warps"])
        if cfg["num_stages"] is not None:
            launch["num_stages"] = cfg["num_stages"]
        if not INTERPRET:
            launch.update(COMPILE_FLAGS)
        return cfg["block_m"], cfg["block_n"], launch

    qs = (q.stride(0), q.stride(1), q.stride(2))
    ks = (k.stride(0), k.stride(1), k.stride(2))
    common = dict(HEAD_DIM=dh, DH_PAD=dh_pad, CAUSAL=bool(causal), HAS_LEN=has_len)
    scale32 = torch.tensor(float(scale), dtype=torch.float32)
    if scale_f16 is None:
        scale_f16 = bool(scale32.half().float() == scale32)
    elif scale_f16 and not bool(scale32.half().float() == scale32):
        raise KKError(f"scores_softmax: scale {scale} is not a float16 value; scale_f16 would change the scores")
    bm, bn, launch = config(max_launch)
    _raw_max_kernel[(triton.cdiv(T, bm), b * heads, nsplit)](
        q, k, maxp, lens, *qs, *ks, T, heads, width, row_len, first_query, n_rows,
        BLOCK_M=bm, BLOCK_N=bn, NSPLIT=nsplit, **common, **launch)
    if group not in (1, 2, 4, 8):
        raise KKError(f"scores_softmax: group must be 1, 2, 4 or 8 warps per program, got {group}")
    bm, _, launch = config(sum_launch)
    _warp_sums_kernel[(triton.cdiv(T, bm), b * heads, WARPS // group)](
        q, k, maxp, wsum, lens, *qs, *ks, T, heads, width, row_len, row_len - tail, first_query, n_rows,
        float(scale), BLOCK_M=bm, NSPLIT=nsplit, GROUP=group, ACCURATE=not INTERPRET, STRIDED=bool(strided),
        SCALE_F16=scale_f16, **common, **launch)
    bm, bn, launch = config(prob_launch)
    m_blocks = triton.cdiv(T, bm)
    if fuse_pv:
        v = _heads_view(v, "v")
        out = torch.empty((b, heads, T, dh), dtype=q.dtype, device=device)
        probs, stride_p, grid = out, 0, (m_blocks, b * heads, 1)
        vs = (v.stride(0), v.stride(1), v.stride(2))
        os_ = (out.stride(0), out.stride(1), out.stride(2))
    else:
        probs = torch.empty((n_rows, width), dtype=q.dtype, device=device)
        out, stride_p, grid = probs, probs.stride(0), (m_blocks, b * heads, psplit)
        vs = os_ = (0, 0, 0)
        v = q
    _probs_kernel[grid](
        q, k, v, maxp, wsum, probs, out, lens, *qs, *ks, *vs, *os_, stride_p,
        T, heads, width, row_len, first_query, n_rows, float(scale),
        BLOCK_M=bm, BLOCK_N=bn, NSPLIT=nsplit, PSPLIT=psplit, ACCURATE=not INTERPRET, FAST_DIV=bool(fast_div),
        FUSE_PV=bool(fuse_pv), SCALE_F16=scale_f16, **common, **launch)
    result = out if fuse_pv else probs
    if stats:  # the row sums in ATen's order (BlockReduce's second tree, as _probs_kernel runs it)
        from .block_softmax import _tree

        return result, _tree(wsum)
    return result
