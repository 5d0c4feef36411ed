"""The attention with its Q, K and V projections in the same launch (``triton_qkv_attention``).

Why: on the launch-bound shapes (S <= 128, D <= 128) a block runs its packed Q|K|V GEMM as a launch of its own
before the attention, one of the five launches per block whose latencies add up one after another (shape 3: 21
launches, 91 µs, of which about 28 µs is the graph's launch floor). On shape 6 the Q|K|V GEMM writes 983 MB per
block that the attention reads back (0.78 ms a block by the proof's timing, of about 3.5). Here each program
(64 query rows of one head) computes what it needs of Q, K and V itself, from the block's normalized rows:

* q of its 64 rows, and k and v of the keys it needs, 64 keys at a time (the causal limit of the row block), each
  exactly as the proven GEMM tile computes it (``_fused_linear_triton._linear_tile``): ``tl.dot`` over D in steps
  of BLOCK_K = min(64, next_pow2(D)) on one float32 accumulator, the bias added to it, one rounding to float16.
  Only the tile's width differs (the head's Dh columns instead of 64 or 128): each output element is its own
  k16 chain of the same products, so the width should not change its bits; the GPU decides (on an H100 it did
  not, session 43: ``scripts/qkv_attention_study.py``), and a build proves it (``qkv_attention``);
* then the arithmetic of the register-cached attention launch (``cached64w4_mdiv``: ``_attention_tile`` with
  NCACHED chunks of 32 keys) on those tiles, in its order: each 32-key chunk's scores from its own dot of q with the
  chunk's K rows (the cached launch's wgmma tile); the same masks, max, exps, lane sums, butterfly, probabilities;
  P.V chained chunk by chunk on the float32 accumulator.

K and V are computed once per row block that needs them (twice for the second row block's first 64 keys at
S = 128): tensor-core work, which the launch-bound shapes have to spare. Where rows outgrow the launch count
(shape 6) that work is not spare, and the ``pair`` form runs one program per head instead: every row's q, k and v
projected once, from one load of the rows, then both row blocks attended in turn (1.30 ms a block on shape 6 on an
H100, against 1.74 for the two launches and 1.91 for one program per row block; session 44). Rows 17..128 (ATen's
WARP of 32 lanes).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kkdeploy.errors import KKError

from ._faithful_attention_triton import (COMPILE_FLAGS, INTERPRET, _edge_masked, _exp, _key_valid, _lane_add,
                                         _probabilities, _row_sum, _scaled)
from .dependent_launch import launch_options
from .faithful_attention import fp32_scale
from .precompile import launch as launch_kernel
from .qkv_attention import qkv_attention_refusal

#: query rows per program (wgmma's 64-row tiles)
BLOCK_M = 64


@triton.jit
def _project(X, x_row0, stride_xs, rows, S, W, B, col0, stride_w, D,
             HEAD_DIM: tl.constexpr, DH_PAD: tl.constexpr, BLOCK_K: tl.constexpr):
    """fp16(X[rows] . W[col0 : col0 + HEAD_DIM]^T + B[col0 : col0 + HEAD_DIM]) as [len(rows), DH_PAD] (columns past
    HEAD_DIM hold 0): the proven GEMM tile's arithmetic, D in order in steps of BLOCK_K on one float32
    accumulator, the bias inside it, one rounding. Rows at or past S read zeros (they come out as the bias)."""
    ROWS: tl.constexpr = rows.shape[0]
    offs_d = tl.arange(0, DH_PAD)
    offs_k = tl.arange(0, BLOCK_K)
    row_ok = rows < S
    col_ok = offs_d < HEAD_DIM
    acc = tl.zeros((ROWS, DH_PAD), dtype=tl.float32)
    for k0 in range(0, D, BLOCK_K):  # K in order, one accumulator
        kk = k0 + offs_k
        a = tl.load(X + x_row0 + rows[:, None] * stride_xs + kk[None, :], mask=row_ok[:, None] & (kk[None, :] < D),
                    other=0.0)
        w = tl.load(W + (col0 + offs_d)[:, None] * stride_w + kk[None, :], mask=col_ok[:, None] & (kk[None, :] < D),
                    other=0.0)
        acc = tl.dot(a, tl.trans(w), acc)
    bias = tl.load(B + col0 + offs_d, mask=col_ok, other=0.0).to(tl.float32)
    return (acc + bias[None, :]).to(tl.float16)  # the bias inside the float32 accumulator, one rounding


@triton.jit
def _row_halves(t, W: tl.constexpr, COLS: tl.constexpr):
    """[2W, COLS] -> (rows 0..W-1, rows W..2W-1)."""
    return tl.split(tl.permute(tl.reshape(t, (2, W, COLS)), (1, 2, 0)))


@triton.jit
def _chunk_scores(q, k, MASK, m_row0, stride_ms, offs_m, keys, S, scale, CAUSAL: tl.constexpr,
                  HAS_MASK: tl.constexpr, km=None):
    """The scores of a 32-key chunk as ``_score_chunk`` gives them (its dot of q with the chunk's K rows, the same
    wgmma tile): rounded and scaled where the reference rounds, -inf where causal, invalid or past S. ``km``: the
    chunk's key validity already loaded (``_key_masks``), else it is loaded here, after the dot."""
    return _edge_masked(_scaled(tl.dot(q, tl.trans(k)), scale), MASK, m_row0, stride_ms, offs_m, keys, S, CAUSAL,
                        HAS_MASK, km)


@triton.jit
def _key_masks(MASK, m_row0, stride_ms, S):
    """The padding mask of keys 0 .. 127 as four 32-key chunks (``_key_valid``, as ``_edge_masked`` loads each):
    before the walk over D, so that the loads are in flight with the projections' (``EARLY_MASK``)."""
    keys = tl.arange(0, 32)
    return (_key_valid(MASK, m_row0, stride_ms, keys, S), _key_valid(MASK, m_row0, stride_ms, 32 + keys, S),
            _key_valid(MASK, m_row0, stride_ms, 64 + keys, S), _key_valid(MASK, m_row0, stride_ms, 96 + keys, S))


@triton.jit
def _key_block(X, x_row0, stride_xs, key0, S, WK, WV, BK, BV, col0, stride_w, D, q, MASK, m_row0, stride_ms, offs_m,
               scale, HEAD_DIM: tl.constexpr, DH_PAD: tl.constexpr, BLOCK_K: tl.constexpr, CAUSAL: tl.constexpr,
               HAS_MASK: tl.constexpr):
    """Keys key0 .. key0 + 63: their two chunks' scores [64, 32] and V rows [32, DH_PAD] (V's rows past S zeroed, as
    the cached launch loads them)."""
    keys = key0 + tl.arange(0, 64)
    k = _project(X, x_row0, stride_xs, keys, S, WK, BK, col0, stride_w, D, HEAD_DIM, DH_PAD, BLOCK_K)
    v = _project(X, x_row0, stride_xs, keys, S, WV, BV, col0, stride_w, D, HEAD_DIM, DH_PAD, BLOCK_K)
    v = tl.where((keys < S)[:, None], v, tl.zeros_like(v))
    s_lo, s_hi = _chunk_pair_scores(q, k, MASK, m_row0, stride_ms, offs_m, key0, S, scale, CAUSAL, HAS_MASK)
    v_lo, v_hi = _row_halves(v, 32, DH_PAD)
    return s_lo, s_hi, v_lo, v_hi


@triton.jit
def _head_biases(BQ, BK, BV, col0, offs_d, col_ok):
    """The head's q, k and v biases (columns col0 + offs_d), in float32."""
    bq = tl.load(BQ + col0 + offs_d, mask=col_ok, other=0.0).to(tl.float32)
    bk = tl.load(BK + col0 + offs_d, mask=col_ok, other=0.0).to(tl.float32)
    bv = tl.load(BV + col0 + offs_d, mask=col_ok, other=0.0).to(tl.float32)
    return bq, bk, bv


@triton.jit
def _project_whole(X, x_row0, stride_xs, offs_m, S, WQ, WK, WV, BQ, BK, BV, col0, stride_w, D,
                   NK: tl.constexpr, HEAD_DIM: tl.constexpr, DH_PAD: tl.constexpr, BLOCK_K: tl.constexpr,
                   Q_OF_KEYS: tl.constexpr = False, EARLY: tl.constexpr = False):
    """``_project`` of q (the block's rows) and of k and v (keys 0 .. NK - 1) in one walk over D: each k-step's rows
    and weights loaded together and three dots, one float32 accumulator each (each its own chain of the same
    products, in D order), so the loads of the three projections overlap instead of following one another.
    Returns q [64, DH_PAD] and k, v [NK, DH_PAD] in float16; V's rows past S zeroed. ``Q_OF_KEYS``: q of the key
    rows themselves ([NK, DH_PAD], one load of the rows for all three dots; ``offs_m`` is not read). ``EARLY``: the
    biases are loaded before the walk over D, in flight with its first loads, not after its last dot."""
    offs_d = tl.arange(0, DH_PAD)
    offs_k = tl.arange(0, BLOCK_K)
    keys = tl.arange(0, NK)
    col_ok = offs_d < HEAD_DIM
    if Q_OF_KEYS:
        acc_q = tl.zeros((NK, DH_PAD), dtype=tl.float32)
    else:
        acc_q = tl.zeros((64, DH_PAD), dtype=tl.float32)
    acc_k = tl.zeros((NK, DH_PAD), dtype=tl.float32)
    acc_v = tl.zeros((NK, DH_PAD), dtype=tl.float32)
    if EARLY:
        bq, bk, bv = _head_biases(BQ, BK, BV, col0, offs_d, col_ok)
    for k0 in range(0, D, BLOCK_K):  # K in order, one accumulator per projection
        kk = k0 + offs_k
        k_ok = kk[None, :] < D
        if Q_OF_KEYS:
            xk = tl.load(X + x_row0 + keys[:, None] * stride_xs + kk[None, :], mask=(keys < S)[:, None] & k_ok,
                         other=0.0)
            xq = xk
        else:
            xq = tl.load(X + x_row0 + offs_m[:, None] * stride_xs + kk[None, :],
                         mask=(offs_m < S)[:, None] & k_ok, other=0.0)
            xk = tl.load(X + x_row0 + keys[:, None] * stride_xs + kk[None, :], mask=(keys < S)[:, None] & k_ok,
                         other=0.0)
        w_offs = (col0 + offs_d)[:, None] * stride_w + kk[None, :]
        w_ok = col_ok[:, None] & k_ok
        wq = tl.load(WQ + w_offs, mask=w_ok, other=0.0)
        wk = tl.load(WK + w_offs, mask=w_ok, other=0.0)
        wv = tl.load(WV + w_offs, mask=w_ok, other=0.0)
        acc_q = tl.dot(xq, tl.trans(wq), acc_q)
        acc_k = tl.dot(xk, tl.trans(wk), acc_k)
        acc_v = tl.dot(xk, tl.trans(wv), acc_v)
    if not EARLY:
        bq, bk, bv = _head_biases(BQ, BK, BV, col0, offs_d, col_ok)
    q = (acc_q + bq[None, :]).to(tl.float16)
    k = (acc_k + bk[None, :]).to(tl.float16)
    v = (acc_v + bv[None, :]).to(tl.float16)
    return q, k, tl.where((keys < S)[:, None], v, tl.zeros_like(v))


@triton.jit
def _chunk_pair_scores(q, k, MASK, m_row0, stride_ms, offs_m, key0, S, scale, CAUSAL: tl.constexpr,
                       HAS_MASK: tl.constexpr, km_lo=None, km_hi=None):
    """The scores of the two 32-key chunks of keys key0 .. key0 + 63, from their K rows k [64, DH_PAD] (``km_lo``,
    ``km_hi``: their key validity already loaded)."""
    DH_PAD: tl.constexpr = k.shape[1]
    k_lo, k_hi = _row_halves(k, 32, DH_PAD)
    s_lo = _chunk_scores(q, k_lo, MASK, m_row0, stride_ms, offs_m, key0 + tl.arange(0, 32), S, scale, CAUSAL,
                         HAS_MASK, km_lo)
    s_hi = _chunk_scores(q, k_hi, MASK, m_row0, stride_ms, offs_m, key0 + 32 + tl.arange(0, 32), S, scale, CAUSAL,
                         HAS_MASK, km_hi)
    return s_lo, s_hi


@triton.jit
def _pair_pv(p_lo, p_hi, v_pair, acc):
    """acc + P.V of a chunk pair in one dot over its 64 keys: the two chunks' probabilities [64, 32] joined into
    [64, 64] (column c is the pair's key c: the low chunk's 32 first), against the pair's V rows [64, DH_PAD] as they
    were projected, not split into chunks. On the tensor cores the same k16 MMAs over the keys in order as two
    chained 32-key dots; it saves the split's trips through shared memory (``scripts/offline_ptx.py --layouts``)."""
    ROWS: tl.constexpr = p_lo.shape[0]
    p = tl.reshape(tl.permute(tl.join(p_lo, p_hi), (0, 2, 1)), (ROWS, 64))
    return tl.dot(p, v_pair, acc)


@triton.jit
def _attend(s0, s1, s2, s3, v0, v1, v2, v3, n_end, OUT, o_row0, stride_os, offs_m, col0, S,
            HEAD_DIM: tl.constexpr, DH_PAD: tl.constexpr, ACCURATE: tl.constexpr, FAST_DIV: tl.constexpr,
            PV64: tl.constexpr = False):
    """The cached launch's softmax and P.V on a row block's four chunk scores and V chunks (chunks at or past
    ``n_end`` are not read: their scores are -inf), then the context's store: ``_attention_tile``'s order.
    ``PV64``: v0 and v2 are the two chunk pairs' V rows [64, DH_PAD] (v1 and v3 are not read), and each pair with a
    scored chunk runs its P.V as one 64-key dot (``_pair_pv``). Where the pair's second chunk is unscored (a causal
    end at or below its first key, or past S), its probabilities are +0 and its V rows are finite (zeros past S), so
    its k16 steps add +0 products to the float32 accumulator. The accumulator starts at +0 and a sum of finite
    products rounds to +0, never -0, when it cancels, so adding +0 leaves every bit as it was. The cached launch
    skips those steps, and the reference's P.V over all S keys runs them; the proof checks both on the GPU."""
    CH: tl.constexpr = 32  # ATen's lanes: the softmax's chunk
    ROWS: tl.constexpr = s0.shape[0]  # 64, or 128 (``ROWS128``: both row blocks of a sequence in one tile)
    run_max = s0
    if n_end > CH:
        run_max = tl.maximum(run_max, s1)
    if n_end > 2 * CH:
        run_max = tl.maximum(run_max, s2)
    if n_end > 3 * CH:
        run_max = tl.maximum(run_max, s3)
    row_max = tl.max(run_max, axis=1)
    e0 = _exp(s0 - row_max[:, None], ACCURATE)
    lane = _lane_add(tl.zeros((ROWS, CH), tl.float32), e0, ROWS, CH, 1)
    e1 = tl.zeros((ROWS, CH), tl.float32)
    e2 = tl.zeros((ROWS, CH), tl.float32)
    e3 = tl.zeros((ROWS, CH), tl.float32)
    if n_end > CH:
        e1 = _exp(s1 - row_max[:, None], ACCURATE)
        lane = _lane_add(lane, e1, ROWS, CH, 1)
    if n_end > 2 * CH:
        e2 = _exp(s2 - row_max[:, None], ACCURATE)
        lane = _lane_add(lane, e2, ROWS, CH, 1)
    if n_end > 3 * CH:
        e3 = _exp(s3 - row_max[:, None], ACCURATE)
        lane = _lane_add(lane, e3, ROWS, CH, 1)
    row_sum = _row_sum(lane, ROWS, CH)
    if PV64:  # an unscored chunk of a pair adds +0s (its exps are 0): the accumulator, never -0, stays as it is
        acc = _pair_pv(_probabilities(e0, row_sum, FAST_DIV), _probabilities(e1, row_sum, FAST_DIV), v0,
                       tl.zeros((ROWS, DH_PAD), tl.float32))
        if n_end > 2 * CH:
            acc = _pair_pv(_probabilities(e2, row_sum, FAST_DIV), _probabilities(e3, row_sum, FAST_DIV), v2, acc)
    else:
        acc = tl.dot(_probabilities(e0, row_sum, FAST_DIV), v0, tl.zeros((ROWS, DH_PAD), tl.float32))
        if n_end > CH:
            acc = tl.dot(_probabilities(e1, row_sum, FAST_DIV), v1, acc)
        if n_end > 2 * CH:
            acc = tl.dot(_probabilities(e2, row_sum, FAST_DIV), v2, acc)
        if n_end > 3 * CH:
            acc = tl.dot(_probabilities(e3, row_sum, FAST_DIV), v3, acc)
    offs_d = tl.arange(0, DH_PAD)
    o_ptrs = OUT + o_row0 + offs_m[:, None] * stride_os + col0 + offs_d[None, :]
    tl.store(o_ptrs, acc.to(tl.float16), mask=(offs_m[:, None] < S) & (offs_d[None, :] < HEAD_DIM))


@triton.jit
def _keys_end(m0, S, CAUSAL: tl.constexpr):
    """Where row block m0's keys end: from there on every score of the block is -inf (causal), else S."""
    if CAUSAL:
        n_end = tl.minimum(S, m0 + 64)
    else:
        n_end = S
    return n_end


@triton.jit
def _unscored_chunks(DH_PAD: tl.constexpr, ROWS: tl.constexpr = 64):
    """Chunks 2 and 3 before they are scored: -inf scores and zero V rows, what a chunk past the keys holds."""
    CH: tl.constexpr = 32
    return (tl.full((ROWS, CH), float("-inf"), tl.float32), tl.full((ROWS, CH), float("-inf"), tl.float32),
            tl.zeros((CH, DH_PAD), tl.float16), tl.zeros((CH, DH_PAD), tl.float16))


@triton.jit
def _attend_tiles(q, k, v, m0, MASK, m_row0, stride_ms, S, scale, OUT, o_row0, stride_os, col0,
                  NK: tl.constexpr, HEAD_DIM: tl.constexpr, DH_PAD: tl.constexpr, CAUSAL: tl.constexpr,
                  HAS_MASK: tl.constexpr, ACCURATE: tl.constexpr, FAST_DIV: tl.constexpr,
                  km0=None, km1=None, km2=None, km3=None, PV64: tl.constexpr = False):
    """Row block m0 .. m0 + 63 from its q [64, DH_PAD] and the projected k, v of keys 0 .. NK - 1: the cached
    launch's chunks 0-3 (``_attention_tile``, NCACHED = 4), in its order and under its conditions. ``km0`` ..
    ``km3``: the chunks' key validity already loaded (``_key_masks``). ``PV64``: V stays in its 64-key pairs
    (``_attend``'s). A q of 128 rows (``ROWS128``, m0 = 0) attends both row blocks as one tile: the keys end where
    the second block's end, and the first block's rows score the second block's keys too. Those scores are -inf
    (causal), so they leave the row's max as it was, their exps are +0, the lane sums stay as they were, and their
    probabilities add +0 products to P.V: the unscored chunks' argument (``_attend``)."""
    CH: tl.constexpr = 32
    ROWS: tl.constexpr = q.shape[0]
    offs_m = m0 + tl.arange(0, ROWS)
    n_end = _keys_end(m0 + ROWS - 64, S, CAUSAL)
    s2, s3, v2, v3 = _unscored_chunks(DH_PAD, ROWS)
    if NK == 128:
        k01, k23 = _row_halves(k, 64, DH_PAD)
        v01, v23 = _row_halves(v, 64, DH_PAD)
    else:
        k01 = k
        v01 = v
    s0, s1 = _chunk_pair_scores(q, k01, MASK, m_row0, stride_ms, offs_m, 0, S, scale, CAUSAL, HAS_MASK, km0, km1)
    if not PV64:  # V split into its 32-key chunks; PV64 keeps its 64-key pairs (``_attend``)
        v0, v1 = _row_halves(v01, 32, DH_PAD)
    if NK == 128:
        if n_end > 2 * CH:
            s2, s3 = _chunk_pair_scores(q, k23, MASK, m_row0, stride_ms, offs_m, 64, S, scale, CAUSAL, HAS_MASK,
                                        km2, km3)
            if not PV64:
                v2, v3 = _row_halves(v23, 32, DH_PAD)
    if PV64:  # with 64 keys at most the second pair is not read
        v_pair1 = v01
        if NK == 128:
            v_pair1 = v23
        _attend(s0, s1, s2, s3, v01, v01, v_pair1, v_pair1, n_end, OUT, o_row0, stride_os, offs_m, col0, S, HEAD_DIM,
                DH_PAD, ACCURATE, FAST_DIV, True)
    else:
        _attend(s0, s1, s2, s3, v0, v1, v2, v3, n_end, OUT, o_row0, stride_os, offs_m, col0, S, HEAD_DIM, DH_PAD,
                ACCURATE, FAST_DIV)

@triton.jit
def _whole_block(X, x_row0, stride_xs, m0, S, WQ, WK, WV, BQ, BK, BV, col0, stride_w, D, MASK, m_row0, stride_ms,
                 scale, OUT, o_row0, stride_os, NK: tl.constexpr, HEAD_DIM: tl.constexpr, DH_PAD: tl.constexpr,
                 BLOCK_K: tl.constexpr, CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, ACCURATE: tl.constexpr,
                 FAST_DIV: tl.constexpr, EARLY: tl.constexpr = False, EARLY_MASK: tl.constexpr = False,
                 PV64: tl.constexpr = False):
    """One row block, q, k and v projected in one walk over D (k and v of keys 0 .. NK - 1), then attended.
    ``EARLY_MASK`` (with a padding mask): the keys' validity is loaded before the walk, not after the score dots.
    ``PV64``: P.V over 64 keys a dot (``_attend``)."""
    offs_m = m0 + tl.arange(0, 64)
    if EARLY_MASK and HAS_MASK:
        km0, km1, km2, km3 = _key_masks(MASK, m_row0, stride_ms, S)
    else:
        km0, km1, km2, km3 = None, None, None, None
    q, k, v = _project_whole(X, x_row0, stride_xs, offs_m, S, WQ, WK, WV, BQ, BK, BV, col0, stride_w, D, NK,
                             HEAD_DIM, DH_PAD, BLOCK_K, False, EARLY)
    _attend_tiles(q, k, v, m0, MASK, m_row0, stride_ms, S, scale, OUT, o_row0, stride_os, col0, NK, HEAD_DIM,
                  DH_PAD, CAUSAL, HAS_MASK, ACCURATE, FAST_DIV, km0, km1, km2, km3, PV64)


@triton.jit
def _qkv_attention_kernel(
    X, WQ, WK, WV, BQ, BK, BV, MASK, OUT,
    stride_xb, stride_xs, stride_w, stride_ob, stride_os, stride_mb, stride_ms,
    S, H, D, scale,
    HEAD_DIM: tl.constexpr, DH_PAD: tl.constexpr, BLOCK_K: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, ACCURATE: tl.constexpr, FAST_DIV: tl.constexpr,
    PDL: tl.constexpr = False, WHOLE: tl.constexpr = False, NK: tl.constexpr = 128, PAIR: tl.constexpr = False,
    EARLY: tl.constexpr = False, EARLY_MASK: tl.constexpr = False, PV64: tl.constexpr = False,
    ROWS128: tl.constexpr = False,
):
    """``WHOLE``: q, k and v projected in one walk over D (``_project_whole``), k and v for keys 0 .. NK - 1 (NK =
    64 or 128, the rows rounded up), whether the row block needs them all or not. ``PAIR`` (WHOLE's projections,
    one program per head): every row's q and every key's k and v from one load of the rows and one walk over D,
    then both row blocks attended one after the other, so no row is projected twice. Otherwise each projection on
    its own, keys 64 at a time as the causal limit needs them. ``EARLY`` (WHOLE and PAIR): the biases loaded before
    the walk over D (``_project_whole``); ``EARLY_MASK`` (WHOLE): the keys' validity too (``_whole_block``);
    ``PV64`` (WHOLE, or PAIR with ROWS128): P.V over 64 keys a dot (``_pair_pv``). ``ROWS128`` (PAIR): both row
    blocks attended as one 128-row tile (``_attend_tiles``), which at 8 warps gives each warpgroup one row block's
    wgmma rows, so the two blocks' softmaxes run side by side instead of one after the other."""
    if PDL:  # a dependent launch (kernels/dependent_launch.py): earlier kernels' writes first, then the next's start
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    CH: tl.constexpr = 32  # ATen's lanes: the softmax's chunk
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = pid_bh % H
    m0 = pid_m * 64
    offs_m = m0 + tl.arange(0, 64)
    col0 = h * HEAD_DIM
    x_row0 = b * stride_xb
    m_row0 = b * stride_mb
    o_row0 = b * stride_ob
    if PAIR:
        q, k, v = _project_whole(X, x_row0, stride_xs, offs_m, S, WQ, WK, WV, BQ, BK, BV, col0, stride_w, D, NK,
                                 HEAD_DIM, DH_PAD, BLOCK_K, True, EARLY)
        if NK == 128 and ROWS128:
            _attend_tiles(q, k, v, 0, MASK, m_row0, stride_ms, S, scale, OUT, o_row0, stride_os, col0, NK,
                          HEAD_DIM, DH_PAD, CAUSAL, HAS_MASK, ACCURATE, FAST_DIV, PV64=PV64)
        elif NK == 128:
            q0, q1 = _row_halves(q, 64, DH_PAD)
            _attend_tiles(q0, k, v, 0, MASK, m_row0, stride_ms, S, scale, OUT, o_row0, stride_os, col0, NK,
                          HEAD_DIM, DH_PAD, CAUSAL, HAS_MASK, ACCURATE, FAST_DIV)
            _attend_tiles(q1, k, v, 64, MASK, m_row0, stride_ms, S, scale, OUT, o_row0, stride_os, col0, NK,
                          HEAD_DIM, DH_PAD, CAUSAL, HAS_MASK, ACCURATE, FAST_DIV)
        else:
            _attend_tiles(q, k, v, 0, MASK, m_row0, stride_ms, S, scale, OUT, o_row0, stride_os, col0, NK, HEAD_DIM,
                          DH_PAD, CAUSAL, HAS_MASK, ACCURATE, FAST_DIV)
    elif WHOLE:
        _whole_block(X, x_row0, stride_xs, m0, S, WQ, WK, WV, BQ, BK, BV, col0, stride_w, D, MASK, m_row0, stride_ms,
                     scale, OUT, o_row0, stride_os, NK, HEAD_DIM, DH_PAD, BLOCK_K, CAUSAL, HAS_MASK, ACCURATE,
                     FAST_DIV, EARLY, EARLY_MASK, PV64)
    else:
        # the cached launch's chunks 0-3 (``_attention_tile``, NCACHED = 4), in its order and under its conditions
        n_end = _keys_end(m0, S, CAUSAL)
        s2, s3, v2, v3 = _unscored_chunks(DH_PAD)
        q = _project(X, x_row0, stride_xs, offs_m, S, WQ, BQ, col0, stride_w, D, HEAD_DIM, DH_PAD, BLOCK_K)
        s0, s1, v0, v1 = _key_block(X, x_row0, stride_xs, 0, S, WK, WV, BK, BV, col0, stride_w, D, q, MASK, m_row0,
                                    stride_ms, offs_m, scale, HEAD_DIM, DH_PAD, BLOCK_K, CAUSAL, HAS_MASK)
        if n_end > 2 * CH:
            s2, s3, v2, v3 = _key_block(X, x_row0, stride_xs, 64, S, WK, WV, BK, BV, col0, stride_w, D, q, MASK,
                                        m_row0, stride_ms, offs_m, scale, HEAD_DIM, DH_PAD, BLOCK_K, CAUSAL, HAS_MASK)
        _attend(s0, s1, s2, s3, v0, v1, v2, v3, n_end, OUT, o_row0, stride_os, offs_m, col0, S, HEAD_DIM, DH_PAD,
                ACCURATE, FAST_DIV)


def triton_qkv_attention(h: torch.Tensor, weights, biases, valid_token_mask, num_heads: int, causal: bool, *,
                         fast_div: bool = True, num_warps: int = 4, num_stages=None, max_registers=None,
                         whole: bool = False, pair: bool = False, early: bool = False,
                         early_mask: bool = False, pv64: bool = False, rows128: bool = False) -> torch.Tensor:
    """The attention's context [B, S, D] fp16 of the normalized rows ``h`` [B, S, D] fp16, with ``weights`` (Wq, Wk,
    Wv), each [D, D], and ``biases`` (bq, bk, bv): what ``triton_linear`` of the packed Q|K|V followed by
    ``triton_attention(..., cached=True, block_m=64, num_warps=4, fast_div=True)`` computes, in one launch.
    ``max_registers``: Triton's ``maxnreg`` (offline, Triton 3.6, sm_90a: 168 registers at 4 warps, three programs
    per multiprocessor; capped at 128, four, with 32 bytes of spills). ``whole``: q, k and v projected in one walk
    over D, k and v of every key (the kernel's WHOLE); ``pair``: one program per head, every row projected once and
    both row blocks attended (the kernel's PAIR); ``early``: the biases loaded before the walk over D (EARLY);
    ``early_mask`` (``whole`` only): the keys' validity too (EARLY_MASK); ``pv64`` (``whole``, or ``pair`` with
    ``rows128``): P.V over 64 keys a dot (PV64); ``rows128`` (``pair`` only): both row blocks as one tile
    (ROWS128)."""
    if h.dtype != torch.float16 or h.dim() != 3:
        raise KKError(f"h must be float16 [B, S, D], got {h.dtype} {list(h.shape)}")
    b, s, d = h.shape
    if early and not (whole or pair):
        raise KKError("early loads the biases before the whole or pair form's walk over D; "
                      "pass whole=True or pair=True")
    if early_mask and not (whole and not pair):
        raise KKError("early_mask loads the keys' validity before the whole form's walk over D; pass whole=True")
    if pv64 and not ((whole and not pair) or (pair and rows128)):
        raise KKError("pv64 runs the whole form's P.V over 64 keys a dot; pass whole=True (or pair=True with "
                      "rows128=True)")
    if rows128 and not pair:
        raise KKError("rows128 attends a pair program's two row blocks as one tile; pass pair=True")
    refusal = qkv_attention_refusal(s, d, num_heads)
    if refusal:
        raise KKError(refusal)
    ws = [w.contiguous() for w in weights]
    bs = [x.contiguous() for x in biases]
    if any(w.shape != (d, d) or w.dtype != torch.float16 for w in ws) or any(x.shape != (d, ) for x in bs):
        raise KKError(f"weights must be three float16 [{d}, {d}] and biases three [{d}] (q_proj, k_proj, v_proj)")
    if h.stride(-1) != 1:
        h = h.contiguous()
    dh = d // num_heads
    dh_pad = max(16, triton.next_power_of_2(dh))
    block_k = min(64, max(16, triton.next_power_of_2(d)))  # the proven GEMM tiles' k-step (``launch_config``)
    out = torch.empty((b, s, d), dtype=torch.float16, device=h.device)
    has_mask = valid_token_mask is not None
    mask = valid_token_mask if has_mask else h
    stride_mb, stride_ms = (mask.stride(0), mask.stride(1)) if has_mask else (0, 0)
    launch = dict(num_warps=num_warps)
    if num_stages is not None:
        launch["num_stages"] = num_stages
    if max_registers and not INTERPRET:
        launch["maxnreg"] = int(max_registers)
    if not INTERPRET:
        launch.update(COMPILE_FLAGS)
        launch.update(launch_options())
    row_blocks = 1 if pair else triton.cdiv(s, BLOCK_M)  # a pair program walks both row blocks itself
    launch_kernel(_qkv_attention_kernel, (row_blocks, b * num_heads),
                  h, *ws, *bs, mask, out,
                  h.stride(0), h.stride(1), ws[0].stride(0), out.stride(0), out.stride(1), stride_mb, stride_ms,
                  s, num_heads, d, fp32_scale(dh),
                  HEAD_DIM=dh, DH_PAD=dh_pad, BLOCK_K=block_k, CAUSAL=bool(causal), HAS_MASK=has_mask,
                  ACCURATE=not INTERPRET, FAST_DIV=bool(fast_div), WHOLE=bool(whole or pair), PAIR=bool(pair),
                  NK=64 if s <= 64 else 128, EARLY=bool(early), EARLY_MASK=bool(early_mask), PV64=bool(pv64),
                  ROWS128=bool(rows128), **launch)
    return out
