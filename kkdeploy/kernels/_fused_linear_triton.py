"""The Triton kernel behind ``kkdeploy_faithful::linear`` (imported lazily: it imports triton).

One program per [BLOCK_M, BLOCK_N] output tile. The GEMM is ``tl.dot`` with float16 inputs and a float32
accumulator, K walked in order (the tensor-core k16 steps chained on one accumulator, as cuBLAS' kernels do for
these sizes: no split-K); the bias is added to the float32 accumulator and the sum rounded to float16 once,
which is what ``F.linear``'s cuBLASLt bias epilogue computes (design.md §6: rounding before the bias moved 28% of
the elements). BLOCK_M is at least 64 so that the dot lowers to Hopper's wgmma: the attention kernel's launches
with BLOCK_M < 64 lower to mma.sync and were not bit-identical under padded masks (docs/faithful-attention.md).

Then one epilogue, each the reference's next elementwise ops on the rounded float16 ``y``, in its order:

* ``none``        ``y``
* ``gelu``        ATen's exact GELU: ``(f * 0.5) * (1 + erf(f * M_SQRT1_2))`` in float32, ``f = float(y)``,
                  rounded to float16 (``GeluCUDAKernelImpl``; libdevice's ``erff``, the function ATen calls)
* ``add_masked``  ``r + where(mask, y, 0)``: the attention block's residual (``x + zero_invalid_rows(out_proj)``)
* ``masked_sum``  ``where(mask, r + y, 0)``: the feed-forward residual and the block's ``zero_invalid_rows``

``triton_linear_layer_norm`` runs a residual epilogue and then the next LayerNorm of the rows it wrote (N = 128, a
tile holds whole rows), in ATen's order as ``kkdeploy.kernels.layer_norm.emulate_layer_norm_rows`` spells it out
(Welford pushes, the shuffle-down tree by reshape/split, nvcc's fmas as explicit ``tl.fma``). Equal to the
emulation under the interpreter; a build proves it on its GPU like every launch (docs/kernel-proofs.md).

A float16 add is ``float(a) + float(b)`` rounded once, as ATen's and Inductor's adds compute it. Compiled with
``enable_fp_fusion=False``: no multiply is contracted into an add anywhere in the epilogue.
Under ``TRITON_INTERPRET=1`` (CPU) libdevice does not exist: the kernel then uses ``tl.erf`` so that its *logic*
can be checked on a CPU (``tests/test_fused_linear.py``).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

try:  # the CUDA libdevice wrappers (absent or unusable under the interpreter)
    from triton.language.extra.cuda import libdevice as _libdevice
except ImportError:  # pragma: no cover - older layouts
    from triton.language.extra import libdevice as _libdevice

from .fused_linear import (LN_WIDTHS, MAX_GRID_Y, TMA_ALIGNMENT,  # LayerNorm rows; TMA; the grid
                           auto_block_n, multiprocessors, tma_fits)
from .dependent_launch import launch_options
from .libdevice import gelu_libdevice
from .precompile import launch as launch_kernel  # compile-only inside precompile.parallel_compiles

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

EPILOGUE_CODES = {"none": 0, "gelu": 1, "add_masked": 2, "masked_sum": 3}
#: the residual epilogues followed by the next LayerNorm over the tile's rows (N == BLOCK_N: whole rows)
LN_EPILOGUE_CODES = {"add_masked": 4, "masked_sum": 5}
#: compile options that keep the arithmetic IEEE: no fmul+fadd contraction, libdevice without FTZ.
COMPILE_FLAGS = dict(enable_fp_fusion=False, enable_reflect_ftz=False)


@triton.jit
def _erf(x, ACCURATE: tl.constexpr):
    if ACCURATE:
        y = _libdevice.erf(x)  # __nv_erff: the erff ATen's GELU calls
    else:
        y = tl.erf(x)  # interpreter only
    return y


@triton.jit
def _gelu16(v, ACCURATE: tl.constexpr):
    """ATen's exact GELU of float16 values v: (f * 0.5) * (1 + erf(f * M_SQRT1_2)) in float32, rounded to float16."""
    f = v.to(tl.float32)
    return ((f * 0.5) * (1.0 + _erf(f * 0.7071067811865476, ACCURATE))).to(tl.float16)


@triton.jit
def _reciprocal(t):
    return tl.math.div_rn(tl.full(t.shape, 1.0, tl.float32), t)  # RN(1/t): nvcc's rcp.rn.f32 for ATen's 1.f / n


@triton.jit
def _welford_push(value, mean, m2, count):
    """ATen's per-element Welford step as nvcc compiles it: mean = fma(delta, RN(1/count), mean), m2 = fma(delta,
    value - mean, m2)."""
    delta = value - mean
    count = count + 1.0
    mean = tl.fma(delta, _reciprocal(count), mean)
    m2 = tl.fma(delta, value - mean, m2)
    return mean, m2, count


@triton.jit
def _welford_merge(own_mean, own_m2, own_count, other_mean, other_m2, other_count):
    """kk_welford::merge (csrc/welford.cuh) as nvcc compiles it (zeros where the merged count is 0)."""
    total = other_count + own_count
    coef = _reciprocal(total)
    n_own = own_count * coef
    delta = own_mean - other_mean
    mean = tl.fma(coef * other_count, other_mean, own_mean * n_own)
    m2 = tl.fma(delta * delta * other_count, n_own, own_m2 + other_m2)
    live = total > 0.0
    return tl.where(live, mean, 0.0), tl.where(live, m2, 0.0), total


@triton.jit
def _lane_halves(t, BLOCK_M: tl.constexpr, W: tl.constexpr):
    """[BLOCK_M, 2W] -> (lanes 0..W-1, lanes W..2W-1), each [BLOCK_M, W]."""
    return tl.split(tl.permute(tl.reshape(t, (BLOCK_M, 2, W)), (0, 2, 1)))


@triton.jit
def _shuffle_down_step(mean, m2, count, BLOCK_M: tl.constexpr, W: tl.constexpr):
    """One level of ATen's shuffle-down tree: lane i (< W) merges lane i + W."""
    mean_lo, mean_hi = _lane_halves(mean, BLOCK_M, W)
    m2_lo, m2_hi = _lane_halves(m2, BLOCK_M, W)
    count_lo, count_hi = _lane_halves(count, BLOCK_M, W)
    return _welford_merge(mean_lo, m2_lo, count_lo, mean_hi, m2_hi, count_hi)


@triton.jit
def _rows_mean_rstd(mean, m2, count, eps, LN_N: tl.constexpr, BLOCK_M: tl.constexpr, ACCURATE: tl.constexpr):
    """The end of ATen's row statistics from lane 0's Welford state [BLOCK_M, 1]: the merges with ATen's idle warps,
    var = m2 / LN_N and rstd = rsqrt(var + eps); returns (mean, rstd), each [BLOCK_M]."""
    mean = tl.reshape(mean, (BLOCK_M, ))
    m2 = tl.reshape(m2, (BLOCK_M, ))
    count = tl.reshape(count, (BLOCK_M, ))
    empty = tl.zeros((BLOCK_M, ), tl.float32)
    mean, m2, count = _welford_merge(mean, m2, count, empty, empty, empty)  # ATen's idle warps, as ATen merges them
    pair_mean, pair_m2, pair_count = _welford_merge(empty, empty, empty, empty, empty, empty)
    mean, m2, count = _welford_merge(mean, m2, count, pair_mean, pair_m2, pair_count)
    var = tl.math.div_rn(m2, tl.full((BLOCK_M, ), LN_N, tl.float32))
    if ACCURATE:
        rstd = _libdevice.rsqrt(var + eps)  # rsqrt.approx.f32, as nvcc's rsqrtf
    else:
        rstd = tl.math.rsqrt(var + eps)  # interpreter only
    return mean, rstd


@triton.jit
def _ln_affine(G, B, LN_N: tl.constexpr):
    """The LayerNorm's weight and bias as float32 [32, 4] ([lane t, k]: element 4t + k; zeros past the row)."""
    offs = tl.arange(0, 32)[:, None] * 4 + tl.arange(0, 4)[None, :]
    g = tl.load(G + offs, mask=offs < LN_N, other=0.0).to(tl.float32)
    b = tl.load(B + offs, mask=offs < LN_N, other=0.0).to(tl.float32)
    return g, b


@triton.jit
def _rows_stats(v, eps, LN_N: tl.constexpr, BLOCK_M: tl.constexpr, ACCURATE: tl.constexpr):
    """The statistics of ``_rows_layer_norm`` (its arguments' meaning): (mean, rstd), each [BLOCK_M], in ATen's
    order."""
    x4 = tl.reshape(v, (BLOCK_M, 32, 2, 2))  # [row, lane t, hi, lo]: element 4t + 2 hi + lo
    lo0, lo1 = tl.split(x4)
    e0, e2 = tl.split(lo0)
    e1, e3 = tl.split(lo1)
    zero = tl.zeros((BLOCK_M, 32), tl.float32)
    mean, m2, count = _welford_push(e0, zero, zero, zero)
    mean, m2, count = _welford_push(e1, mean, m2, count)
    mean, m2, count = _welford_push(e2, mean, m2, count)
    mean, m2, count = _welford_push(e3, mean, m2, count)
    if LN_N < 128:  # lanes past the row pushed nothing: their states stay {0, 0, 0}
        has = (tl.arange(0, 32) < LN_N // 4)[None, :]
        mean = tl.where(has, mean, 0.0)
        m2 = tl.where(has, m2, 0.0)
        count = tl.where(has, count, 0.0)
    mean, m2, count = _shuffle_down_step(mean, m2, count, BLOCK_M, 16)
    mean, m2, count = _shuffle_down_step(mean, m2, count, BLOCK_M, 8)
    mean, m2, count = _shuffle_down_step(mean, m2, count, BLOCK_M, 4)
    mean, m2, count = _shuffle_down_step(mean, m2, count, BLOCK_M, 2)
    mean, m2, count = _shuffle_down_step(mean, m2, count, BLOCK_M, 1)
    mean, rstd = _rows_mean_rstd(mean, m2, count, eps, LN_N, BLOCK_M, ACCURATE)
    return mean, rstd


@triton.jit
def _rows_layer_norm(v, G, B, eps, LN_N: tl.constexpr, BLOCK_M: tl.constexpr, ACCURATE: tl.constexpr,
                     g=None, b=None):
    """ATen's float16 LayerNorm of each row of v [BLOCK_M, 32, 4] (float32 holding float16 values; [row, lane t,
    k] is element 4t + k of a row of LN_N; lanes t >= LN_N / 4 hold nothing), in the order of
    ``kkdeploy.kernels.layer_norm.emulate_layer_norm_rows``: a Welford push per element, the shuffle-down tree over
    the 32 lanes, two merges with empty states, var = m2 / LN_N, rstd = rsqrt(var + eps), y = fma(g, rstd * (x -
    mean), b); returns float16 [BLOCK_M, 32, 4] (lanes past the row: don't care). ``g``, ``b``: the weight and bias
    already loaded (``_ln_affine``), else they are loaded here, after the statistics."""
    mean, rstd = _rows_stats(v, eps, LN_N, BLOCK_M, ACCURATE)
    if g is None:
        g, b = _ln_affine(G, B, LN_N)
    return tl.fma(g[None, :, :], rstd[:, None, None] * (v - mean[:, None, None]), b[None, :, :]).to(tl.float16)


@triton.jit
def _prologue_stats(X, offs_m, row_ok, stride_xm, eps, LN_N: tl.constexpr, BLOCK_M: tl.constexpr,
                    ACCURATE: tl.constexpr):
    """The LayerNorm prologue's statistics of rows ``offs_m`` of X (rows of LN_N <= 128): the whole rows loaded in
    ``_rows_layer_norm``'s [row, lane, 4] layout, as the entry launch of the layer kernels loads them."""
    lane_k = tl.arange(0, 32)[:, None] * 4 + tl.arange(0, 4)[None, :]  # [lane, k]: column 4 lane + k
    in_row = row_ok[:, None, None] & (lane_k < LN_N)[None, :, :]
    v3 = tl.load(X + offs_m[:, None, None] * stride_xm + lane_k[None, :, :], mask=in_row, other=0.0)
    return _rows_stats(v3.to(tl.float32), eps, LN_N, BLOCK_M, ACCURATE)


@triton.jit
def _normalized_columns(a, mean, rstd, G, B, kk, K):
    """Columns ``kk`` of the rows' LayerNorm, from their float16 values ``a`` [rows, len(kk)] and the rows'
    statistics: ``_rows_layer_norm``'s fma(g, rstd * (x - mean), b) element by element, rounded to float16."""
    in_k = kk < K
    g = tl.load(G + kk, mask=in_k, other=0.0).to(tl.float32)
    b = tl.load(B + kk, mask=in_k, other=0.0).to(tl.float32)
    return tl.fma(g[None, :], rstd[:, None] * (a.to(tl.float32) - mean[:, None]), b[None, :]).to(tl.float16)


@triton.jit
def _fused_linear_kernel(
    X, W, B, R, MASK, OUT,
    M, N, K,
    stride_xm, stride_wn, stride_rm, stride_om,
    EPILOGUE: tl.constexpr, HAS_MASK: tl.constexpr, ACCURATE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    LN_G=None, LN_B=None, OUT2=None, eps=0.0, LN_RELOAD: tl.constexpr = False, A_GELU: tl.constexpr = False,
    LN_ZERO_INVALID: tl.constexpr = False, PDL: tl.constexpr = False, COLUMNS_FIRST: tl.constexpr = False,
    EARLY: tl.constexpr = False, LN_EARLY: tl.constexpr = False, A_LN: tl.constexpr = 0,
):
    """``A_LN``: the LayerNorm prologue over rows of A_LN = K (``_linear_tile``), with LN_G, LN_B and eps the
    LayerNorm's (no LayerNorm epilogue then).

    ``COLUMNS_FIRST``: the grid is (column tiles, row tiles), so the column tiles of one row block are launched
    one after another and read its rows of X while they are in L2. With rows first, a launch of N > BLOCK_N whose X
    outgrows L2 (shape 6's Q|K|V: 328 MB of X, three column tiles) reads X from memory once per column tile. Which
    program computes which tile is all that changes.

    ``EARLY``: the epilogue's operands (bias, residual, mask) are loaded before the k-loop, so their loads are in
    flight with the GEMM's instead of after it (``_linear_tile``); ``LN_EARLY``: the LayerNorm epilogue's weight and
    bias too (the register tiles)."""
    if PDL:  # a dependent launch (kernels/dependent_launch.py): every earlier kernel's writes first, then the next's start
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    if COLUMNS_FIRST:
        pid_m = tl.program_id(1)
        pid_n = tl.program_id(0)
    else:
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    _linear_tile(X, W, B, R, MASK, OUT, offs_m, offs_n, offs_m < M, offs_n < N, N, K,
                 stride_xm, stride_wn, stride_rm, stride_om, EPILOGUE, HAS_MASK, ACCURATE, BLOCK_M, BLOCK_N, BLOCK_K,
                 LN_G, LN_B, OUT2, eps, LN_RELOAD, A_GELU, LN_ZERO_INVALID, EARLY, LN_EARLY, A_LN)


@triton.jit
def _fused_linear_tma_kernel(
    XD, WD, B, R, MASK, OUT,
    M, N, K,
    stride_rm, stride_om,
    EPILOGUE: tl.constexpr, HAS_MASK: tl.constexpr, ACCURATE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    A_GELU: tl.constexpr = False, PDL: tl.constexpr = False, WS: tl.constexpr = False,
):
    """``_fused_linear_kernel``'s tile with its operands brought in by Hopper's tensor memory accelerator (TMA):
    ``XD`` and ``WD`` describe X [M, K] and W [N, K], and each k-step copies a [BLOCK_M, BLOCK_K] and a [BLOCK_N,
    BLOCK_K] box into shared memory without the threads computing addresses (rows and columns past the end arrive as
    zeros, as the masked loads' ``other``). The accumulation is the same: ``tl.dot`` over K in order on one float32
    accumulator, then the same epilogue (no LayerNorm epilogue here).

    ``WS``: the k-loop warp-specialized (Triton's Hopper pass): one warpgroup issues the copies, and the ``num_warps``
    warps given become each consumer warpgroup, ``BLOCK_M // 64`` of them, each with its own 64 rows. That is
    cuBLAS's cooperative layout for the GEMMs it runs faster than our tiles at K = 1024 (a producer and two
    consumer warpgroups of a 128-row tile). Each consumer's rows see the same k16 wgmma chain as the plain tile's."""
    if PDL:  # a dependent launch (kernels/dependent_launch.py): every earlier kernel's writes first, then the next's start
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    _tma_tile(XD, WD, B, R, MASK, OUT, tl.program_id(0) * BLOCK_M, tl.program_id(1) * BLOCK_N, M, N, K, stride_rm,
              stride_om, EPILOGUE, HAS_MASK, ACCURATE, BLOCK_M, BLOCK_N, BLOCK_K, A_GELU, WS)


@triton.jit
def _tma_tile(XD, WD, B, R, MASK, OUT, m0, n0, M, N, K, stride_rm, stride_om,
              EPILOGUE: tl.constexpr, HAS_MASK: tl.constexpr, ACCURATE: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, A_GELU: tl.constexpr,
              WS: tl.constexpr = False):
    """The output tile at rows m0.. and columns n0..: TMA copies of X and W per k-step, K in order on one float32
    accumulator, then the epilogue (shared by the TMA kernel and its persistent form). ``WS``: the same loop,
    warp-specialized (``_fused_linear_tma_kernel``)."""
    offs_m = (m0 + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, warp_specialize=WS):  # K in order, one accumulator; WS: copies in own warps
        a = XD.load([m0, k0])
        if A_GELU:  # the GELU prologue, as in the pointer-load tile
            a = _gelu16(a, ACCURATE)
        w = WD.load([n0, k0])
        acc = tl.dot(a, tl.trans(w), acc)
    _linear_epilogue(acc, B, R, MASK, OUT, offs_m, offs_n, offs_m < M, offs_n < N, N, stride_rm, stride_om,
                     EPILOGUE, HAS_MASK, ACCURATE, BLOCK_M, BLOCK_N, None, None, None, 0.0, False, False)


@triton.jit
def _fused_linear_tma_persistent_kernel(
    XD, WD, B, R, MASK, OUT,
    M, N, K,
    stride_rm, stride_om,
    EPILOGUE: tl.constexpr, HAS_MASK: tl.constexpr, ACCURATE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_PROGRAMS: tl.constexpr,
    GROUP_M: tl.constexpr = 8, A_GELU: tl.constexpr = False, PDL: tl.constexpr = False,
):
    """``_fused_linear_tma_kernel``'s tiles from one program per multiprocessor (NUM_PROGRAMS), each walking tiles
    ``pid, pid + NUM_PROGRAMS, ...`` (GROUP_M rows of tiles at a time, so neighbouring programs share W's columns in
    L2): no block scheduling per tile, as cuBLAS's persistent kernels. Each tile's arithmetic is the TMA tile's: K in
    order on one float32 accumulator, then the same epilogue (compiled for sm_90a: the same floating-point
    instructions, as many of each). The loops stay nested: ``tl.range(..., flatten=True)``, which would overlap the
    next tile's copies with this one's epilogue, makes Triton 3.6 add ``add.rn.f16 y, +0`` after the bias's rounding,
    which turns a -0.0 into +0.0: not the tile's arithmetic."""
    if PDL:  # a dependent launch (kernels/dependent_launch.py): every earlier kernel's writes first, then the next's start
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    in_group = GROUP_M * num_n
    for tile in range(tl.program_id(0), num_m * num_n, NUM_PROGRAMS):
        first_m = (tile // in_group) * GROUP_M
        group_m = tl.minimum(num_m - first_m, GROUP_M)
        _tma_tile(XD, WD, B, R, MASK, OUT, (first_m + (tile % group_m)) * BLOCK_M,
                  ((tile % in_group) // group_m) * BLOCK_N, M, N, K, stride_rm, stride_om,
                  EPILOGUE, HAS_MASK, ACCURATE, BLOCK_M, BLOCK_N, BLOCK_K, A_GELU)


@triton.jit
def _linear_tile(X, W, B, R, MASK, OUT, offs_m, offs_n, row_ok, col_ok, N, K,
                 stride_xm, stride_wn, stride_rm, stride_om,
                 EPILOGUE: tl.constexpr, HAS_MASK: tl.constexpr, ACCURATE: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 LN_G, LN_B, OUT2, eps, LN_RELOAD: tl.constexpr, A_GELU: tl.constexpr, LN_ZERO_INVALID: tl.constexpr,
                 EARLY: tl.constexpr = False, LN_EARLY: tl.constexpr = False, A_LN: tl.constexpr = 0):
    """One [BLOCK_M, BLOCK_N] output tile at rows ``offs_m`` (int64; ``row_ok`` which exist) and columns
    ``offs_n``: the GEMM, the bias, the epilogue and, for EPILOGUE >= 4, the rows' next LayerNorm. The kernel above
    is one tile per program; ``_layer_triton`` runs the same tiles one after another inside a whole layer.

    ``EARLY``: the epilogue's operands are loaded before the k-loop. Where a launch is a few microseconds (the
    launch-bound shapes' tiles), the loads after the loop are one more round trip to L2 on its critical path; loaded
    first, they travel with the GEMM's operands. What is computed, and in which order, does not change; the values
    stay live in registers across the loop, so tiles that stream many rows (where registers bound the programs per
    multiprocessor) keep the late loads. ``LN_EARLY`` (the LayerNorm epilogue in registers; ignored where the rows
    are read back): the LayerNorm's weight and bias too, which otherwise are loaded after the rows' statistics, one
    round trip to L2 between the last reduction and the stores.

    ``A_LN`` (rows of A_LN = K <= 128, EPILOGUE < 4): the GEMM reads the rows' LayerNorm (weight LN_G, bias LN_B,
    eps), the norm before a Linear (norm2 before ffn_in, norm1 before Q|K|V) without its output ever reaching memory.
    Each row's statistics come first, from the whole row in ``_rows_layer_norm``'s layout and order; each k-step's
    columns are then normalized as ``_rows_layer_norm`` normalizes them (``_normalized_columns``) and rounded to
    float16, so the dot sees the LayerNorm launch's output element for element, in the proven k-steps."""
    offs_k = tl.arange(0, BLOCK_K)
    if A_LN:
        ln_mean, ln_rstd = _prologue_stats(X, offs_m, row_ok, stride_xm, eps, A_LN, BLOCK_M, ACCURATE)
    else:
        ln_mean, ln_rstd = None, None
    if EARLY:
        bias, r, valid = _epilogue_operands(B, R, MASK, offs_m, offs_n, row_ok, col_ok, stride_rm, EPILOGUE, HAS_MASK)
    else:
        bias, r, valid = None, None, None
    if LN_EARLY and EPILOGUE >= 4 and not LN_RELOAD:
        ln_g, ln_b = _ln_affine(LN_G, LN_B, BLOCK_N)
    else:
        ln_g, ln_b = None, None

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):  # K in order, one accumulator
        kk = k0 + offs_k
        a = tl.load(X + offs_m[:, None] * stride_xm + kk[None, :], mask=row_ok[:, None] & (kk[None, :] < K), other=0.0)
        if A_GELU:  # the GELU prologue: the input is ffn_in's output and the GEMM reads GELU(it), rounded to float16
            a = _gelu16(a, ACCURATE)
        if A_LN:  # the LayerNorm prologue: these columns of the rows' LayerNorm, rounded to float16
            a = _normalized_columns(a, ln_mean, ln_rstd, LN_G, LN_B, kk, K)
        w = tl.load(W + offs_n[:, None] * stride_wn + kk[None, :], mask=col_ok[:, None] & (kk[None, :] < K), other=0.0)
        acc = tl.dot(a, tl.trans(w), acc)
    _linear_epilogue(acc, B, R, MASK, OUT, offs_m, offs_n, row_ok, col_ok, N, stride_rm, stride_om,
                     EPILOGUE, HAS_MASK, ACCURATE, BLOCK_M, BLOCK_N, LN_G, LN_B, OUT2, eps, LN_RELOAD, LN_ZERO_INVALID,
                     EARLY, bias, r, valid, ln_g, ln_b)


@triton.jit
def _epilogue_operands(B, R, MASK, offs_m, offs_n, row_ok, col_ok, stride_rm,
                       EPILOGUE: tl.constexpr, HAS_MASK: tl.constexpr):
    """What the epilogue reads besides the accumulator, loaded ahead of it (``EARLY``): the bias (float32) and, for
    EPILOGUE >= 2, the residual tile and the rows' validity, each loaded as the epilogue loads it."""
    bias = tl.load(B + offs_n, mask=col_ok, other=0.0).to(tl.float32)
    r = 0.0  # placeholders where the epilogue reads no residual (never read)
    valid = row_ok
    if EPILOGUE >= 2:
        r, valid = _residual_operands(R, MASK, offs_m, offs_n, row_ok, col_ok, stride_rm, HAS_MASK)
    return bias, r, valid


@triton.jit
def _residual_operands(R, MASK, offs_m, offs_n, row_ok, col_ok, stride_rm, HAS_MASK: tl.constexpr):
    """The residual tile and the rows' validity (the mask's rows, or the rows that exist)."""
    r = tl.load(R + offs_m[:, None] * stride_rm + offs_n[None, :], mask=row_ok[:, None] & col_ok[None, :], other=0.0)
    if HAS_MASK:
        valid = tl.load(MASK + offs_m, mask=row_ok, other=0) != 0
    else:
        valid = row_ok
    return r, valid


@triton.jit
def _linear_epilogue(acc, B, R, MASK, OUT, offs_m, offs_n, row_ok, col_ok, N, stride_rm, stride_om,
                     EPILOGUE: tl.constexpr, HAS_MASK: tl.constexpr, ACCURATE: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     LN_G, LN_B, OUT2, eps, LN_RELOAD: tl.constexpr, LN_ZERO_INVALID: tl.constexpr,
                     LOADED: tl.constexpr = False, bias_loaded=None, r_loaded=None, valid_loaded=None,
                     g_loaded=None, b_loaded=None):
    """The tile's float32 accumulator to its outputs: the bias, the epilogue, the store and, for EPILOGUE >= 4, the
    rows' next LayerNorm (shared by the pointer-load tile above and the TMA kernel below). ``LOADED``: the bias,
    residual and validity come in already loaded (``_epilogue_operands``); otherwise each is loaded where it is first
    needed, as the proven tiles always have. ``g_loaded``, ``b_loaded``: the LayerNorm's weight and bias loaded
    already (the register path; else None)."""
    if LOADED:
        bias = bias_loaded
    else:
        bias = tl.load(B + offs_n, mask=col_ok, other=0.0).to(tl.float32)
    y = (acc + bias[None, :]).to(tl.float16)  # the bias inside the float32 accumulator, one rounding

    if EPILOGUE == 1:  # exact GELU, ATen's expression order
        out = _gelu16(y, ACCURATE)
    elif EPILOGUE >= 2:
        if LOADED:
            r = r_loaded
            valid = valid_loaded
        else:
            r, valid = _residual_operands(R, MASK, offs_m, offs_n, row_ok, col_ok, stride_rm, HAS_MASK)
        zero = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float16)
        if EPILOGUE == 2 or EPILOGUE == 4:  # r + where(mask, y, 0)
            out = (r.to(tl.float32) + tl.where(valid[:, None], y, zero).to(tl.float32)).to(tl.float16)
        else:  # where(mask, r + y, 0)
            out = tl.where(valid[:, None], (r.to(tl.float32) + y.to(tl.float32)).to(tl.float16), zero)
    else:
        out = y
    tl.store(OUT + offs_m[:, None] * stride_om + offs_n[None, :], out, mask=row_ok[:, None] & col_ok[None, :])
    if EPILOGUE >= 4:  # the next LayerNorm of the rows just written (BLOCK_N == N: whole rows in the tile)
        if LN_RELOAD:  # read the rows back as [row, lane, 4]: the accumulator's registers are free by then
            tl.debug_barrier()  # this block's stores are visible to all its threads after the barrier
            lane_k = tl.arange(0, 32)[:, None] * 4 + tl.arange(0, 4)[None, :]  # [lane, k]: column 4 lane + k
            offs3 = offs_m[:, None, None] * stride_om + lane_k[None, :, :]
            in_row = row_ok[:, None, None] & (lane_k < N)[None, :, :]
            v3 = tl.load(OUT + offs3, mask=in_row, other=0.0).to(tl.float32)
            normed = _rows_layer_norm(v3, LN_G, LN_B, eps, BLOCK_N, BLOCK_M, ACCURATE)
            if LN_ZERO_INVALID:  # the model's last LayerNorm: zero_invalid_rows after final_norm
                normed = tl.where(valid[:, None, None], normed, 0.0)
            tl.store(OUT2 + offs3, normed, mask=in_row)
        else:  # BLOCK_N == 128: the accumulator's tile regrouped in registers
            v3 = tl.reshape(out.to(tl.float32), (BLOCK_M, 32, 4))
            normed = tl.reshape(_rows_layer_norm(v3, LN_G, LN_B, eps, BLOCK_N, BLOCK_M, ACCURATE, g_loaded, b_loaded),
                                (BLOCK_M, 128))
            if LN_ZERO_INVALID:
                normed = tl.where(valid[:, None], normed, 0.0)
            tl.store(OUT2 + offs_m[:, None] * stride_om + offs_n[None, :], normed, mask=row_ok[:, None])


@triton.jit
def _fused_ffn_kernel(
    X, W1, B1, W2, B2, R, MASK, OUT, LN_G, LN_B, OUT2,
    M, F, D,
    stride_xm, stride_w1, stride_w2, stride_rm, stride_om, eps,
    HAS_MASK: tl.constexpr, ACCURATE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_F: tl.constexpr, BLOCK_K: tl.constexpr,
    LN_RELOAD: tl.constexpr, LN_ZERO_INVALID: tl.constexpr, PDL: tl.constexpr = False,
    WQ=None, BQ=None, QKV=None, stride_wq=0, stride_qm=0, QKV_NEXT: tl.constexpr = False,
):
    """The whole feed-forward of BLOCK_M rows in one program: ffn_in, GELU, ffn_out, the residual and mask, and the
    next LayerNorm. BLOCK_N == D: the program holds whole rows (the LayerNorm epilogue needs them), so each of
    ffn_in's outputs is computed once, by the program that owns its row, and never reaches memory.

    Per chunk of BLOCK_F of ffn_in's columns: ``g = dot(x_rows, W1[chunk]^T)`` over K = D in order on a fresh float32
    accumulator (ffn_in's tile for those columns), the bias, one rounding to float16, ATen's GELU rounded to float16
    (the GELU prologue's arithmetic), and then ``acc = dot(gelu, W2[:, chunk]^T, acc)``: ffn_out's k16 chain over F in
    order on one accumulator, chunk after chunk, as its own tile walks K. Then ``_linear_epilogue`` with
    ``masked_sum`` and the LayerNorm (code 5), as ffn_out's LayerNorm launch. Columns of ffn_in past F come out as
    GELU(0 + 0) = 0 and meet W2's masked zeros: they add nothing.

    ``QKV_NEXT``: then the next block's packed Q|K|V of the rows just normalized, ``WQ`` [3D, D] and ``BQ`` [3D] into
    ``QKV`` [M, 3D]: the rows read back (the program's own stores, behind a barrier) and three column tiles of D, each
    the GEMM tile's arithmetic (K = D in order, the bias in the float32 accumulator, one rounding)."""
    if PDL:  # a dependent launch (kernels/dependent_launch.py): earlier kernels' writes first, then the next's start
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    offs_m = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_n = tl.arange(0, BLOCK_N)
    row_ok = offs_m < M
    col_ok = offs_n < D
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for f0 in range(0, F, BLOCK_F):  # F in order: ffn_out's K
        offs_f = f0 + tl.arange(0, BLOCK_F)
        f_ok = offs_f < F
        g = tl.zeros((BLOCK_M, BLOCK_F), dtype=tl.float32)
        for k0 in range(0, D, BLOCK_K):  # K = D in order, in the k-steps of ffn_in's own tile
            kk = k0 + offs_k
            a = tl.load(X + offs_m[:, None] * stride_xm + kk[None, :], mask=row_ok[:, None] & (kk < D)[None, :],
                        other=0.0)
            w1 = tl.load(W1 + offs_f[:, None] * stride_w1 + kk[None, :], mask=f_ok[:, None] & (kk < D)[None, :],
                         other=0.0)
            g = tl.dot(a, tl.trans(w1), g)
        b1 = tl.load(B1 + offs_f, mask=f_ok, other=0.0).to(tl.float32)
        h = _gelu16((g + b1[None, :]).to(tl.float16), ACCURATE)  # ffn_in's output rounded once, then ATen's GELU
        w2 = tl.load(W2 + offs_n[:, None] * stride_w2 + offs_f[None, :], mask=col_ok[:, None] & f_ok[None, :],
                     other=0.0)
        acc = tl.dot(h, tl.trans(w2), acc)
    _linear_epilogue(acc, B2, R, MASK, OUT, offs_m, offs_n, row_ok, col_ok, D, stride_rm, stride_om,
                     5, HAS_MASK, ACCURATE, BLOCK_M, BLOCK_N, LN_G, LN_B, OUT2, eps, LN_RELOAD, LN_ZERO_INVALID)
    if QKV_NEXT:
        tl.debug_barrier()  # this block's stores of the normalized rows are visible to all its threads after it
        for n0 in range(0, 3 * D, BLOCK_N):  # Q, K, V: a column tile of D each
            q = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k0 in range(0, D, BLOCK_K):  # K = D in order, in the packed Q|K|V tile's k-steps
                kk = k0 + offs_k
                rows = tl.load(OUT2 + offs_m[:, None] * stride_om + kk[None, :],
                               mask=row_ok[:, None] & (kk < D)[None, :], other=0.0)
                wq = tl.load(WQ + (n0 + offs_n)[:, None] * stride_wq + kk[None, :],
                             mask=col_ok[:, None] & (kk < D)[None, :], other=0.0)
                q = tl.dot(rows, tl.trans(wq), q)
            bq = tl.load(BQ + n0 + offs_n, mask=col_ok, other=0.0).to(tl.float32)
            tl.store(QKV + offs_m[:, None] * stride_qm + (n0 + offs_n)[None, :], (q + bq[None, :]).to(tl.float16),
                     mask=row_ok[:, None] & col_ok[None, :])


def ffn_launch_config(d: int, f: int) -> dict:
    """The feed-forward launch's defaults: 64 rows of 8 warps with the rows read back for the LayerNorm (the
    LayerNorm epilogue's default), ffn_in's columns 64 at a time (fewer for a narrow F)."""
    return dict(BLOCK_M=64, BLOCK_F=min(64, max(16, triton.next_power_of_2(f))),
                BLOCK_K=min(64, max(16, triton.next_power_of_2(d))), num_warps=8, num_stages=2, LN_RELOAD=True)


def triton_ffn_layer_norm(x: torch.Tensor, w_in: torch.Tensor, b_in: torch.Tensor, w_out: torch.Tensor,
                          b_out: torch.Tensor, residual: torch.Tensor, mask, ln_weight: torch.Tensor,
                          ln_bias: torch.Tensor, eps: float, zero_invalid: bool = False, qkv_weight=None,
                          qkv_bias=None, **overrides) -> tuple[torch.Tensor, torch.Tensor]:
    """The feed-forward of rows x [..., D] in one launch (``_fused_ffn_kernel``): returns (``where(mask, residual +
    ffn_out(GELU(ffn_in(x))), 0)``, its LayerNorm), both [..., D] float16, D one of LN_WIDTHS. ``zero_invalid``:
    the LayerNorm's invalid rows zeroed too (the model's final_norm). With ``qkv_weight`` [3D, D] and ``qkv_bias``
    [3D]: the second output is the next block's packed Q|K|V of the LayerNorm's rows [..., 3D] instead."""
    f, d = w_in.shape
    if d not in LN_WIDTHS or tuple(w_out.shape) != (d, f):
        raise ValueError(f"the feed-forward launch takes rows of {', '.join(map(str, LN_WIDTHS))} with ffn_in [F, D] "
                         f"and ffn_out [D, F]; got {list(w_in.shape)} and {list(w_out.shape)}")
    x2, w_in, w_out = _rows(x, d), w_in.contiguous(), w_out.contiguous()
    m = x2.shape[0]
    out = torch.empty((*x.shape[:-1], d), dtype=torch.float16, device=x.device)
    normed = torch.empty_like(out)
    out2, normed2 = out.view(-1, d), normed.view(-1, d)
    r2 = _rows(residual, d)
    has_mask = mask is not None
    mask1 = _row_mask(mask, has_mask, out2)
    config = {**ffn_launch_config(d, f), **overrides}
    if d < 128:
        config["LN_RELOAD"] = True  # rows under 128 are always read back (the lanes past the row are masked there)
    config, launch = _launch_options(config, gelu=True)
    qkv = {}
    if qkv_weight is not None:
        qkv_weight = qkv_weight.contiguous()
        if tuple(qkv_weight.shape) != (3 * d, d) or tuple(qkv_bias.shape) != (3 * d, ):
            raise ValueError(f"the next Q|K|V takes a weight [{3 * d}, {d}] and a bias [{3 * d}], got "
                             f"{list(qkv_weight.shape)} and {list(qkv_bias.shape)}")
        packed_out = torch.empty((*x.shape[:-1], 3 * d), dtype=torch.float16, device=x.device)
        qkv = dict(WQ=qkv_weight, BQ=qkv_bias, QKV=packed_out.view(-1, 3 * d), stride_wq=qkv_weight.stride(0),
                   stride_qm=3 * d, QKV_NEXT=True)
    launch_kernel(_fused_ffn_kernel, (triton.cdiv(m, config["BLOCK_M"]), ),
        x2, w_in, b_in, w_out, b_out, r2, mask1, out2, ln_weight.contiguous(), ln_bias.contiguous(), normed2,
        m, f, d,
        x2.stride(0), w_in.stride(0), w_out.stride(0), r2.stride(0), out2.stride(0), float(eps),
        HAS_MASK=has_mask, ACCURATE=not INTERPRET, BLOCK_N=d, LN_ZERO_INVALID=bool(zero_invalid), **qkv, **config,
        **launch,
    )
    return (out, qkv["QKV"].view(*x.shape[:-1], 3 * d)) if qkv else (out, normed)


def launch_config(n: int, k: int) -> dict:
    """Tile sizes for an [M, K] x [K, N] call: BLOCK_M 128 (>= 64 keeps wgmma), BLOCK_N the whole row up to 128,
    BLOCK_K up to 64. In principle the k16 chain is the same whatever BLOCK_K is; on an H100 one K = 128 dot inside the
    feed-forward launch gave other bits than the proven tiles' two k-steps of 64 (docs/fused-linear.md), so every
    launch keeps to steps of at most 64, and each tile is proven on its own anyway."""
    block_n = auto_block_n(n)
    block_k = min(64, max(16, triton.next_power_of_2(k)))
    return dict(BLOCK_M=128, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=8 if block_n >= 128 else 4, num_stages=3)


def _rows(t: torch.Tensor, width: int) -> torch.Tensor:
    """t [..., width] as [rows, width] with unit last stride (a view where it can be)."""
    t2 = t.reshape(-1, width)
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _row_mask(mask, used: bool, placeholder: torch.Tensor) -> torch.Tensor:
    """The rows' validity as one flat [rows] tensor the kernel indexes by row; ``placeholder`` (never read) where the
    launch takes no mask."""
    return mask.reshape(-1).contiguous() if used else placeholder


def _launch_options(config: dict, gelu: bool) -> tuple[dict, dict]:
    """Splits a tile's config into the kernel's constexprs and the launch's options, one rule for every launch of
    this module: warps and stages; the compile flags that keep the arithmetic IEEE (a tile may override them); PDL
    inside ``dependent_launches(True)``; and, where GELU runs, CUDA's libdevice for this launch only (ATen's erff;
    Triton's bundled copy differs on 151 float16 inputs). Under the interpreter only the constexprs are kept."""
    config = dict(config)
    launch = {key: config.pop(key) for key in ("num_warps", "num_stages") if key in config}
    flags = {key: config.pop(key, value) for key, value in COMPILE_FLAGS.items()}
    if not INTERPRET:
        launch.update(flags)
        launch.update(launch_options())
        libdevice = gelu_libdevice() if gelu else None
        if libdevice:
            launch["extern_libs"] = {"libdevice": libdevice}
    return config, launch


def _launch(x, weight, bias, residual, mask, code: int, config: dict, layer_norm=None, prologue_norm=None):
    """One launch of ``_fused_linear_kernel``; returns the [..., N] output and, with ``layer_norm`` = (weight, bias,
    eps), the rows' LayerNorm too. ``prologue_norm`` = (weight, bias, eps): the LayerNorm the GEMM reads its input
    through (``A_LN``). ``config``: tile sizes, warps, stages and compile-flag overrides."""
    n, k = weight.shape
    x2, weight = _rows(x, k), weight.contiguous()
    m = x2.shape[0]
    out = torch.empty((*x.shape[:-1], n), dtype=torch.float16, device=x.device)
    out2 = out.view(-1, n)
    r2 = _rows(residual, n) if code >= 2 else out2  # out2: never read
    has_mask = mask is not None and code >= 2
    mask1 = _row_mask(mask, has_mask, out2)
    config, launch = _launch_options(config, gelu=code == EPILOGUE_CODES["gelu"] or bool(config.get("A_GELU")))
    extra, normed = {}, None
    if layer_norm is not None:
        ln_weight, ln_bias, eps = layer_norm
        normed = torch.empty_like(out)
        extra = dict(LN_G=ln_weight.contiguous(), LN_B=ln_bias.contiguous(), OUT2=normed.view(-1, n), eps=float(eps))
    elif prologue_norm is not None:
        ln_weight, ln_bias, eps = prologue_norm
        extra = dict(LN_G=ln_weight.contiguous(), LN_B=ln_bias.contiguous(), eps=float(eps), A_LN=k)
    grid = (triton.cdiv(m, config["BLOCK_M"]), triton.cdiv(n, config["BLOCK_N"]))
    if config.get("COLUMNS_FIRST"):
        if config.get("TMA") or config.get("PERSISTENT"):
            raise ValueError("a columns-first grid is the pointer-load tile's only")
        if grid[0] > MAX_GRID_Y:
            raise ValueError(f"{grid[0]} row tiles: a columns-first grid takes at most {MAX_GRID_Y}")
        grid = grid[::-1]
    persistent = config.pop("PERSISTENT", False)
    specialized = config.pop("WS", False)
    if config.pop("TMA", False):
        if layer_norm is not None or prologue_norm is not None:
            raise ValueError("the TMA tile has no LayerNorm epilogue or prologue")
        xd, wd = tma_descriptors(x2, weight, config["BLOCK_M"], config["BLOCK_N"], config["BLOCK_K"])
        kernel, tiling = _fused_linear_tma_kernel, {}
        if persistent:  # one program per multiprocessor (two under the interpreter), never more than the tiles
            programs = max(1, min(2 if INTERPRET else multiprocessors(x.device), grid[0] * grid[1]))
            kernel, grid, tiling = _fused_linear_tma_persistent_kernel, (programs, ), dict(NUM_PROGRAMS=programs)
        elif specialized:
            tiling = dict(WS=True)
        launch_kernel(kernel, grid,
            xd, wd, bias, r2, mask1, out2,
            m, n, k,
            r2.stride(0), out2.stride(0),
            EPILOGUE=code, HAS_MASK=has_mask, ACCURATE=not INTERPRET, BLOCK_M=config["BLOCK_M"],
            BLOCK_N=config["BLOCK_N"], BLOCK_K=config["BLOCK_K"], A_GELU=bool(config.get("A_GELU")), **tiling,
            **launch,
        )
        return out, normed
    launch_kernel(_fused_linear_kernel, grid,
        x2, weight, bias, r2, mask1, out2,
        m, n, k,
        x2.stride(0), weight.stride(0), r2.stride(0), out2.stride(0),
        EPILOGUE=code, HAS_MASK=has_mask, ACCURATE=not INTERPRET, **config, **extra, **launch,
    )
    return out, normed


def tma_descriptors(x2: torch.Tensor, weight: torch.Tensor, block_m: int, block_n: int, block_k: int):
    """The host-side TMA descriptors of X [M, K] and W [N, K] for one launch. A view whose base or row stride is not
    16-byte aligned is copied first (the same values, so the same results); a K whose rows are not a multiple of 16
    bytes has no TMA tile (``tma_fits``)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    m, k = x2.shape
    if not tma_fits(k):
        raise ValueError(f"the TMA tile reads rows of a multiple of 8 float16 values, not {k}")
    if x2.data_ptr() % TMA_ALIGNMENT or (x2.stride(0) * x2.element_size()) % TMA_ALIGNMENT:
        x2 = x2.clone(memory_format=torch.contiguous_format)
    return (TensorDescriptor(x2, [m, k], [x2.stride(0), 1], [block_m, block_k]),
            TensorDescriptor(weight, list(weight.shape), [weight.stride(0), 1], [block_n, block_k]))


def triton_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, residual=None, mask=None,
                  epilogue: str = "none", prologue: str = "none", **overrides) -> torch.Tensor:
    """Launch the kernel on x [..., K] (unit last stride), weight [N, K], bias [N]; returns [..., N] float16.
    ``residual`` [..., N] and ``mask`` [...] (bool, the rows' validity) for the residual epilogues; ``prologue``
    "gelu": the GEMM's input is GELU(x) (ffn_out reading ffn_in's output)."""
    n, k = weight.shape
    gelu_in = prologue == "gelu"
    config = {**launch_config(n, k), "A_GELU": gelu_in, **overrides}
    config["BLOCK_N"] = min(config["BLOCK_N"], max(16, triton.next_power_of_2(n)))  # never wider than the row
    return _launch(x, weight, bias, residual, mask, EPILOGUE_CODES[epilogue], config)[0]


def triton_norm_linear(x: torch.Tensor, ln_weight: torch.Tensor, ln_bias: torch.Tensor, eps: float,
                       weight: torch.Tensor, bias: torch.Tensor, epilogue: str = "none", **overrides) -> torch.Tensor:
    """The GEMM of the rows' LayerNorm: ``F.linear(F.layer_norm(x, ...), weight, bias)`` and the epilogue ("none" or
    "gelu"), the LayerNorm computed on the way in (``A_LN``); K one of LN_WIDTHS (a tile reads whole rows)."""
    n, k = weight.shape
    if k not in LN_WIDTHS:
        raise ValueError(f"the LayerNorm prologue takes rows of {', '.join(map(str, LN_WIDTHS))}, got {k}")
    if epilogue not in ("none", "gelu"):
        raise ValueError(f"the LayerNorm prologue takes the epilogues none and gelu, got {epilogue!r}")
    config = {**launch_config(n, k), **overrides}
    config["BLOCK_N"] = min(config["BLOCK_N"], max(16, triton.next_power_of_2(n)))  # never wider than the row
    return _launch(x, weight, bias, None, None, EPILOGUE_CODES[epilogue], config,
                   prologue_norm=(ln_weight, ln_bias, eps))[0]


def triton_linear_layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, residual: torch.Tensor,
                             mask, ln_weight: torch.Tensor, ln_bias: torch.Tensor, eps: float,
                             epilogue: str = "add_masked", prologue: str = "none", zero_invalid: bool = False,
                             **overrides) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual epilogue and then the next LayerNorm of each row: returns (sum, LayerNorm(sum)), both [..., N]
    float16, N one of LN_WIDTHS (one tile holds whole rows). ``zero_invalid``: the LayerNorm's rows of invalid
    tokens are zeroed too (the model's final_norm, then zero_invalid_rows)."""
    n, k = weight.shape
    if n not in LN_WIDTHS:
        raise ValueError(f"the LayerNorm epilogue takes rows of {', '.join(map(str, LN_WIDTHS))}, got {n}")
    # 64 rows x 8 warps, the rows read back for the LayerNorm: no spills offline (Triton 3.6, sm_90a: 246 registers;
    # in registers straight from the accumulator: 664 bytes of spills at 64 x 8, 2,088 at 128 x 8). Rows under 128
    # are always read back (the lanes past the row are masked there).
    gelu_in = prologue == "gelu"
    config = {**launch_config(n, k), "BLOCK_M": 64, "num_warps": 8, "LN_RELOAD": True, "A_GELU": gelu_in,
              **overrides,
              "BLOCK_N": n, "LN_ZERO_INVALID": bool(zero_invalid)}
    if n < 128:
        config["LN_RELOAD"] = True
    return _launch(x, weight, bias, residual, mask, LN_EPILOGUE_CODES[epilogue], config, (ln_weight, ln_bias, eps))
