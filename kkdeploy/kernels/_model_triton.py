"""The whole model in one persistent launch (imported lazily: it imports triton).

The split layer launches (``_layer_triton``) lose to the compiled graph because each block's launch runs five GEMM
tiles one after another on a handful of programs, while the graph spreads each op over many programs and pays a
launch per op. This kernel keeps the spread and drops the launches: a grid about as large as the GPU holds, whose
programs take **work items** in dependency order from a ticket counter until none are left.

Items, in ticket order (a row tile is BLOCK_M query rows of one sequence: ``rt = b * NQB + qb``):

* entry, per row tile: the first block's norm1 of X -> HN0;
* per layer, then:
  - Q|K|V, per (row tile, column tile of BN_QKV) -> QKV[l];
  - attention, per (row tile, head) -> CTX[l] (``_attention_tile``; it reads the keys of earlier row tiles);
  - out_proj, ``x + where(mask, ., 0)`` and norm2, per row tile -> X1[l], H2[l];
  - ffn_in, per (row tile, column tile of BN_F) -> FF[l];
  - ffn_out with GELU on its input, ``where(mask, x1 + ., 0)`` and the next LayerNorm (the next block's norm1, or
    final_norm with the invalid rows zeroed), per row tile -> X2[l], HN[l].

  With ``ROW_CHAIN`` (ffn_in in one column tile: F <= BN_F, every official shape but 8), out_proj, ffn_in and
  ffn_out of a row tile are one item: they depend on each other in that order anyway, and the chain saves two
  hand-offs per block. With ``CHAIN_REGS`` as well (D of 16-128; F up to 128, or in tiles of 128), the chain
  keeps its rows in registers from out_proj to the next LayerNorm (``_row_chain_registers``): each part's output
  is still stored for the proof, but never read back, and no part waits on a barrier or a reload. With
  ``CHAIN_QKV`` too, the entry and each row chain go on to the next block's Q|K|V from the rows still in
  registers (``_qkv_rows``), so a block has no Q|K|V items and one hand-off fewer: the attention waits on the
  chains of its key row tiles.

**No deadlock, however few programs are resident.** A program takes ``item = atomic_add(ticket, 1)`` only while it
runs, and an item waits only on items with smaller tickets. Those were taken by programs that are running, and
they finish without waiting on anything later. So the grid needs no co-residency guarantee (unlike a grid barrier).

**Readiness counters** (int32, per layer and row tile): a producer stores its tile, runs ``tl.debug_barrier()``
(every thread's stores are done) and then one ``atomic_add(counter, 1, sem="release")`` at GPU scope. A consumer
spins on ``atomic_add(counter, 0, sem="acquire")`` until the count it needs: the Q|K|V column tiles of every row
tile its keys come from, the heads of its rows, the ffn_in column tiles of its rows. Release and acquire at GPU
scope are cumulative in PTX's memory model, so what the producer's CTA stored before the barrier is visible to the
consumer after its acquire; that is the pattern of cooperative groups' grid sync.

**The arithmetic is the proven tiles'**: the same ``@triton.jit`` functions the build's proofs launch on their own
(``_linear_tile`` with the bias in the float32 accumulator and its epilogues, ``_attention_tile``,
``_rows_layer_norm``) with the tile sizes of the split layer launches, so each item writes what the split launches
write, and ``compare_intermediates`` holds every buffer to the reference op by op.

**The counters reset themselves.** The last program out (an ``exit`` counter) zeroes the ticket and every counter
for the next call, so a call is one launch, and a CUDA graph captures it as one node.

**Never a hung GPU.** A wait gives up after ``MAX_SPINS`` polls (seconds) and counts a stall in the sync buffer,
which the kernel never clears. A wait that cannot be met (a bug in the bookkeeping, or a GPU that breaks the
ticket's assumption) then ends in wrong answers, which the proof reports with the stall count, not in a device that
never returns.

Under Triton's interpreter the programs run one after another: the first takes every ticket in order, every wait
is already satisfied, and the others find no work. That checks the item decoding, the buffers and the arithmetic
on the CPU; the memory ordering between programs is the GPU's to show (every element is validated there).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._faithful_attention_triton import _attention_tile
from ._fused_linear_triton import (_gelu16, _linear_tile, _rows_layer_norm, _rows_mean_rstd, _shuffle_down_step,
                                   _welford_push)

# The sync buffer (int32): the ticket, the exit count, the stall count, then KINDS readiness counters per (layer, row
# tile).
TICKET = tl.constexpr(0)
EXIT = tl.constexpr(1)
STALLS = tl.constexpr(2)  # waits that gave up: never reset by the kernel (LayerKernels.stalls reads it)
HEADER = tl.constexpr(3)
#: spins after which a wait gives up (about seconds: an L2 round trip each) and counts a stall: a wait that can never
#: be met (a bug, or a GPU that breaks the ticket's assumption) then gives wrong answers that the proof and the
#: validation catch, never a hung GPU
MAX_SPINS = tl.constexpr(1 << 22)
HN_READY = tl.constexpr(0)  # the block's input rows normalized (norm1): 1 when ready
QKV_DONE = tl.constexpr(1)  # Q|K|V column tiles written: NQKV when ready
ATT_DONE = tl.constexpr(2)  # heads written: H when ready
X1_DONE = tl.constexpr(3)  # out_proj, the residual and norm2 written: 1
FF_DONE = tl.constexpr(4)  # ffn_in column tiles written: NFF
KINDS = tl.constexpr(5)
#: columns of a traced item's row: program, taken, ready, the row chain's out_proj done, its ffn_in done, done
TRACE_COLUMNS = tl.constexpr(6)


def sync_size(layers: int, row_tiles: int) -> int:
    """int32 elements of the sync buffer for a model of ``layers`` blocks over ``row_tiles`` row tiles."""
    return HEADER.value + KINDS.value * layers * row_tiles


@triton.jit
def _counter(SYNC, layer, kind: tl.constexpr, rt, NRT):
    """The readiness counter of ``kind`` for row tile ``rt`` of block ``layer``."""
    return SYNC + HEADER + (layer * KINDS + kind) * NRT + rt


@triton.jit
def _wait(COUNTER, target, SYNC):
    """Spin until ``*COUNTER >= target`` (acquire at GPU scope: the producers' stores are visible after it), or give
    up after MAX_SPINS and count a stall."""
    seen = tl.atomic_add(COUNTER, 0, sem="acquire", scope="gpu")
    spins = 0
    while (seen < target) & (spins < MAX_SPINS):
        seen = tl.atomic_add(COUNTER, 0, sem="acquire", scope="gpu")
        spins += 1
    if seen < target:
        tl.atomic_add(SYNC + STALLS, 1)


@triton.jit
def _row_tile(rt, NQB, S, BLOCK_M: tl.constexpr):
    """Row tile ``rt`` (BLOCK_M query rows ``(rt % NQB) * BLOCK_M ..`` of sequence ``rt // NQB``): its flat rows
    (int64) and which of them exist."""
    b = (rt // NQB).to(tl.int64)
    r = (rt % NQB) * BLOCK_M + tl.arange(0, BLOCK_M)
    return b * S + r, r < S


@triton.jit
def _trace(TRACE_BUF, item, column: tl.constexpr, TRACE: tl.constexpr):
    """With TRACE: the GPU's nanosecond clock (``%globaltimer``) into column ``column`` of the item's row of
    TRACE_BUF [items, TRACE_COLUMNS] (program, taken, ready, out_proj done, ffn_in done, done: the middle two for a
    row-chain item only); column 0 gets the program id."""
    if TRACE:
        now = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False,
                                        pack=1)
        if column == 1:
            tl.store(TRACE_BUF + item.to(tl.int64) * TRACE_COLUMNS, tl.program_id(0).to(tl.int64))
        tl.store(TRACE_BUF + item.to(tl.int64) * TRACE_COLUMNS + column, now)


@triton.jit
def _signal(COUNTER):
    """Publish this program's stores: every thread's first (the barrier), then one release increment."""
    tl.debug_barrier()
    tl.atomic_add(COUNTER, 1, sem="release", scope="gpu")


@triton.jit
def _signal_count(COUNTER, count):
    """``_signal`` for ``count`` units of work at once (the Q|K|V column tiles of a row tile written by one item)."""
    tl.debug_barrier()
    tl.atomic_add(COUNTER, count, sem="release", scope="gpu")


@triton.jit
def _qkv_rows(hn, WQKV, BQKV, QKV, rows, row_ok, D: tl.constexpr, BLOCK_M: tl.constexpr):
    """Q|K|V of rows whose norm1 ``hn`` [BLOCK_M, D] (float16) is in registers: three D-column tiles, each in the
    split launch's k-steps with the bias in the float32 accumulator (EPILOGUE 0), stored to QKV. A column's
    arithmetic does not depend on the column tiling, so these are the split launch's 128-column tiles' values."""
    offs_n = tl.arange(0, D)
    for n0 in tl.static_range(0, 3 * D, D):
        w0, w1 = _weight_chunks(WQKV + n0 * D, offs_n, D, D)
        acc = tl.zeros((BLOCK_M, D), dtype=tl.float32)
        y = (_dot_chunks(hn, w0, w1, acc, D, BLOCK_M) + tl.load(BQKV + n0 + offs_n).to(tl.float32)[None, :])
        tl.store(QKV + rows[:, None] * (3 * D) + n0 + offs_n[None, :], y.to(tl.float16), mask=row_ok[:, None])


@triton.jit
def _ffn_in_tile(H2, W1, B1, FF, lay, rows, row_ok, n0, D: tl.constexpr, F: tl.constexpr, BLOCK_M: tl.constexpr,
                 BN_F: tl.constexpr, BK_D: tl.constexpr, ACCURATE: tl.constexpr):
    """ffn_in of block ``lay`` for ``rows``, columns n0 .. n0 + BN_F (no epilogue: ffn_out computes the GELU)."""
    offs_n = n0 + tl.arange(0, BN_F)
    _linear_tile(H2, W1 + lay * (F * D), B1 + lay * F, FF, FF, FF, rows, offs_n, row_ok, offs_n < F, F, D,
                 D, D, F, F, 0, False, ACCURATE, BLOCK_M, BN_F, BK_D, None, None, None, 0.0, False, False, False)


@triton.jit
def _ffn_out_tile(FF, W2, B2, X1, MASK, X2, LNN_G, LNN_B, EPSN, HN, lay, rows, row_ok, last,
                  D: tl.constexpr, F: tl.constexpr, HAS_MASK: tl.constexpr, ACCURATE: tl.constexpr,
                  BLOCK_M: tl.constexpr, BK_F: tl.constexpr):
    """ffn_out of block ``lay`` for ``rows`` with GELU on its input, ``where(mask, x1 + ., 0)`` and the next
    LayerNorm: the next block's norm1, or (``last``) final_norm with the invalid rows zeroed."""
    offs_dn = tl.arange(0, D)
    if last:
        _linear_tile(FF, W2 + lay * (D * F), B2 + lay * D, X1, MASK, X2, rows, offs_dn, row_ok, offs_dn < D, D, F,
                     F, F, D, D, 5, HAS_MASK, ACCURATE, BLOCK_M, D, BK_F,
                     LNN_G + lay * D, LNN_B + lay * D, HN, tl.load(EPSN + lay), True, True, True)
    else:
        _linear_tile(FF, W2 + lay * (D * F), B2 + lay * D, X1, MASK, X2, rows, offs_dn, row_ok, offs_dn < D, D, F,
                     F, F, D, D, 5, HAS_MASK, ACCURATE, BLOCK_M, D, BK_F,
                     LNN_G + lay * D, LNN_B + lay * D, HN, tl.load(EPSN + lay), True, True, False)


@triton.jit
def _rows_layer_norm_lanes(v, G, B, eps, LN_LANES: tl.constexpr, BLOCK_M: tl.constexpr, ACCURATE: tl.constexpr):
    """``_rows_layer_norm`` for rows of 4 LN_LANES elements held as v [BLOCK_M, LN_LANES, 4] (LN_LANES a power of
    two up to 32): the same pushes and merges in the same order, without the lanes past the row. ATen's tree merges
    those lanes' empty states ({0, 0, 0}) into the live ones at the levels W >= LN_LANES, and such a merge returns
    the live state unchanged bit for bit (its count is 4 x a power of two, so RN(1/count) x count is 1: mean = fma(0,
    0, mean), m2 = fma(0, 1, m2 + 0)); those levels are left out. With LN_LANES = 32 it is ``_rows_layer_norm``."""
    x4 = tl.reshape(v, (BLOCK_M, LN_LANES, 2, 2))  # [row, lane t, hi, lo]: element 4t + 2 hi + lo
    lo0, lo1 = tl.split(x4)
    e0, e2 = tl.split(lo0)
    e1, e3 = tl.split(lo1)
    zero = tl.zeros((BLOCK_M, LN_LANES), tl.float32)
    mean, m2, count = _welford_push(e0, zero, zero, zero)
    mean, m2, count = _welford_push(e1, mean, m2, count)
    mean, m2, count = _welford_push(e2, mean, m2, count)
    mean, m2, count = _welford_push(e3, mean, m2, count)
    if LN_LANES >= 32:
        mean, m2, count = _shuffle_down_step(mean, m2, count, BLOCK_M, 16)
    if LN_LANES >= 16:
        mean, m2, count = _shuffle_down_step(mean, m2, count, BLOCK_M, 8)
    if LN_LANES >= 8:
        mean, m2, count = _shuffle_down_step(mean, m2, count, BLOCK_M, 4)
    if LN_LANES >= 4:
        mean, m2, count = _shuffle_down_step(mean, m2, count, BLOCK_M, 2)
    if LN_LANES >= 2:
        mean, m2, count = _shuffle_down_step(mean, m2, count, BLOCK_M, 1)
    mean, rstd = _rows_mean_rstd(mean, m2, count, eps, 4 * LN_LANES, BLOCK_M, ACCURATE)
    offs = tl.arange(0, LN_LANES)[:, None] * 4 + tl.arange(0, 4)[None, :]
    g = tl.load(G + offs).to(tl.float32)
    b = tl.load(B + offs).to(tl.float32)
    return tl.fma(g[None, :, :], rstd[:, None, None] * (v - mean[:, None, None]), b[None, :, :]).to(tl.float16)


@triton.jit
def _norm_rows(x, G, B, eps, D: tl.constexpr, BLOCK_M: tl.constexpr, ACCURATE: tl.constexpr):
    """ATen's LayerNorm of the float16 rows x [BLOCK_M, D] in registers (D = 4 x a power of two up to 128):
    ``_rows_layer_norm`` itself for rows of 128, the same order without the empty lanes for narrower rows."""
    v = tl.reshape(x.to(tl.float32), (BLOCK_M, D // 4, 4))
    if D == 128:
        normed = _rows_layer_norm(v, G, B, eps, D, BLOCK_M, ACCURATE)
    else:
        normed = _rows_layer_norm_lanes(v, G, B, eps, D // 4, BLOCK_M, ACCURATE)
    return tl.reshape(normed, (BLOCK_M, D))


@triton.jit
def _weight_chunks(W, offs_n, K: tl.constexpr, STRIDE: tl.constexpr):
    """W[offs_n, :K] (rows STRIDE apart) in the split tiles' k-steps (BLOCK_K = min(K, 64)): (W[:, :64], W[:, 64:])
    for K = 128, else (W, W) of which the second is unused."""
    if K <= 64:
        w = tl.load(W + offs_n[:, None] * STRIDE + tl.arange(0, K)[None, :])
        return w, w
    else:
        tl.static_assert(K == 128, "the register chain's k-chunks are at most 128")
        offs_k = tl.arange(0, 64)
        return (tl.load(W + offs_n[:, None] * STRIDE + offs_k[None, :]),
                tl.load(W + offs_n[:, None] * STRIDE + 64 + offs_k[None, :]))


@triton.jit
def _dot_chunks(a, w0, w1, acc, K: tl.constexpr, BLOCK_M: tl.constexpr):
    """acc + a [BLOCK_M, K] (registers) times the weight chunks' transpose, one ``tl.dot`` per k-step of the split
    tiles (``_weight_chunks``): the same k16 chain on the GPU, and the same roundings under the interpreter."""
    if K <= 64:
        return tl.dot(a, tl.trans(w0), acc)
    else:
        a0, a1 = tl.split(tl.permute(tl.reshape(a, (BLOCK_M, 2, 64)), (0, 2, 1)))
        return tl.dot(a1, tl.trans(w1), tl.dot(a0, tl.trans(w0), acc))


@triton.jit
def _row_chain_registers(CTX, X_IN, MASK, X1, H2, FF, X2, HN, WO, BO, LN2_G, LN2_B, eps2, W1, B1, W2, B2,
                         LNN_G, LNN_B, epsn, rows, row_ok, last, TRACE_BUF, item,
                         D: tl.constexpr, F: tl.constexpr, HAS_MASK: tl.constexpr, ACCURATE: tl.constexpr,
                         BLOCK_M: tl.constexpr, TRACE: tl.constexpr):
    """The row chain of one row tile with its rows in registers throughout (D = 32, 64 or 128: a LayerNorm row
    is D / 4 lanes of 4, ``_rows_layer_norm_lanes``). The arithmetic is the split tiles': the GEMMs in their k-steps
    (``_dot_chunks``), the bias in the float32 accumulator and one rounding, the epilogues' expressions (EPILOGUE 4
    for out_proj, 5 for ffn_out), ATen's GELU on ffn_out's input, the LayerNorms in ``emulate_layer_norm_rows``'s
    order. What changes is where the rows live between parts: out_proj's rows feed norm2, ffn_in, the GELU and
    ffn_out's residual without a store, barrier and reload. Every part's output is still stored (X1, H2, FF before
    the GELU, X2, HN) for the next items and for ``compare_intermediates``. ffn_in's first weights are loaded
    before norm2 runs, so their L2 latency overlaps it; the others just before their GEMM (all of them loaded first
    spilled 440 bytes, offline for sm_90a)."""
    FC: tl.constexpr = F if F < 128 else 128  # ffn_in's column tiles (the split launch's BN_F)
    offs_d = tl.arange(0, D)
    offs_c = tl.arange(0, FC)
    rows_d = rows[:, None] * D + offs_d[None, :]
    in_rows = row_ok[:, None]
    if HAS_MASK:
        valid = tl.load(MASK + rows, mask=row_ok, other=0) != 0
    else:
        valid = row_ok
    zero = tl.zeros((BLOCK_M, D), dtype=tl.float16)
    wo0, wo1 = _weight_chunks(WO, offs_d, D, D)  # [out, in]
    ctx = tl.load(CTX + rows_d, mask=in_rows, other=0.0)
    r = tl.load(X_IN + rows_d, mask=in_rows, other=0.0)
    # out_proj, r + where(mask, y, 0) (EPILOGUE 4), norm2
    acc = tl.zeros((BLOCK_M, D), dtype=tl.float32)
    y = (_dot_chunks(ctx, wo0, wo1, acc, D, BLOCK_M) + tl.load(BO + offs_d).to(tl.float32)[None, :]).to(tl.float16)
    w10, w11 = _weight_chunks(W1, offs_c, D, D)  # ffn_in's first column tile: in flight while norm2 runs
    x1 = (r.to(tl.float32) + tl.where(valid[:, None], y, zero).to(tl.float32)).to(tl.float16)
    tl.store(X1 + rows_d, x1, mask=in_rows)
    h2 = _norm_rows(x1, LN2_G, LN2_B, eps2, D, BLOCK_M, ACCURATE)
    tl.store(H2 + rows_d, h2, mask=in_rows)
    _trace(TRACE_BUF, item, 3, TRACE)  # out_proj, the residual and norm2 done
    # per column tile of ffn_in: the tile (stored before the GELU, as the split launches store it), GELU, and its
    # k-steps of ffn_out, in K's order (the split tile's k-loop over F)
    acc2 = tl.zeros((BLOCK_M, D), dtype=tl.float32)
    for c0 in tl.static_range(0, F, FC):
        if c0 > 0:
            w10, w11 = _weight_chunks(W1 + c0 * D, offs_c, D, D)
        ff = (_dot_chunks(h2, w10, w11, tl.zeros((BLOCK_M, FC), dtype=tl.float32), D, BLOCK_M)
              + tl.load(B1 + c0 + offs_c).to(tl.float32)[None, :]).to(tl.float16)
        tl.store(FF + rows[:, None] * F + c0 + offs_c[None, :], ff, mask=in_rows)
        g = _gelu16(ff, ACCURATE)
        w20, w21 = _weight_chunks(W2 + c0, offs_d, FC, F)  # [D, F]: columns c0 .. c0 + FC
        acc2 = _dot_chunks(g, w20, w21, acc2, FC, BLOCK_M)
    _trace(TRACE_BUF, item, 4, TRACE)  # ffn_in done (and ffn_out's GEMM)
    # ffn_out's epilogue, where(mask, x1 + y, 0) (EPILOGUE 5), the next LayerNorm (final_norm, invalid rows zeroed)
    y2 = (acc2 + tl.load(B2 + offs_d).to(tl.float32)[None, :]).to(tl.float16)
    x2 = tl.where(valid[:, None], (x1.to(tl.float32) + y2.to(tl.float32)).to(tl.float16), zero)
    tl.store(X2 + rows_d, x2, mask=in_rows)
    hn = _norm_rows(x2, LNN_G, LNN_B, epsn, D, BLOCK_M, ACCURATE)
    if last:
        hn = tl.where(valid[:, None], hn, 0.0)
    tl.store(HN + rows_d, hn, mask=in_rows)
    return hn


@triton.jit
def _model_kernel(
    X, MASK, HN0, QKV, CTX, X1, H2, FF, X2, HN, SYNC,
    LN1_G, LN1_B, WQKV, BQKV, WO, BO, LN2_G, LN2_B, W1, B1, W2, B2, LNN_G, LNN_B, EPS2, EPSN,
    S, M, NQB, NRT, scale, eps1,
    L: tl.constexpr, D: tl.constexpr, F: tl.constexpr, H: tl.constexpr, HEAD_DIM: tl.constexpr,
    DH_PAD: tl.constexpr, LANES: tl.constexpr, NCACHED: tl.constexpr, FAST_DIV: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, ACCURATE: tl.constexpr,
    BLOCK_M: tl.constexpr, BK_D: tl.constexpr, BK_F: tl.constexpr, BN_F: tl.constexpr, BN_QKV: tl.constexpr,
    SYNC_BLOCK: tl.constexpr, ROW_CHAIN: tl.constexpr, TRACE_BUF=None, TRACE: tl.constexpr = False,
    CHAIN_REGS: tl.constexpr = False, CHAIN_QKV: tl.constexpr = False,
):
    NQKV: tl.constexpr = (3 * D + BN_QKV - 1) // BN_QKV  # Q|K|V column tiles per row tile
    NFF: tl.constexpr = (F + BN_F - 1) // BN_F  # ffn_in column tiles per row tile
    if CHAIN_QKV:  # the entry and the row chain write every Q|K|V: no Q|K|V items
        n_qkv = NRT * 0
    else:
        n_qkv = NRT * NQKV
    n_att = NRT * H
    tl.static_assert(NFF == 1 or not ROW_CHAIN or CHAIN_REGS,
                     "ROW_CHAIN needs ffn_in in one column tile, or the chain in registers")
    if ROW_CHAIN:  # out_proj, ffn_in and ffn_out of a row tile are one item (ffn_in is one column tile)
        per_layer = n_qkv + n_att + NRT
    else:
        per_layer = n_qkv + n_att + NRT + NRT * NFF + NRT
    total = NRT + L * per_layer
    lane_k = tl.arange(0, 32)[:, None] * 4 + tl.arange(0, 4)[None, :]  # [lane, k]: column 4 lane + k
    offs_dn = tl.arange(0, D)
    offs_d = tl.arange(0, DH_PAD)

    item = tl.atomic_add(SYNC + TICKET, 1)
    while item < total:
        _trace(TRACE_BUF, item, 1, TRACE)  # taken
        if item < NRT:
            # entry: norm1 of the first block, rows of row tile `item`
            rt = item
            _trace(TRACE_BUF, item, 2, TRACE)  # ready: the entry waits on nothing
            rows, row_ok = _row_tile(rt, NQB, S, BLOCK_M)
            offs3 = rows[:, None, None] * D + lane_k[None, :, :]
            in_row = row_ok[:, None, None] & (lane_k < D)[None, :, :]
            if CHAIN_QKV:  # norm1 and the first block's Q|K|V from the rows in registers
                rows_d = rows[:, None] * D + offs_dn[None, :]
                hn0 = _norm_rows(tl.load(X + rows_d, mask=row_ok[:, None], other=0.0), LN1_G, LN1_B, eps1, D,
                                 BLOCK_M, ACCURATE)
                tl.store(HN0 + rows_d, hn0, mask=row_ok[:, None])
                _qkv_rows(hn0, WQKV, BQKV, QKV, rows, row_ok, D, BLOCK_M)
                _signal_count(_counter(SYNC, 0, QKV_DONE, rt, NRT), NQKV)
            else:
                v3 = tl.load(X + offs3, mask=in_row, other=0.0).to(tl.float32)
                tl.store(HN0 + offs3, _rows_layer_norm(v3, LN1_G, LN1_B, eps1, D, BLOCK_M, ACCURATE), mask=in_row)
                _signal(_counter(SYNC, 0, HN_READY, rt, NRT))
        else:
            j = item - NRT
            layer = j // per_layer
            j = j % per_layer
            lay = layer.to(tl.int64)
            qkv_l = QKV + lay * M * (3 * D)
            ctx_l = CTX + lay * M * D
            x1_l = X1 + lay * M * D
            h2_l = H2 + lay * M * D
            ff_l = FF + lay * M * F
            x2_l = X2 + lay * M * D
            hn_l = HN + lay * M * D
            if j < n_qkv:
                # Q|K|V of one row tile, one column tile; its input is norm1 of the block's input
                rt = j // NQKV
                n0 = (j % NQKV) * BN_QKV
                rows, row_ok = _row_tile(rt, NQB, S, BLOCK_M)
                _wait(_counter(SYNC, layer, HN_READY, rt, NRT), 1, SYNC)
                _trace(TRACE_BUF, item, 2, TRACE)  # ready
                if layer == 0:
                    h_in = HN0
                else:
                    h_in = HN + (lay - 1) * M * D
                offs_n = n0 + tl.arange(0, BN_QKV)
                _linear_tile(h_in, WQKV + lay * (3 * D * D), BQKV + lay * (3 * D), qkv_l, qkv_l, qkv_l,
                             rows, offs_n, row_ok, offs_n < 3 * D, 3 * D, D,
                             D, D, 3 * D, 3 * D, 0, False, ACCURATE, BLOCK_M, BN_QKV, BK_D,
                             None, None, None, 0.0, False, False, False)
                _signal(_counter(SYNC, layer, QKV_DONE, rt, NRT))
            elif j < n_qkv + n_att:
                # attention: one head of one row tile, once the Q|K|V rows of its keys are written
                j = j - n_qkv
                rt = j // H
                h = j % H
                bb = rt // NQB
                qb = rt % NQB
                b = bb.to(tl.int64)
                if CAUSAL:
                    last_tile = qb
                else:
                    last_tile = NQB - 1
                for t in range(0, last_tile + 1):
                    _wait(_counter(SYNC, layer, QKV_DONE, bb * NQB + t, NRT), NQKV, SYNC)
                _trace(TRACE_BUF, item, 2, TRACE)  # ready
                m0 = qb * BLOCK_M
                r = m0 + tl.arange(0, BLOCK_M)
                row_ok = r < S
                rows = b * S + r
                acc = _attention_tile(qkv_l, qkv_l + D, qkv_l + 2 * D, MASK, ctx_l, ctx_l, b, h, m0,
                                      S * 3 * D, 3 * D, S * 3 * D, 3 * D, S * 3 * D, 3 * D, S, 1,
                                      S, H, scale, HEAD_DIM, DH_PAD, BLOCK_M, LANES, 1, CAUSAL, HAS_MASK, ACCURATE,
                                      False, False, NCACHED, FAST_DIV)
                c_ptrs = ctx_l + rows[:, None] * D + h * HEAD_DIM + offs_d[None, :]
                tl.store(c_ptrs, acc.to(tl.float16), mask=row_ok[:, None] & (offs_d[None, :] < HEAD_DIM))
                _signal(_counter(SYNC, layer, ATT_DONE, rt, NRT))
            elif j < n_qkv + n_att + NRT:
                # out_proj, x + where(mask, ., 0), norm2 of one row tile (and, chained, its feed-forward)
                rt = j - n_qkv - n_att
                rows, row_ok = _row_tile(rt, NQB, S, BLOCK_M)
                _wait(_counter(SYNC, layer, ATT_DONE, rt, NRT), H, SYNC)
                _trace(TRACE_BUF, item, 2, TRACE)  # ready
                if layer == 0:
                    x_in = X
                else:
                    x_in = X2 + (lay - 1) * M * D
                if CHAIN_REGS:
                    hn = _row_chain_registers(ctx_l, x_in, MASK, x1_l, h2_l, ff_l, x2_l, hn_l, WO + lay * (D * D),
                                              BO + lay * D, LN2_G + lay * D, LN2_B + lay * D, tl.load(EPS2 + lay),
                                              W1 + lay * (F * D), B1 + lay * F, W2 + lay * (D * F), B2 + lay * D,
                                              LNN_G + lay * D, LNN_B + lay * D, tl.load(EPSN + lay), rows, row_ok,
                                              layer == L - 1, TRACE_BUF, item, D, F, HAS_MASK, ACCURATE, BLOCK_M,
                                              TRACE)
                    if layer < L - 1:
                        if CHAIN_QKV:  # the next block's Q|K|V from the rows in registers; its attention waits
                            nxt = lay + 1
                            _qkv_rows(hn, WQKV + nxt * (3 * D * D), BQKV + nxt * (3 * D), QKV + nxt * M * (3 * D),
                                      rows, row_ok, D, BLOCK_M)
                            _signal_count(_counter(SYNC, layer + 1, QKV_DONE, rt, NRT), NQKV)
                        else:  # the next block's Q|K|V tiles wait on this
                            _signal(_counter(SYNC, layer + 1, HN_READY, rt, NRT))
                else:
                    _linear_tile(ctx_l, WO + lay * (D * D), BO + lay * D, x_in, MASK, x1_l, rows, offs_dn, row_ok,
                                 offs_dn < D, D, D, D, D, D, D, 4, HAS_MASK, ACCURATE, BLOCK_M, D, BK_D,
                                 LN2_G + lay * D, LN2_B + lay * D, h2_l, tl.load(EPS2 + lay), True, False, False)
                    if ROW_CHAIN:  # ffn_in (one column tile) and ffn_out follow in this program: no hand-off
                        tl.debug_barrier()
                        _trace(TRACE_BUF, item, 3, TRACE)  # out_proj, the residual and norm2 done
                        _ffn_in_tile(h2_l, W1, B1, ff_l, lay, rows, row_ok, 0, D, F, BLOCK_M, BN_F, BK_D, ACCURATE)
                        tl.debug_barrier()
                        _trace(TRACE_BUF, item, 4, TRACE)  # ffn_in done
                        _ffn_out_tile(ff_l, W2, B2, x1_l, MASK, x2_l, LNN_G, LNN_B, EPSN, hn_l, lay, rows, row_ok,
                                      layer == L - 1, D, F, HAS_MASK, ACCURATE, BLOCK_M, BK_F)
                        if layer < L - 1:  # the next block's Q|K|V tiles wait on this
                            _signal(_counter(SYNC, layer + 1, HN_READY, rt, NRT))
                    else:
                        _signal(_counter(SYNC, layer, X1_DONE, rt, NRT))
            elif j < n_qkv + n_att + NRT + NRT * NFF:
                # ffn_in of one row tile, one column tile (GELU is computed by ffn_out on the way in)
                j = j - n_qkv - n_att - NRT
                rt = j // NFF
                rows, row_ok = _row_tile(rt, NQB, S, BLOCK_M)
                _wait(_counter(SYNC, layer, X1_DONE, rt, NRT), 1, SYNC)
                _trace(TRACE_BUF, item, 2, TRACE)  # ready
                _ffn_in_tile(h2_l, W1, B1, ff_l, lay, rows, row_ok, (j % NFF) * BN_F, D, F, BLOCK_M, BN_F, BK_D,
                             ACCURATE)
                _signal(_counter(SYNC, layer, FF_DONE, rt, NRT))
            else:
                # ffn_out with GELU on its input, where(mask, x1 + ., 0), the next LayerNorm of one row tile
                rt = j - n_qkv - n_att - NRT - NRT * NFF
                rows, row_ok = _row_tile(rt, NQB, S, BLOCK_M)
                _wait(_counter(SYNC, layer, FF_DONE, rt, NRT), NFF, SYNC)
                _trace(TRACE_BUF, item, 2, TRACE)  # ready
                _ffn_out_tile(ff_l, W2, B2, x1_l, MASK, x2_l, LNN_G, LNN_B, EPSN, hn_l, lay, rows, row_ok,
                              layer == L - 1, D, F, HAS_MASK, ACCURATE, BLOCK_M, BK_F)
                if layer < L - 1:  # the next block's Q|K|V tiles wait on this
                    _signal(_counter(SYNC, layer + 1, HN_READY, rt, NRT))
        _trace(TRACE_BUF, item, 5, TRACE)  # done
        item = tl.atomic_add(SYNC + TICKET, 1)

    # the last program out zeroes the ticket and the counters for the next call
    tl.debug_barrier()
    out = tl.atomic_add(SYNC + EXIT, 1, sem="acq_rel", scope="gpu")
    if out == tl.num_programs(0) - 1:
        n_sync = HEADER + KINDS * L * NRT
        for s0 in range(0, n_sync, SYNC_BLOCK):
            offs = s0 + tl.arange(0, SYNC_BLOCK)
            tl.store(SYNC + offs, tl.zeros((SYNC_BLOCK, ), tl.int32), mask=(offs < n_sync) & (offs != STALLS))
