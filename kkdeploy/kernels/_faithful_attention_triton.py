"""The Triton kernel behind ``kkdeploy_faithful::attention`` (imported lazily: it imports triton).

One program per (block of BLOCK_M query rows, batch * head). Keys are walked in chunks of
``LANES * SUB`` keys, where LANES = ATen's WARP (min(next_pow2(S), 32), at least 16 for tl.dot) and
column ``t`` of sub-chunk ``j`` is lane ``t``'s element of iteration ``it``: exactly the element
ownership of ATen's ``softmax_warp_forward``. Chunks wholly past the causal limit of the block (or past
S) are skipped: there every score is -inf, which adds exactly +0 to each lane sum and 0 * v to P.V.

Three passes over the keys, recomputing the score chunk each time (cheap: K = head_dim):

1. scores = fp16(fp16(dot(q, k^T)) * scale), -inf where causal/invalid/out of range; running max.
2. ``lane += expf(s - max)`` elementwise (per-lane sequential, in chunk order), then the butterfly
   over the lanes (offset LANES/2 first) by reshape/permute/split: the row sum.
3. ``p = fp16(div_rn(expf(s - max), sum))``; ``acc = dot(p, v_chunk, acc)`` in key order; store fp16.

Compiled with ``enable_fp_fusion=False`` (no mul+add contraction anywhere) and
``enable_reflect_ftz=False`` (libdevice's ``__nv_expf`` without flush-to-zero, like nvcc's ``expf``
in ATen, which is built without --use_fast_math / -ftz). ``exp`` is libdevice's accurate ``expf``,
not ``tl.exp`` (ex2.approx); division is ``tl.math.div_rn`` (``/`` lowers to an approximate
division). Under ``TRITON_INTERPRET=1`` (CPU) libdevice does not exist: the kernel then uses
``tl.exp`` (numpy's float32 exp) so its *logic* can be checked on a CPU against
``emulate_persistent_softmax(..., exp=numpy exp)``.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kkdeploy.errors import KKError

from .faithful_attention import check_attention_inputs, fp32_scale, persistent_softmax_layout
from .dependent_launch import launch_options
from .fused_linear import multiprocessors
from .precompile import launch as launch_kernel  # compile-only inside precompile.parallel_compiles

try:  # the CUDA libdevice wrappers (absent or unusable under the interpreter)
    from triton.language.extra.cuda import libdevice as _libdevice
except ImportError:  # pragma: no cover - older layouts
    from triton.language.extra import libdevice as _libdevice

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

#: the launch configuration used by the custom op: rows per program, lane iterations per chunk.
DEFAULT_BLOCK_M = 64
DEFAULT_SUB = 1
#: compile options that keep the arithmetic IEEE: no fmul+fadd contraction, libdevice without FTZ.
COMPILE_FLAGS = dict(enable_fp_fusion=False, enable_reflect_ftz=False)


@triton.jit
def _exp(x, ACCURATE: tl.constexpr):
    if ACCURATE:
        y = _libdevice.exp(x)  # __nv_expf: the accurate expf ATen's kernel calls
    else:
        y = tl.exp(x)  # interpreter only (numpy float32 exp)
    return y


@triton.jit
def _butterfly_step(x, BLOCK_M: tl.constexpr, W: tl.constexpr):
    """[BLOCK_M, 2W] -> [BLOCK_M, W]: lane t + lane t+W (the __shfl_xor step at offset W)."""
    x = tl.reshape(x, (BLOCK_M, 2, W))
    x = tl.permute(x, (0, 2, 1))
    lo, hi = tl.split(x)
    return lo + hi


@triton.jit
def _lane_add(lane, e, BLOCK_M: tl.constexpr, LANES: tl.constexpr, SUB: tl.constexpr):
    """lane [BLOCK_M, LANES] += e [BLOCK_M, SUB * LANES], one iteration at a time: column it * LANES + t is lane
    t's element of iteration it, added in it order (ATen's per-lane sequential sum). SUB is 1, 2 or 4."""
    if SUB == 1:
        lane = lane + e
    elif SUB == 2:
        e_first, e_second = tl.split(tl.permute(tl.reshape(e, (BLOCK_M, 2, LANES)), (0, 2, 1)))
        lane = lane + e_first
        lane = lane + e_second
    else:  # SUB == 4: it = 2 * hi + lo
        x = tl.permute(tl.reshape(e, (BLOCK_M, 2, 2, LANES)), (0, 3, 1, 2))  # [M, LANES, hi, lo]
        lo0, lo1 = tl.split(x)  # [M, LANES, hi]: it = 2 hi and it = 2 hi + 1
        e0, e2 = tl.split(lo0)
        e1, e3 = tl.split(lo1)
        lane = lane + e0
        lane = lane + e1
        lane = lane + e2
        lane = lane + e3
    return lane


@triton.jit
def _row_sum(lane, BLOCK_M: tl.constexpr, LANES: tl.constexpr):
    """The __shfl_xor butterfly over the lanes: offsets LANES/2, ..., 1 (LANES is 16 or 32; lanes >= WARP
    hold +0); [BLOCK_M, LANES] -> [BLOCK_M]."""
    if LANES == 32:
        lane = _butterfly_step(lane, BLOCK_M, 16)
    lane = _butterfly_step(lane, BLOCK_M, 8)
    lane = _butterfly_step(lane, BLOCK_M, 4)
    lane = _butterfly_step(lane, BLOCK_M, 2)
    lane = _butterfly_step(lane, BLOCK_M, 1)
    return tl.reshape(lane, (BLOCK_M, ))


@triton.jit
def _scaled(s, scale):
    """The reference's score from its fp32 dot product: rounded to fp16, an fp32 multiply by the scale, rounded to
    fp16 again (held in fp32). Each step is monotone non-decreasing (the scale is positive), so is the whole."""
    s = s.to(tl.float16).to(tl.float32) * scale  # GEMM output rounded to fp16, then fp32 multiply
    return s.to(tl.float16).to(tl.float32)  # the scaled scores are fp16 in the reference


@triton.jit
def _key_valid(MASK, m_row0, stride_ms, offs_n, S):
    """The padding mask of keys offs_n (keys past S: invalid)."""
    return tl.load(MASK + m_row0 + offs_n * stride_ms, mask=offs_n < S, other=0) != 0


@triton.jit
def _edge_masked(s, MASK, m_row0, stride_ms, offs_m, offs_n, S, CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr,
                 km=None):
    """Scores s [rows offs_m, keys offs_n] with -inf where a key is past S, in a row's causal future or invalid: an
    edge chunk's masks, as the reference's masked_fill leaves them. ``km``: the keys' padding mask already loaded
    (``_key_valid``), else it is loaded here."""
    valid = offs_n[None, :] < S
    if CAUSAL:
        valid = valid & (offs_n[None, :] <= offs_m[:, None])
    if HAS_MASK:
        if km is None:
            km = _key_valid(MASK, m_row0, stride_ms, offs_n, S)
        valid = valid & km[None, :]
    return tl.where(valid, s, float("-inf"))


@triton.jit
def _score_chunk(q, K, k_row0, stride_ks, MASK, m_row0, stride_ms, offs_m, offs_n, offs_d, S, scale,
                 HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, RAW: tl.constexpr = False,
                 EDGE: tl.constexpr = True):
    """fp32 scores of one key chunk, holding fp16 values (or -inf), rounded where the reference rounds. ``RAW``: the
    fp32 dot products before the roundings and the scale (the masked ones -inf): ``_scaled`` of their max is the
    max of the scores (``_attention_tile``'s RAW_MAX). ``EDGE=False``: an interior chunk, every key below S and, where
    causal, at or before every row of the block: only the padding mask can hide a score, so the bound and causal
    compares and their selects are left out (the same scores)."""
    if EDGE:
        kmask = (offs_n[:, None] < S) & (offs_d[None, :] < HEAD_DIM)
    else:
        kmask = offs_d[None, :] < HEAD_DIM
    k = tl.load(K + k_row0 + offs_n[:, None] * stride_ks + offs_d[None, :], mask=kmask, other=0.0)
    s = tl.dot(q, tl.trans(k))  # fp32 accumulation
    if not RAW:
        s = _scaled(s, scale)
    if EDGE:
        s = _edge_masked(s, MASK, m_row0, stride_ms, offs_m, offs_n, S, CAUSAL, HAS_MASK)
    elif HAS_MASK:
        km = tl.load(MASK + m_row0 + offs_n * stride_ms)
        s = tl.where(km[None, :] != 0, s, float("-inf"))
    return s


@triton.jit
def _pv_step(p, acc, V, v_row0, stride_vs, offs_n, offs_d, S, HEAD_DIM: tl.constexpr, EDGE: tl.constexpr = True):
    """acc += p . V[offs_n] (fp32 accumulation, tensor cores), the keys in order (``EDGE=False``: all below S)."""
    if EDGE:
        vmask = (offs_n[:, None] < S) & (offs_d[None, :] < HEAD_DIM)
    else:
        vmask = offs_d[None, :] < HEAD_DIM
    v = tl.load(V + v_row0 + offs_n[:, None] * stride_vs + offs_d[None, :], mask=vmask, other=0.0)
    return tl.dot(p, v, acc)


@triton.jit
def _store_debug(SCORES, PROBS, b, H, h, S, offs_m, offs_n, s, p):
    """The reference's intermediate tensors, [B, H, S, S] fp16 (debug launches only)."""
    dbg = ((b * H + h) * S + offs_m[:, None].to(tl.int64)) * S + offs_n[None, :]
    dmask = (offs_m[:, None] < S) & (offs_n[None, :] < S)
    tl.store(SCORES + dbg, s.to(tl.float16), mask=dmask)
    tl.store(PROBS + dbg, p, mask=dmask)


@triton.jit
def _probabilities(e, row_sum, FAST_DIV: tl.constexpr):
    """fp16(e / row_sum) for a chunk's exps e [BLOCK_M, CHUNK], IEEE-correct: ``div_rn``, or with ``FAST_DIV`` one
    reciprocal per row and two fmas per element (``_pv_chunk`` says why that is the same quotient)."""
    if FAST_DIV:
        y = tl.math.div_rn(tl.full(row_sum.shape, 1.0, tl.float32), row_sum)
        q = e * y[:, None]
        r = tl.fma(-q, row_sum[:, None], e)
        p = tl.fma(r, y[:, None], q).to(tl.float16)
    else:
        p = tl.math.div_rn(e, row_sum[:, None]).to(tl.float16)
    return p


@triton.jit
def _pv_chunk(e, row_sum, acc, s, V, v_row0, stride_vs, offs_m, offs_n, offs_d, S, HEAD_DIM: tl.constexpr,
              SCORES, PROBS, b, H, h, DEBUG: tl.constexpr, FAST_DIV: tl.constexpr = False, EDGE: tl.constexpr = True):
    """One chunk's probabilities (IEEE division, fp16) into the P.V chain; returns acc.

    ``FAST_DIV``: e / sum correctly rounded without a division per element (Markstein): y = RN(1/sum) once per
    row, q = RN(e * y), r = e - q * sum (exact, one fma), p = RN(q + r * y) (one fma). With y the correctly
    rounded reciprocal and q within an ulp, p is RN(e / sum) for normal quotients; a quotient below float32's
    normal range rounds to float16 zero either way. Checked against exact rationals on 200,000 (e, sum) pairs
    (tests/test_faithful_attention.py); like every launch, it runs where a proof made here found it bit-identical
    (``faithful_attention.prove_attention``; measured on the H200 in docs/faithful-attention.md)."""
    p = _probabilities(e, row_sum, FAST_DIV)
    acc = _pv_step(p, acc, V, v_row0, stride_vs, offs_n, offs_d, S, HEAD_DIM, EDGE)
    if DEBUG:
        _store_debug(SCORES, PROBS, b, H, h, S, offs_m, offs_n, s, p)
    return acc


@triton.jit
def _faithful_attention_kernel(
    Q, K, V, MASK, OUT, SCORES, PROBS,
    stride_qb, stride_qs, stride_kb, stride_ks, stride_vb, stride_vs, stride_ob, stride_os,
    stride_mb, stride_ms,
    S, H, scale,
    HEAD_DIM: tl.constexpr, DH_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
    LANES: tl.constexpr, SUB: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, ACCURATE: tl.constexpr, DEBUG: tl.constexpr,
    ONE_PASS: tl.constexpr = False, NCACHED: tl.constexpr = 0, FAST_DIV: tl.constexpr = False,
    RAW_MAX: tl.constexpr = False,
    PDL: tl.constexpr = False,
    INTERIOR: tl.constexpr = False,
    ECACHE: tl.constexpr = False, E=None, E_CHUNKS=0,  # E_CHUNKS: exp tiles per head, or per slot with SLOTS
    SLOTS: tl.constexpr = False, BH=0, NUM_PROGRAMS=1,
):
    if PDL:  # a dependent launch (kernels/dependent_launch.py): every earlier kernel's writes first, then the next's start
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    if SLOTS:  # persistent: NUM_PROGRAMS programs walk the (row block, head) items, each with one exp-cache slot
        blocks = tl.cdiv(S, BLOCK_M)
        slot = tl.program_id(0).to(tl.int64) * E_CHUNKS * (BLOCK_M * LANES * SUB)
        for item in range(tl.program_id(0), blocks * BH, NUM_PROGRAMS):
            _attention_program(Q, K, V, MASK, OUT, SCORES, PROBS, blocks - 1 - item % blocks, item // blocks,
                               stride_qb, stride_qs, stride_kb, stride_ks, stride_vb, stride_vs, stride_ob, stride_os,
                               stride_mb, stride_ms, S, H, scale, HEAD_DIM, DH_PAD, BLOCK_M, LANES, SUB, CAUSAL,
                               HAS_MASK, ACCURATE, DEBUG, ONE_PASS, NCACHED, FAST_DIV, RAW_MAX, INTERIOR, ECACHE, E,
                               slot)
            tl.debug_barrier()  # every thread done with the slot before the next item writes it
    else:
        pid_m = tl.program_id(0)
        pid_bh = tl.program_id(1)
        _attention_program(Q, K, V, MASK, OUT, SCORES, PROBS, pid_m, pid_bh,
                           stride_qb, stride_qs, stride_kb, stride_ks, stride_vb, stride_vs, stride_ob, stride_os,
                           stride_mb, stride_ms, S, H, scale, HEAD_DIM, DH_PAD, BLOCK_M, LANES, SUB, CAUSAL, HAS_MASK,
                           ACCURATE, DEBUG, ONE_PASS, NCACHED, FAST_DIV, RAW_MAX, INTERIOR, ECACHE, E,
                           _ecache_base(pid_m, pid_bh, S, E_CHUNKS, BLOCK_M, LANES * SUB, CAUSAL))


@triton.jit
def _attention_program(Q, K, V, MASK, OUT, SCORES, PROBS, pid_m, pid_bh,
                       stride_qb, stride_qs, stride_kb, stride_ks, stride_vb, stride_vs, stride_ob, stride_os,
                       stride_mb, stride_ms, S, H, scale,
                       HEAD_DIM: tl.constexpr, DH_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
                       LANES: tl.constexpr, SUB: tl.constexpr,
                       CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, ACCURATE: tl.constexpr, DEBUG: tl.constexpr,
                       ONE_PASS: tl.constexpr, NCACHED: tl.constexpr, FAST_DIV: tl.constexpr,
                       RAW_MAX: tl.constexpr, INTERIOR: tl.constexpr, ECACHE: tl.constexpr, E, e_base):
    """Row block ``pid_m`` of head ``pid_bh`` (batch * H + head): the tile, rounded to float16 and stored."""
    b = (pid_bh // H).to(tl.int64)
    h = pid_bh % H
    acc = _attention_tile(Q, K, V, MASK, SCORES, PROBS, b, h, pid_m * BLOCK_M,
                          stride_qb, stride_qs, stride_kb, stride_ks, stride_vb, stride_vs, stride_mb, stride_ms,
                          S, H, scale, HEAD_DIM, DH_PAD, BLOCK_M, LANES, SUB, CAUSAL, HAS_MASK, ACCURATE, DEBUG,
                          ONE_PASS, NCACHED, FAST_DIV, RAW_MAX, INTERIOR, ECACHE, E, e_base)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, DH_PAD)
    o_ptrs = OUT + b * stride_ob + offs_m[:, None] * stride_os + h * HEAD_DIM + offs_d[None, :]
    tl.store(o_ptrs, acc.to(tl.float16), mask=(offs_m[:, None] < S) & (offs_d[None, :] < HEAD_DIM))


@triton.jit
def _ecache_base(pid_m, pid_bh, S, E_CHUNKS, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr, CAUSAL: tl.constexpr):
    """Where program (pid_m, pid_bh)'s exps start in the exp cache (int64 elements): each head owns E_CHUNKS tiles of
    [BLOCK_M, CHUNK] float32, its row blocks one after another. Causal, row block i holds (i + 1) * BLOCK_M / CHUNK
    chunks (the blocks before the last all end below S), so the blocks before it hold BLOCK_M / CHUNK * i (i + 1) / 2;
    otherwise every block holds cdiv(S, CHUNK)."""
    if CAUSAL:
        chunk0 = (pid_m * (pid_m + 1) // 2) * (BLOCK_M // CHUNK)
    else:
        chunk0 = pid_m * tl.cdiv(S, CHUNK)
    return (pid_bh.to(tl.int64) * E_CHUNKS + chunk0) * (BLOCK_M * CHUNK)


@triton.jit
def _attention_tile(Q, K, V, MASK, SCORES, PROBS, b, h, m0,
                    stride_qb, stride_qs, stride_kb, stride_ks, stride_vb, stride_vs, stride_mb, stride_ms,
                    S, H, scale,
                    HEAD_DIM: tl.constexpr, DH_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
                    LANES: tl.constexpr, SUB: tl.constexpr,
                    CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, ACCURATE: tl.constexpr, DEBUG: tl.constexpr,
                    ONE_PASS: tl.constexpr, NCACHED: tl.constexpr, FAST_DIV: tl.constexpr,
                    RAW_MAX: tl.constexpr = False, INTERIOR: tl.constexpr = False, ECACHE: tl.constexpr = False,
                    E=None, e_base=0):
    """Head ``h`` of sequence ``b`` (int64) for the query rows m0 .. m0 + BLOCK_M - 1: the float32 context
    [BLOCK_M, DH_PAD] before its rounding to float16. The kernel above is one tile per program; ``_layer_triton``
    runs every head of a row block inside a whole layer. ``ECACHE`` (three passes only): the second pass stores each
    chunk's exps in the program's own tiles of E from ``e_base`` on, and the third reads them back instead of scoring
    the chunk and taking its exps again."""
    CHUNK: tl.constexpr = LANES * SUB
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, DH_PAD)
    offs_c = tl.arange(0, CHUNK)
    col0 = h * HEAD_DIM

    q_ptrs = Q + b * stride_qb + offs_m[:, None] * stride_qs + col0 + offs_d[None, :]
    q = tl.load(q_ptrs, mask=(offs_m[:, None] < S) & (offs_d[None, :] < HEAD_DIM), other=0.0)
    k_row0 = b * stride_kb + col0
    v_row0 = b * stride_vb + col0
    m_row0 = b * stride_mb

    if CAUSAL:
        n_end = tl.minimum(S, m0 + BLOCK_M)  # later chunks are -inf for every row of this block
    else:
        n_end = S

    if ONE_PASS:  # one chunk holds the whole row (CHUNK >= S): scores, exps and probabilities computed once
        s = _score_chunk(q, K, k_row0, stride_ks, MASK, m_row0, stride_ms, offs_m, offs_c, offs_d,
                         S, scale, HEAD_DIM, CAUSAL, HAS_MASK)
        row_max = tl.max(s, axis=1)
        e = _exp(s - row_max[:, None], ACCURATE)
        row_sum = _row_sum(_lane_add(tl.zeros((BLOCK_M, LANES), tl.float32), e, BLOCK_M, LANES, SUB), BLOCK_M, LANES)
        acc = _pv_chunk(e, row_sum, tl.zeros((BLOCK_M, DH_PAD), tl.float32), s, V, v_row0, stride_vs, offs_m, offs_c,
                        offs_d, S, HEAD_DIM, SCORES, PROBS, b, H, h, DEBUG, FAST_DIV)
    elif NCACHED > 0:  # up to 4 chunks of the row, each scored once and kept in registers (SUB == 1)
        # The three-pass kernel's arithmetic in its order, without recomputing: chunk k exists iff
        # k * CHUNK < n_end (the same chunks pass 1 visits), its exps are computed once and added to the lanes in
        # chunk order, and P.V chains the chunks in key order. INTERIOR: a chunk that ends at or before n_int is
        # scored without the bound and causal masks (the same scores, as in the three passes below)
        n_int = _interior_end(S, m0, CHUNK, CAUSAL)
        s0 = _cached_scores(q, K, k_row0, stride_ks, MASK, m_row0, stride_ms, offs_m, 0, offs_c, offs_d, S, scale,
                            n_int, HEAD_DIM, CHUNK, CAUSAL, HAS_MASK, INTERIOR)
        s1 = tl.full((BLOCK_M, CHUNK), float("-inf"), tl.float32)
        s2 = tl.full((BLOCK_M, CHUNK), float("-inf"), tl.float32)
        s3 = tl.full((BLOCK_M, CHUNK), float("-inf"), tl.float32)
        run_max = s0
        if NCACHED > 1:
            if n_end > CHUNK:
                s1 = _cached_scores(q, K, k_row0, stride_ks, MASK, m_row0, stride_ms, offs_m, CHUNK, offs_c, offs_d,
                                    S, scale, n_int, HEAD_DIM, CHUNK, CAUSAL, HAS_MASK, INTERIOR)
                run_max = tl.maximum(run_max, s1)
        if NCACHED > 2:
            if n_end > 2 * CHUNK:
                s2 = _cached_scores(q, K, k_row0, stride_ks, MASK, m_row0, stride_ms, offs_m, 2 * CHUNK, offs_c,
                                    offs_d, S, scale, n_int, HEAD_DIM, CHUNK, CAUSAL, HAS_MASK, INTERIOR)
                run_max = tl.maximum(run_max, s2)
        if NCACHED > 3:
            if n_end > 3 * CHUNK:
                s3 = _cached_scores(q, K, k_row0, stride_ks, MASK, m_row0, stride_ms, offs_m, 3 * CHUNK, offs_c,
                                    offs_d, S, scale, n_int, HEAD_DIM, CHUNK, CAUSAL, HAS_MASK, INTERIOR)
                run_max = tl.maximum(run_max, s3)
        row_max = tl.max(run_max, axis=1)
        e0 = _exp(s0 - row_max[:, None], ACCURATE)
        lane = _lane_add(tl.zeros((BLOCK_M, LANES), tl.float32), e0, BLOCK_M, LANES, SUB)
        e1 = tl.zeros((BLOCK_M, CHUNK), tl.float32)
        e2 = tl.zeros((BLOCK_M, CHUNK), tl.float32)
        e3 = tl.zeros((BLOCK_M, CHUNK), tl.float32)
        if NCACHED > 1:
            if n_end > CHUNK:
                e1 = _exp(s1 - row_max[:, None], ACCURATE)
                lane = _lane_add(lane, e1, BLOCK_M, LANES, SUB)
        if NCACHED > 2:
            if n_end > 2 * CHUNK:
                e2 = _exp(s2 - row_max[:, None], ACCURATE)
                lane = _lane_add(lane, e2, BLOCK_M, LANES, SUB)
        if NCACHED > 3:
            if n_end > 3 * CHUNK:
                e3 = _exp(s3 - row_max[:, None], ACCURATE)
                lane = _lane_add(lane, e3, BLOCK_M, LANES, SUB)
        row_sum = _row_sum(lane, BLOCK_M, LANES)
        acc = _pv_chunk(e0, row_sum, tl.zeros((BLOCK_M, DH_PAD), tl.float32), s0, V, v_row0, stride_vs, offs_m,
                        offs_c, offs_d, S, HEAD_DIM, SCORES, PROBS, b, H, h, DEBUG, FAST_DIV)
        if NCACHED > 1:
            if n_end > CHUNK:
                acc = _pv_chunk(e1, row_sum, acc, s1, V, v_row0, stride_vs, offs_m, CHUNK + offs_c, offs_d, S,
                                HEAD_DIM, SCORES, PROBS, b, H, h, DEBUG, FAST_DIV)
        if NCACHED > 2:
            if n_end > 2 * CHUNK:
                acc = _pv_chunk(e2, row_sum, acc, s2, V, v_row0, stride_vs, offs_m, 2 * CHUNK + offs_c, offs_d, S,
                                HEAD_DIM, SCORES, PROBS, b, H, h, DEBUG, FAST_DIV)
        if NCACHED > 3:
            if n_end > 3 * CHUNK:
                acc = _pv_chunk(e3, row_sum, acc, s3, V, v_row0, stride_vs, offs_m, 3 * CHUNK + offs_c, offs_d, S,
                                HEAD_DIM, SCORES, PROBS, b, H, h, DEBUG, FAST_DIV)
    else:  # three passes over chunks of the row
        # INTERIOR: each pass walks the interior chunks (every key below S and, where causal, at or before the
        # block's first row) without the bound and causal masks, then the edge chunks with them: the same chunks in
        # the same order, the same scores, fewer compares and selects per score (the integer and select pipe bounds
        # shape 13's attention: ncu, docs/faithful-attention.md)
        n_int = 0
        if INTERIOR:
            n_int = _interior_end(S, m0, CHUNK, CAUSAL)
        # pass 1: the row max (order-free)
        run_max = tl.full((BLOCK_M, CHUNK), float("-inf"), tl.float32)
        if INTERIOR:
            run_max = _max_pass(run_max, q, K, k_row0, stride_ks, MASK, m_row0, stride_ms, offs_m, offs_c, offs_d,
                                S, scale, 0, n_int, HEAD_DIM, CHUNK, CAUSAL, HAS_MASK, RAW_MAX, False)
        run_max = _max_pass(run_max, q, K, k_row0, stride_ks, MASK, m_row0, stride_ms, offs_m, offs_c, offs_d,
                            S, scale, n_int, n_end, HEAD_DIM, CHUNK, CAUSAL, HAS_MASK, RAW_MAX, True)
        row_max = tl.max(run_max, axis=1)
        if RAW_MAX:  # max(f(x)) = f(max(x)) for the monotone f: the roundings and the scale once per row
            row_max = _scaled(row_max, scale)

        # pass 2: per-lane sequential sums of expf(s - max), in ATen's element order
        lane = tl.zeros((BLOCK_M, LANES), tl.float32)
        if INTERIOR:
            lane = _sum_pass(lane, row_max, q, K, k_row0, stride_ks, MASK, m_row0, stride_ms, offs_m, offs_c, offs_d,
                             S, scale, 0, n_int, HEAD_DIM, BLOCK_M, LANES, SUB, CAUSAL, HAS_MASK, ACCURATE, False,
                             ECACHE, E, e_base)
        lane = _sum_pass(lane, row_max, q, K, k_row0, stride_ks, MASK, m_row0, stride_ms, offs_m, offs_c, offs_d,
                         S, scale, n_int, n_end, HEAD_DIM, BLOCK_M, LANES, SUB, CAUSAL, HAS_MASK, ACCURATE, True,
                         ECACHE, E, e_base)
        row_sum = _row_sum(lane, BLOCK_M, LANES)
        if ECACHE:  # every thread's exps stored before any thread reads another's back
            tl.debug_barrier()

        # pass 3: probabilities (IEEE division, fp16) and P.V in key order
        acc = tl.zeros((BLOCK_M, DH_PAD), tl.float32)
        if INTERIOR:
            acc = _pv_pass(acc, row_max, row_sum, q, K, V, k_row0, v_row0, stride_ks, stride_vs, MASK, m_row0,
                           stride_ms, offs_m, offs_c, offs_d, S, scale, 0, n_int, SCORES, PROBS, b, H, h, HEAD_DIM,
                           CHUNK, CAUSAL, HAS_MASK, ACCURATE, DEBUG, FAST_DIV, False, ECACHE, E, e_base)
        acc = _pv_pass(acc, row_max, row_sum, q, K, V, k_row0, v_row0, stride_ks, stride_vs, MASK, m_row0,
                       stride_ms, offs_m, offs_c, offs_d, S, scale, n_int, n_end, SCORES, PROBS, b, H, h, HEAD_DIM,
                       CHUNK, CAUSAL, HAS_MASK, ACCURATE, DEBUG, FAST_DIV, True, ECACHE, E, e_base)
    return acc


@triton.jit
def _interior_end(S, m0, CHUNK: tl.constexpr, CAUSAL: tl.constexpr):
    """The end of the interior chunks of the row block from m0: keys 0 up to the largest multiple of CHUNK at or below
    min(S, m0 + 1) where causal (S otherwise), which no bound or causal mask can hide from any row of the block."""
    if CAUSAL:
        end = (tl.minimum(S, m0 + 1) // CHUNK) * CHUNK
    else:
        end = (S // CHUNK) * CHUNK
    return end


@triton.jit
def _cached_scores(q, K, k_row0, stride_ks, MASK, m_row0, stride_ms, offs_m, n0, offs_c, offs_d, S, scale, n_int,
                   HEAD_DIM: tl.constexpr, CHUNK: tl.constexpr, CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr,
                   INTERIOR: tl.constexpr):
    """The cached launch's scores of the chunk at key n0; ``INTERIOR``: an interior chunk (it ends at or before n_int)
    without the bound and causal compares and selects, an edge chunk with them."""
    if INTERIOR:
        if n0 + CHUNK <= n_int:
            s = _score_chunk(q, K, k_row0, stride_ks, MASK, m_row0, stride_ms, offs_m, n0 + offs_c, offs_d,
                             S, scale, HEAD_DIM, CAUSAL, HAS_MASK, False, False)
        else:
            s = _score_chunk(q, K, k_row0, stride_ks, MASK, m_row0, stride_ms, offs_m, n0 + offs_c, offs_d,
                             S, scale, HEAD_DIM, CAUSAL, HAS_MASK, False, True)
    else:
        s = _score_chunk(q, K, k_row0, stride_ks, MASK, m_row0, stride_ms, offs_m, n0 + offs_c, offs_d,
                         S, scale, HEAD_DIM, CAUSAL, HAS_MASK)
    return s


@triton.jit
def _max_pass(run_max, q, K, k_row0, stride_ks, MASK, m_row0, stride_ms, offs_m, offs_c, offs_d, S, scale, lo, hi,
              HEAD_DIM: tl.constexpr, CHUNK: tl.constexpr, CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr,
              RAW_MAX: tl.constexpr, EDGE: tl.constexpr):
    """The three-pass kernel's first pass over the key chunks lo .. hi: the running max per (row, column)."""
    for n0 in range(lo, hi, CHUNK):
        s = _score_chunk(q, K, k_row0, stride_ks, MASK, m_row0, stride_ms, offs_m, n0 + offs_c, offs_d,
                         S, scale, HEAD_DIM, CAUSAL, HAS_MASK, RAW_MAX, EDGE)
        run_max = tl.maximum(run_max, s)
    return run_max


@triton.jit
def _sum_pass(lane, row_max, q, K, k_row0, stride_ks, MASK, m_row0, stride_ms, offs_m, offs_c, offs_d, S, scale,
              lo, hi, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, LANES: tl.constexpr, SUB: tl.constexpr,
              CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, ACCURATE: tl.constexpr, EDGE: tl.constexpr,
              ECACHE: tl.constexpr = False, E=None, e_base=0):
    """The second pass over the key chunks lo .. hi: each lane's sequential sum of expf(s - max); ``ECACHE``: each
    chunk's exps stored too, for the third pass."""
    CHUNK: tl.constexpr = LANES * SUB
    for n0 in range(lo, hi, CHUNK):
        s = _score_chunk(q, K, k_row0, stride_ks, MASK, m_row0, stride_ms, offs_m, n0 + offs_c, offs_d,
                         S, scale, HEAD_DIM, CAUSAL, HAS_MASK, False, EDGE)
        e = _exp(s - row_max[:, None], ACCURATE)
        if ECACHE:
            tl.store(_ecache_tile(E, e_base, n0, BLOCK_M, CHUNK), e, eviction_policy="evict_last")
        lane = _lane_add(lane, e, BLOCK_M, LANES, SUB)
    return lane


@triton.jit
def _ecache_tile(E, e_base, n0, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr):
    """The pointers of the chunk at key n0 in a program's exp cache: one contiguous [BLOCK_M, CHUNK] tile."""
    offs = tl.arange(0, BLOCK_M)[:, None] * CHUNK + tl.arange(0, CHUNK)[None, :]
    return E + e_base + (n0 // CHUNK) * (BLOCK_M * CHUNK) + offs


@triton.jit
def _pv_pass(acc, row_max, row_sum, q, K, V, k_row0, v_row0, stride_ks, stride_vs, MASK, m_row0, stride_ms, offs_m,
             offs_c, offs_d, S, scale, lo, hi, SCORES, PROBS, b, H, h, HEAD_DIM: tl.constexpr, CHUNK: tl.constexpr,
             CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, ACCURATE: tl.constexpr, DEBUG: tl.constexpr,
             FAST_DIV: tl.constexpr, EDGE: tl.constexpr, ECACHE: tl.constexpr = False, E=None, e_base=0):
    """The third pass over the key chunks lo .. hi: the probabilities and P.V in key order; ``ECACHE``: the exps
    the second pass stored, the same values, without the scores (no debug tensors then)."""
    BLOCK_M: tl.constexpr = offs_m.shape[0]
    for n0 in range(lo, hi, CHUNK):
        offs_n = n0 + offs_c
        if ECACHE:
            e = tl.load(_ecache_tile(E, e_base, n0, BLOCK_M, CHUNK), eviction_policy="evict_first")
            acc = _pv_chunk(e, row_sum, acc, e, V, v_row0, stride_vs, offs_m, offs_n, offs_d, S, HEAD_DIM, SCORES,
                            PROBS, b, H, h, False, FAST_DIV, EDGE)
        else:
            s = _score_chunk(q, K, k_row0, stride_ks, MASK, m_row0, stride_ms, offs_m, offs_n, offs_d,
                             S, scale, HEAD_DIM, CAUSAL, HAS_MASK, False, EDGE)
            acc = _pv_chunk(_exp(s - row_max[:, None], ACCURATE), row_sum, acc, s, V, v_row0, stride_vs, offs_m,
                            offs_n, offs_d, S, HEAD_DIM, SCORES, PROBS, b, H, h, DEBUG, FAST_DIV, EDGE)
    return acc


#: the most scratch an ``ecache`` launch takes (float32 exps of every key chunk a program visits)
ECACHE_MAX_BYTES = 2 << 30


def ecache_chunks(seq_len: int, block_m: int, chunk: int, causal: bool) -> int:
    """The [block_m, chunk] exp tiles one head's programs keep (``_ecache_base``'s layout): causal, row block i keeps
    (i + 1) * block_m / chunk of them (block_m a multiple of chunk); otherwise each keeps cdiv(seq_len, chunk)."""
    blocks = -(-seq_len // block_m)
    if not causal:
        return blocks * -(-seq_len // chunk)
    if block_m % chunk:
        raise KKError(f"ecache takes causal rows in blocks of a multiple of the key chunk ({block_m} rows, "
                      f"{chunk} keys)")
    return block_m // chunk * blocks * (blocks + 1) // 2


def kernel_lanes(seq_len: int) -> int:
    """ATen's WARP for this row length, raised to 16 (tl.dot's minimum): the extra lanes hold +0."""
    warp, _ = persistent_softmax_layout(seq_len)
    return max(16, warp)


def triton_attention(q, k, v, valid_token_mask, num_heads, causal, *, block_m=None, sub=None,
                     num_warps=None, num_stages=None, debug=False, validate=True, one_pass=False, cached=False,
                     fast_div=False, out=None, libdevice=None, raw_max=False, interior=False, ecache=False,
                     ecache_slots=None, max_registers=None):
    """Launch the kernel; returns the context [B, S, D] fp16 (and, with ``debug``, the fp16 scores and
    probabilities [B, H, S, S] as the reference computes them; causal-skipped entries are filled with
    the reference's values -inf and 0). ``validate=False``: the caller already checked the inputs.
    ``one_pass`` (S <= 128): one chunk of ``lanes * sub`` >= S keys, so every score, exp
    and probability is computed once instead of three times, and P.V is one tl.dot over the row.
    ``cached`` (S <= 4 * lanes): the three-pass arithmetic with each chunk's scores and exps computed once and
    kept in registers (at most 4 chunks), P.V chained chunk by chunk as in the third pass.
    ``fast_div``: the probabilities' division as one reciprocal per row and two fmas per element (``_pv_chunk``).
    ``raw_max`` (three passes only): the first pass takes the max of the raw dot products and rounds and scales it
    once per row, instead of every score: the same max, since the rounding and the scale are monotone;
    ``interior`` (three passes, or cached): each pass walks the chunks that need no bound or causal mask first,
    without those masks, then the edge chunks: the same chunks in the same order, the same scores; cached, each
    chunk is scored the one way or the other as it comes;
    ``max_registers``: the launch's register cap (Triton's ``maxnreg``: 128 keeps four 4-warp programs on a
    multiprocessor);
    ``ecache`` (three passes only): the second pass keeps each chunk's exps in a float32 scratch of its own (at most
    ECACHE_MAX_BYTES, ``ecache_chunks``) and the third reads them back: the same exps, without scoring every chunk
    and taking its exps a second time;
    ``ecache_slots`` (with ``ecache``): a persistent grid of that many programs per multiprocessor (two under the
    interpreter), each walking (row block, head) items with one slot of the scratch it reuses, so the scratch is the
    programs' slots only (at S = 1024, 256 KB each) and can stay in L2;
    ``out``: a [B, S, D] float16 tensor (unit last stride) to write the context into instead of a new one;
    ``libdevice``: the libdevice.10.bc this launch links instead of Triton's bundled copy."""
    if validate:
        check_attention_inputs(q, k, v, valid_token_mask, num_heads, causal)
        if q.dtype != torch.float16:
            raise TypeError(f"the faithful kernel is float16-only, got {q.dtype}")
    b, s, d = q.shape
    dh = d // num_heads
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()  # the kernel needs unit feature stride
    lanes = kernel_lanes(s)
    block_m = DEFAULT_BLOCK_M if block_m is None else block_m
    sub = DEFAULT_SUB if sub is None else sub
    if one_pass:
        if s > 4 * lanes:
            raise KKError(f"one_pass takes S <= {4 * lanes} (S = {s})")
        sub = 1 if s <= lanes else (2 if s <= 2 * lanes else 4)
        block_m = 64 if block_m is None else block_m
    if lanes < 32:
        sub = 1  # one iteration per lane: S <= 32
    ncached = 0
    if cached:
        if one_pass or s > 4 * lanes:
            raise KKError(f"cached takes S <= {4 * lanes} and not one_pass (S = {s})")
        sub = 1
        ncached = -(-s // lanes)
    dh_pad = max(16, 1 << (dh - 1).bit_length())
    if num_warps is None:
        num_warps = 8 if (dh_pad >= 256 or block_m >= 128 or one_pass) else 4
    if num_stages is None and dh_pad >= 256:
        num_stages = 2  # 3 stages of [64, 256] K and V tiles pass the H200's 227 KiB of shared memory
    ecache = bool(ecache) and not (one_pass or cached)
    e_cache, e_chunks, grid = None, 0, (triton.cdiv(s, block_m), b * num_heads)
    slots = {}
    if ecache:
        if debug:
            raise KKError("ecache keeps no scores for debug tensors: launch without ecache to debug")
        if ecache_slots:
            programs = min(grid[0] * grid[1], 2 if INTERPRET else int(ecache_slots) * multiprocessors(q.device))
            e_chunks = -(-s // (lanes * sub))  # a slot holds the longest row block's chunks
            slots = dict(SLOTS=True, BH=b * num_heads, NUM_PROGRAMS=programs)
            grid = (programs, )
            need = programs * e_chunks * block_m * lanes * sub * 4
        else:
            e_chunks = ecache_chunks(s, block_m, lanes * sub, causal)
            need = b * num_heads * e_chunks * block_m * lanes * sub * 4
        if need > ECACHE_MAX_BYTES:
            raise KKError(f"ecache needs {need / 2**30:.1f} GiB of scratch at (B*H {b * num_heads}, S {s}), more than "
                          f"{ECACHE_MAX_BYTES / 2**30:g} GiB: use a launch without ecache")
        e_cache = torch.empty(need // 4, dtype=torch.float32, device=q.device)  # per call: these are study launches
    if out is None:
        out = torch.empty((b, s, d), dtype=q.dtype, device=q.device)
    if debug:
        scores = torch.full((b, num_heads, s, s), float("-inf"), dtype=q.dtype, device=q.device)
        probs = torch.zeros((b, num_heads, s, s), dtype=q.dtype, device=q.device)
    else:
        scores = probs = out  # never written
    has_mask = valid_token_mask is not None
    mask = valid_token_mask if has_mask else q
    stride_mb, stride_ms = (mask.stride(0), mask.stride(1)) if has_mask else (0, 0)
    scale = fp32_scale(dh)  # what ATen multiplies by (exact in fp32, so Triton's fp32 argument keeps it)
    launch = dict(num_warps=num_warps)
    if max_registers and not INTERPRET:
        launch["maxnreg"] = int(max_registers)
    if num_stages is not None:
        launch["num_stages"] = num_stages
    if not INTERPRET:
        launch.update(COMPILE_FLAGS)
        launch.update(launch_options())  # inside dependent_launches(True): PDL
        if libdevice:
            launch["extern_libs"] = {"libdevice": libdevice}
    launch_kernel(_faithful_attention_kernel, grid,
        q, k, v, mask, out, scores, probs,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        stride_mb, stride_ms,
        s, num_heads, scale,
        HEAD_DIM=dh, DH_PAD=dh_pad, BLOCK_M=block_m, LANES=lanes, SUB=sub,
        CAUSAL=bool(causal), HAS_MASK=has_mask, ACCURATE=not INTERPRET, DEBUG=bool(debug), ONE_PASS=bool(one_pass),
        NCACHED=ncached, FAST_DIV=bool(fast_div), RAW_MAX=bool(raw_max) and not (one_pass or cached),
        INTERIOR=bool(interior) and not one_pass, ECACHE=ecache, E=e_cache, E_CHUNKS=e_chunks,
        **slots, **launch,
    )
    if debug:
        return out, scores, probs
    return out
