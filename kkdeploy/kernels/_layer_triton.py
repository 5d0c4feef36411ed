"""The Triton kernels behind ``kkdeploy.kernels.layer_kernels`` (imported lazily: it imports triton).

A whole pre-norm block in one launch, one program per (block of BLOCK_M query rows, sequence). Every part is a
tile of a kernel that a build proves op by op, called here as the same ``@triton.jit`` function with the same tile
sizes, so each part computes what its own launch computes:

A. attention, head after head (``_faithful_attention_triton._attention_tile``), from the Q|K|V rows the previous
   launch wrote for the whole sequence -> CTX;
B. out_proj, the residual ``x + where(mask, ., 0)`` and norm2 of the rows (``_fused_linear_triton._linear_tile``,
   EPILOGUE 4) -> X1, H2;
C. ffn_in (GELU in its epilogue unless ffn_out computes it on the way in) -> FF;
D. ffn_out, ``where(mask, x1 + ., 0)`` and the next LayerNorm (the next block's norm1, or final_norm with the
   invalid rows zeroed) -> X2, HN;
E. the next block's Q|K|V from HN -> QKV_NEXT (not in the last block).

Only attention reads other rows (the keys and values of its sequence), and those were written by the previous
launch; everything after it is row-local. So a block needs no grid-wide barrier: the parts hand over through
buffers the program itself wrote, behind ``tl.debug_barrier()`` (a CTA's global stores are visible to all its
threads after ``bar.sync``), and those buffers stay in L2. Each part writes its own buffer, so a proof can compare
every intermediate with the reference's op by op and name the first one that differs.

``_entry_kernel`` is the first block's norm1 and Q|K|V, so a model of L blocks is L + 1 launches. With
``FUSE_ATTENTION`` off, part A is the attention kernel's own launch (one program per head) before each block's, and
the block launch starts at B: 2L + 1 launches, and no program holds the attention's registers beside the GEMMs'.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._faithful_attention_triton import _attention_tile
from ._fused_linear_triton import _linear_tile, _rows_layer_norm
from ._model_triton import _norm_rows, _qkv_rows, _row_chain_registers


@triton.jit
def _qkv_tiles(HN, WQKV, BQKV, QKV, rows, row_ok, D: tl.constexpr, BLOCK_M: tl.constexpr, BN_QKV: tl.constexpr,
               BK_D: tl.constexpr, ACCURATE: tl.constexpr):
    """QKV[rows] = HN[rows] . WQKV^T + BQKV, [M, 3D], in BN_QKV-wide tiles (Q, K and V packed)."""
    for n0 in tl.static_range(0, 3 * D, BN_QKV):
        offs_n = n0 + tl.arange(0, BN_QKV)
        _linear_tile(HN, WQKV, BQKV, QKV, QKV, QKV, rows, offs_n, row_ok, offs_n < 3 * D, 3 * D, D,
                     D, D, 3 * D, 3 * D, 0, False, ACCURATE, BLOCK_M, BN_QKV, BK_D,
                     None, None, None, 0.0, False, False, False)


@triton.jit
def _entry_kernel(X, HN, QKV, G, B, WQKV, BQKV, S, eps,
                  D: tl.constexpr, BLOCK_M: tl.constexpr, BN_QKV: tl.constexpr, BK_D: tl.constexpr,
                  ACCURATE: tl.constexpr, CHAIN_REGS: tl.constexpr = False):
    """The first block's norm1 (ATen's rows LayerNorm, as the GEMM epilogues compute it) and its Q|K|V (with
    CHAIN_REGS, from the rows in registers: ``_model_triton._qkv_rows``)."""
    pid_m = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    r = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = r < S
    rows = b * S + r
    if CHAIN_REGS:
        rows_d = rows[:, None] * D + tl.arange(0, D)[None, :]
        hn = _norm_rows(tl.load(X + rows_d, mask=row_ok[:, None], other=0.0), G, B, eps, D, BLOCK_M, ACCURATE)
        tl.store(HN + rows_d, hn, mask=row_ok[:, None])
        _qkv_rows(hn, WQKV, BQKV, QKV, rows, row_ok, D, BLOCK_M)
    else:
        lane_k = tl.arange(0, 32)[:, None] * 4 + tl.arange(0, 4)[None, :]  # [lane, k]: column 4 lane + k
        offs3 = rows[:, None, None] * D + lane_k[None, :, :]
        in_row = row_ok[:, None, None] & (lane_k < D)[None, :, :]
        v3 = tl.load(X + offs3, mask=in_row, other=0.0).to(tl.float32)
        tl.store(HN + offs3, _rows_layer_norm(v3, G, B, eps, D, BLOCK_M, ACCURATE), mask=in_row)
        tl.debug_barrier()
        _qkv_tiles(HN, WQKV, BQKV, QKV, rows, row_ok, D, BLOCK_M, BN_QKV, BK_D, ACCURATE)


@triton.jit
def _layer_kernel(
    X, QKV, MASK, CTX, X1, H2, FF, X2, HN, QKV_NEXT,
    WO, BO, LN2_G, LN2_B, W1, B1, W2, B2, LNN_G, LNN_B, WQKV, BQKV,
    S, scale, eps2, epsn,
    D: tl.constexpr, F: tl.constexpr, H: tl.constexpr, HEAD_DIM: tl.constexpr, DH_PAD: tl.constexpr,
    LANES: tl.constexpr, SUB: tl.constexpr, ONE_PASS: tl.constexpr, NCACHED: tl.constexpr, FAST_DIV: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, ACCURATE: tl.constexpr,
    BLOCK_M: tl.constexpr, BK_D: tl.constexpr, BK_F: tl.constexpr, BN_F: tl.constexpr, BN_QKV: tl.constexpr,
    GELU_PROLOGUE: tl.constexpr, LAST: tl.constexpr, FUSE_ATTENTION: tl.constexpr = True,
    CHAIN_REGS: tl.constexpr = False,
):
    pid_m = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    m0 = pid_m * BLOCK_M
    r = m0 + tl.arange(0, BLOCK_M)
    row_ok = r < S
    rows = b * S + r
    # A. attention, every head of these rows (Q, K, V: columns 0, D and 2D of the packed rows)
    # (FUSE_ATTENTION False: the attention kernel's own launch, one program per head, wrote CTX before this one)
    if FUSE_ATTENTION:
        offs_d = tl.arange(0, DH_PAD)
        for h in range(H):
            acc = _attention_tile(QKV, QKV + D, QKV + 2 * D, MASK, CTX, CTX, b, h, m0,
                                  S * 3 * D, 3 * D, S * 3 * D, 3 * D, S * 3 * D, 3 * D, S, 1,
                                  S, H, scale, HEAD_DIM, DH_PAD, BLOCK_M, LANES, SUB, CAUSAL, HAS_MASK, ACCURATE,
                                  False, ONE_PASS, NCACHED, FAST_DIV)
            c_ptrs = CTX + rows[:, None] * D + h * HEAD_DIM + offs_d[None, :]
            tl.store(c_ptrs, acc.to(tl.float16), mask=row_ok[:, None] & (offs_d[None, :] < HEAD_DIM))
        tl.debug_barrier()
    if CHAIN_REGS:  # B-E with the rows in registers (``_model_triton._row_chain_registers``, GELU on the way in)
        hn = _row_chain_registers(CTX, X, MASK, X1, H2, FF, X2, HN, WO, BO, LN2_G, LN2_B, eps2, W1, B1, W2, B2,
                                  LNN_G, LNN_B, epsn, rows, row_ok, LAST, None, 0, D, F, HAS_MASK, ACCURATE,
                                  BLOCK_M, False)
        if not LAST:
            _qkv_rows(hn, WQKV, BQKV, QKV_NEXT, rows, row_ok, D, BLOCK_M)
    else:
        # B. out_proj, x + where(mask, ., 0), norm2
        offs_dn = tl.arange(0, D)
        _linear_tile(CTX, WO, BO, X, MASK, X1, rows, offs_dn, row_ok, offs_dn < D, D, D,
                     D, D, D, D, 4, HAS_MASK, ACCURATE, BLOCK_M, D, BK_D,
                     LN2_G, LN2_B, H2, eps2, True, False, False)
        tl.debug_barrier()
        # C. ffn_in (and its GELU, where ffn_out does not compute it on the way in)
        for n0 in tl.static_range(0, F, BN_F):
            offs_n = n0 + tl.arange(0, BN_F)
            _linear_tile(H2, W1, B1, FF, FF, FF, rows, offs_n, row_ok, offs_n < F, F, D,
                         D, D, F, F, 0 if GELU_PROLOGUE else 1, False, ACCURATE, BLOCK_M, BN_F, BK_D,
                         None, None, None, 0.0, False, False, False)
        tl.debug_barrier()
        # D. ffn_out, where(mask, x1 + ., 0), the next LayerNorm (final_norm with the invalid rows zeroed at the end)
        _linear_tile(FF, W2, B2, X1, MASK, X2, rows, offs_dn, row_ok, offs_dn < D, D, F,
                     F, F, D, D, 5, HAS_MASK, ACCURATE, BLOCK_M, D, BK_F,
                     LNN_G, LNN_B, HN, epsn, True, GELU_PROLOGUE, LAST)
        if not LAST:
            tl.debug_barrier()
            # E. the next block's Q|K|V
            _qkv_tiles(HN, WQKV, BQKV, QKV_NEXT, rows, row_ok, D, BLOCK_M, BN_QKV, BK_D, ACCURATE)
