"""The reference's Linear layers with their next elementwise ops in one launch, bit for bit.

Why: on shape 6 the faithful graph moves every activation through memory once per op: a cuBLAS GEMM writes
``ffn_in``'s output, ATen's GELU reads and writes it again, Inductor's pointwise kernels re-read each residual
and mask, and ``h`` is read three times for Q, K and V. A GEMM whose epilogue does those ops saves the passes;
it is admissible only if it is bit-identical (design.md §6), and a Triton ``tl.dot`` GEMM with the bias added to
its float32 accumulator and rounded once was measured equal to ``F.linear`` (design.md §6). The epilogues are exact
elementwise arithmetic on the rounded float16 value (``_fused_linear_triton``).

The custom op ``kkdeploy_faithful::linear(x, weights, biases, residual, mask, epilogue, prologue="none")``:

* ``weights``/``biases`` are lists: the output is the concatenation of ``F.linear(x, w_i, b_i)`` over the last
  dim, so Q, K and V come out of one launch that reads ``h`` once (``epilogue`` is then ``none``);
* ``epilogue`` is ``none``, ``gelu``, ``add_masked`` (``residual + where(mask, y, 0)``) or ``masked_sum``
  (``where(mask, residual + y, 0)``); ``prologue="gelu"`` makes the GEMM's input GELU(x) (ffn_out reading ffn_in's
  output); ``reference_linear`` is that composition with ATen ops: the op's CPU kernel, and its CUDA kernel wherever
  the Triton kernel is not proven (the same bits by definition);
* ``kkdeploy_faithful::linear_layer_norm`` is a residual epilogue followed by the next LayerNorm of the rows it
  wrote, returning both (``linear_layer_norm``);
* ``linear_path(m, n, k, dtype, device, epilogue=form(...))`` decides: the Triton kernel, with the tile the proof
  chose, where a proof made in this environment found it bit-identical to the ATen composition at this launch's
  (M, N, K) and parts, and faster than it (``prove_linear``; cuBLAS picks the reference's algorithm per problem
  size, so a proof holds for one size); else ATen. ``$KKDEPLOY_FUSED_LINEAR=aten|triton`` forces either (validate
  the result). N is the launch's whole output width (3D for packed Q/K/V).

``kkdeploy.kernels.fused_blocks`` composes these ops into the reference's blocks: what the
``torch-compile-faithful-gemms`` candidate exports.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

from kkdeploy.errors import KKError

from .paths import KernelPath, path_from_proof, path_mode, triton_available, triton_refusal
from .proof import (ProofCache, ProofCase, ProofRecord, kernel_environment, launch_table_digest, lookup_proof,
                    prove_launches, remember_proof)

OP_NAME = "kkdeploy_faithful::linear"
EPILOGUES = ("none", "gelu", "add_masked", "masked_sum")
PATH_ENV = "KKDEPLOY_FUSED_LINEAR"
OP = "fused_linear"
SOURCES = (Path(__file__).resolve().with_name("_fused_linear_triton.py"),)
LN_EPILOGUES = ("add_masked", "masked_sum")
#: the row widths the LayerNorm epilogue takes (ATen's one-warp rows, whole in one tile)
LN_WIDTHS = (16, 32, 64, 128)
#: what the GEMM may do to its input first: "gelu" (ffn_out reading ffn_in's output and computing GELU on the way
#: in, so the GELU's output never reaches memory): the part "gelu_prologue" of a launch's form
PROLOGUES = ("none", "gelu")
LN_OP_NAME = "kkdeploy_faithful::linear_layer_norm"
NORM_OP_NAME = "kkdeploy_faithful::norm_linear"
#: the part of a launch's form for a GEMM that reads its input through the rows' LayerNorm (``norm_linear``: norm2
#: before ffn_in, norm1 before Q|K|V), so that the LayerNorm's output never reaches memory and its launch goes
NORM_PROLOGUE = "layer_norm_prologue"
#: the epilogues such a launch takes: ffn_in's GELU, or none (Q|K|V, or ffn_in where the GELU runs elsewhere)
NORM_EPILOGUES = ("none", "gelu")
#: every part a launch can have (``form``)
PARTS = ("none", "gelu", "add_masked", "masked_sum", "gelu_prologue", "layer_norm", "ffn_chain", "qkv", NORM_PROLOGUE)
FFN_OP_NAME = "kkdeploy_faithful::ffn_layer_norm"
#: the feed-forward launch's form (``ffn_layer_norm``): ffn_in, GELU, ffn_out, residual and mask, the next LayerNorm;
#: its proof shape is ffn_out's GEMM, (M, N, K) = (M, D, F)
FFN_FORM = "ffn_chain+masked_sum+layer_norm"
FFN_QKV_OP_NAME = "kkdeploy_faithful::ffn_layer_norm_qkv"
#: ... and then the next block's packed Q|K|V of the normalized rows, from the same launch (``ffn_layer_norm_qkv``)
FFN_QKV_FORM = FFN_FORM + "+qkv"
#: the kernel's tiles (launch variants): BLOCK_M x BLOCK_N output tiles, warps, pipeline stages. K is walked in
#: order in every one (the k16 MMA chain on one float32 accumulator), so none changes what is computed in
#: principle; each is still proven on its own, because the tile decides which MMA instructions Triton emits.
#: "auto" is ``launch_config``: BLOCK_M 128, BLOCK_N the row up to 128.
TILES: dict[str, dict] = {
    "auto": {},
    "m64": dict(BLOCK_M=64, num_warps=4, num_stages=4),
    "n64": dict(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=4),
    "n256": dict(BLOCK_M=128, BLOCK_N=256, num_warps=8, num_stages=3),
    # the operands brought in by Hopper's TMA (``_fused_linear_tma_kernel``): the same k16 chain of wgmma, the
    # copies asynchronous and without per-thread addresses. Compiled offline for sm_90a, the same wgmma instructions
    # and arithmetic as the pointer-load tile of the same size (tests/test_fused_linear.py). Not in BUILD_TILES until
    # a GPU run shows them bit-identical and faster somewhere (scripts/kernel_selftest.py --all-launches).
    "tma": dict(BLOCK_M=128, num_warps=8, num_stages=4, TMA=True),
    "tma_n256": dict(BLOCK_M=128, BLOCK_N=256, num_warps=8, num_stages=3, TMA=True),
    # the TMA tile from one program per multiprocessor walking its tiles, grouped 8 row tiles at a time for L2:
    # cuBLAS's persistent strategy for the large GEMMs our tiles trail at K = 1024 (shape 8). Each tile computes what
    # the TMA tile computes (the same floating-point instructions, compiled for sm_90a).
    "tma_persistent": dict(BLOCK_M=128, num_warps=8, num_stages=4, TMA=True, PERSISTENT=True),
    # the TMA tile's k-loop warp-specialized (Triton 3.6's Hopper pass): a producer warpgroup for the copies and two
    # consumer warpgroups of 4 warps (384 threads), each with 64 of the 128 rows: cuBLAS's cooperative layout. Compiled
    # for sm_90a, each consumer issues the 8-warp TMA tile's wgmma and floating-point instructions, as many of each
    # (tests/test_fused_linear.py); 168 registers, no spills. On an H100 it never returns (``HANGS``).
    "tma_ws": dict(BLOCK_M=128, BLOCK_N=128, num_warps=4, num_stages=4, TMA=True, WS=True),
    # the same with k-steps of 128 (3 stages, 192 KB of shared memory): half the barriers and waits per FLOP, the
    # same k16 chain of wgmma per accumulator (168 registers, no spills, compiled for sm_90a)
    "tma_ws_k128": dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, num_warps=4, num_stages=3, TMA=True, WS=True),
    # pointer-load tiles for the GEMMs that take longest (shape 8's K = 1024, the custom shapes' few rows): a deeper
    # pipeline, a longer k-step, one warpgroup, taller or smaller tiles. Studied (``--all-launches``) before any joins
    # BUILD_TILES, on the same terms as the TMA tiles.
    "s4": dict(BLOCK_M=128, num_warps=8, num_stages=4),
    "k128": dict(BLOCK_M=128, BLOCK_K=128, num_warps=8, num_stages=3),
    "w4": dict(BLOCK_M=128, num_warps=4, num_stages=3),
    "m256": dict(BLOCK_M=256, BLOCK_N=128, num_warps=8, num_stages=3),
    "n256s4": dict(BLOCK_M=128, BLOCK_N=256, num_warps=8, num_stages=4),
    # "m64n64" loads its epilogue's bias, residual and mask before the k-loop (``EARLY``): its launches are a few
    # microseconds (grids that leave multiprocessors idle), and loads after the loop are one more round trip to L2 on
    # their critical path. The same wgmma and floating-point instructions in the same order (offline, sm_90a). On an
    # H100 (session 45) bit-identical in builds and every bench, and shape 3's `-gemms-pdl` 0.0805 and 0.0840 ms
    # without it against 0.0784 with it (with the LayerNorm tiles' and the Q|K|V attention's early loads; one bench
    # process each, interleaved, docs/fused-linear.md)
    "m64n64": dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=4, EARLY=True),
    # for GEMMs that stream their activations (K <= 128, many row tiles: shape 6): the 64-row tile with two stages.
    # At K = 128 a tile has two k-steps, so "auto", "m64" and "n64" allocate stages they never fill: 96 KB of shared
    # memory each, two programs per multiprocessor. Two stages take 48 KB, four programs (compiled offline for sm_90a,
    # Triton 3.6: 114-136 registers at 4 warps). The same k16 chain; proven like every tile before it runs.
    "m64s2": dict(BLOCK_M=64, num_warps=4, num_stages=2),
    # the same two tiles with the grid's columns first (``COLUMNS_FIRST``): a row block's column tiles launched one
    # after another, so a launch of several column tiles whose X outgrows L2 reads X once, not once per column tile
    # (shape 6's Q|K|V: 328 MB of X, three column tiles: about 1.3 GB of traffic instead of 2.0). Only the programs'
    # order changes: compiled for sm_90a, the tile's wgmma and floating-point instructions in its order
    # (tests/test_fused_linear.py). On an H100 (session 43) bit-identical on every shape-6 launch, and shape 6's Q|K|V
    # in 0.631 ms against "auto"'s 0.785 and "m64s2"'s 0.814 (docs/fused-linear.md)
    "cols": dict(COLUMNS_FIRST=True),
    "m64s2cols": dict(BLOCK_M=64, num_warps=4, num_stages=2, COLUMNS_FIRST=True),
    # narrower tiles for the launch-bound shapes (session 48; in builds since session 49): shape 3's 512 x 128 GEMMs
    # make 16 programs of "m64n64" on 132 multiprocessors, each a chain of round trips to L2 and, for the GELU GEMM,
    # of 32 exact GELUs a thread. "m64n32" makes 32 programs and "m64n16" 64, still 64 rows (wgmma m64n32k16 and
    # m64n16k16): offline (sm_90a, ``scripts/offline_ptx.py --sass``) 54 and 40 registers, no spills, and the GELU
    # GEMM's SASS after its last MMA 645 and 351 instructions a thread against 1,272. On an H100 (session 49)
    # bit-identical on every op shape of shapes 1-5, 7, 9 and 12, and shape 3's GELU GEMM 2.2 µs against 3.1
    # (docs/fused-linear.md)
    "m64n32": dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=4, EARLY=True),
    "m64n16": dict(BLOCK_M=64, BLOCK_N=16, num_warps=4, num_stages=4, EARLY=True),
    # ... and a probe of the rule itself: 32 rows, which Triton lowers to mma.sync m16n8k16, not wgmma (48
    # registers). The attention's 32- and 16-row launches, on mma.sync, differed from cuBLAS by one ulp on padded
    # inputs (docs/faithful-attention.md, "Cached chunks"); this GEMM's did not on an H100 (session 49: every op
    # shape proven, 0 differing), and shape 7's GELU GEMM took it
    "m32n32": dict(BLOCK_M=32, BLOCK_N=32, num_warps=4, num_stages=2, EARLY=True),
}
#: tiles that never returned on a GPU: a study of every launch (``--all-launches``) leaves them out, so that one hung
#: kernel does not hold a study for its silence bound; naming one (``--launches linear=tma_ws``) still studies it, for
#: a Triton whose Hopper warp specialization returns. Session 40, an H100 with Triton 3.6.0: each launch of these
#: tiles, from 256 x 256 x 128 to shape 8's 8192 x 3072 x 1024, was still running 30 s later (docs/fused-linear.md).
HANGS: dict[str, str] = {name: "never returned on an H100 (sm_90, Triton 3.6.0): Triton's Hopper warp specialization"
                         for name, tile in TILES.items() if tile.get("WS")}
#: the tiles a build proves (each one a compile per op shape: a build's time counts them). The H200 study found
#: "tma", "tma_n256" and "m64n64" bit-identical on every op shape it tried and the fastest of ours on some
#: (docs/fused-linear.md); they join only once a build on the GPU has shipped them through its strict validation.
#: "m64n64" has (session 37, an H100: shapes 3 and 7 built and run strict, 0 failed; docs/fused-linear.md has the
#: timings), and ``tile_pays`` keeps it to launches whose "auto" grid leaves multiprocessors idle. The columns-first
#: tiles have too (session 43, an H100: a new user's build of shape 6 shipped "cols" for Q|K|V, strict PASS, 0 of
#: 163,840,000 elements failed), and ``tile_pays`` keeps them to launches of several column tiles whose X outgrows L2.
#: The narrower tiles have too (session 49, an H100: new users' builds of shapes 3 and 2 shipped "m64n16" and
#: "m64n32", strict PASS on padded runs, 0 failed; the bench of shape 7 shipped "m32n32", 0 failed on every trial),
#: and ``tile_pays`` keeps them, as "m64n64", to launches whose "auto" grid leaves multiprocessors idle.
BUILD_TILES = ("auto", "m64", "n64", "n256", "m64s2", "m64n64", "cols", "m64s2cols", "m64n32", "m64n16", "m32n32")


#: The LayerNorm epilogue's tiles: one tile holds 64 whole rows. "auto" stores the sum and reads it back in the
#: LayerNorm's layout ([row, lane, 4]); "regs" takes the rows from the accumulator in registers instead (8 warps),
#: and "regs_w4" at 4 warps. Under Triton's interpreter the three give the same bits (tests/test_fused_linear.py).
#: On an H100 (session 36, shape 3's out_proj + residual + norm2, M 512-8192) all three were bit-identical to ATen,
#: and "regs" took 5.4-5.9 µs and "regs_w4" 6.3-6.8 against "auto"'s 8.8-11.4 (docs/fused-linear.md). Rows under
#: 128 are always read back (the lanes past the row are masked there), so only "auto" applies to them. The register
#: tiles load their bias, residual and mask before the k-loop, as "m64n64" does (session 45: bit-identical in builds,
#: faster on the launch-bound shapes); "auto", which also serves shape 6's long launches, keeps the late loads.
LN_TILES: dict[str, dict] = {
    "auto": {},
    "regs": dict(LN_RELOAD=False, EARLY=True),
    "regs_w4": dict(LN_RELOAD=False, num_warps=4, EARLY=True),
    # 16 warps (session 47, not yet run on a GPU): at shape 3 the epilogue's 512 rows make 8 programs, two warps per
    # scheduler at 8 warps, and its LayerNorm is a chain of dependent float32 steps; 4 warps per scheduler hide more
    # of each step's latency. Offline (Triton 3.6.0, sm_90a): 64 registers, no spills, 1,599 PTX lines a thread
    # against 2,098 at 8 warps (more in all: the tree's last levels are repeated in every thread). Since session 48
    # it loads the LayerNorm's weight and bias early too (``LN_EARLY``, below; 79 registers), as it never ran without
    "regs_w16": dict(LN_RELOAD=False, num_warps=16, EARLY=True, LN_EARLY=True),
    # "regs" with the LayerNorm's weight and bias loaded before the k-loop too (``LN_EARLY``, session 48, studies
    # only): compiled for sm_90a, "regs" issues their loads about 20 instructions before the rsqrt that they follow,
    # one round trip to L2 on the launch's critical path. The tiles below load them early as well
    "regs_e": dict(LN_RELOAD=False, EARLY=True, LN_EARLY=True),
    # fewer rows a program (session 48, studies only): 32 rows make 16 programs at shape 3 and 16 rows 32, at 8 warps
    # each thread with a half or a quarter of the 64-row tile's (row, lane) pairs, spread over more multiprocessors
    # instead of more warps on each. Offline (Triton 3.6.0, sm_90a, ``scripts/offline_ptx.py --sass``), the SASS
    # instructions a thread runs after the last MMA: 626 and 383 against 1,009 for "regs" (623 for "regs_w16", which
    # keeps wgmma). Under 64 rows the GEMM half is mma.sync, not wgmma (106 and 80 registers with the early loads, no
    # spills): the rule the attention's 32-row launches broke by one ulp
    # on padded inputs (docs/faithful-attention.md), so these probe it and a proof on the GPU decides
    "regs_m32": dict(LN_RELOAD=False, BLOCK_M=32, num_warps=8, EARLY=True, LN_EARLY=True),
    "regs_m16": dict(LN_RELOAD=False, BLOCK_M=16, num_warps=8, EARLY=True, LN_EARLY=True),
}
#: the LayerNorm epilogue's tiles a build proves: "auto", "regs" and "regs_w4", since builds on the GPU shipped "regs"
#: through their strict validation (session 37, an H200: shapes 3 and 12, 0 failed; docs/fused-linear.md has the
#: timings), the rule the GEMM tiles follow. "regs_w16", "regs_e", "regs_m32" and "regs_m16" join once a GPU build
#: has shipped them. Each was bit-identical on an H100 wherever its proof ran (session 49: the epilogue op shapes of
#: shapes 1-5, 9 and 12, the 32- and 16-row tiles up to 8,192 rows). "regs_m16" was the fastest up to 2,048 rows
#: (shape 3: 4.5 µs against "regs"' 5.8) and "regs_e" above. But with the narrower GEMM tiles, the residual GEMM and
#: the rows LayerNorm took less than either (shape 3: 2.0 + 1.7 µs), so no plan ran the epilogue and no build has
#: shipped them.
LN_BUILD_TILES = ("auto", "regs", "regs_w4")


#: The feed-forward launch's tiles (``_fused_ffn_kernel``): 64 whole rows per program, ffn_in's columns BLOCK_F at a
#: time. "auto" reads the rows back for the LayerNorm, "regs" takes them from the accumulator (8 warps), "regs_w4" at
#: 4 warps; "regs_f128" computes ffn_in's columns 128 at a time. Rows under 128 take "auto" only, as the LayerNorm
#: epilogue. Under Triton's interpreter each equals ffn_in's launch followed by ffn_out's LayerNorm launch with the
#: GELU prologue, bit for bit (tests/test_fused_linear.py); on a GPU a proof decides, as for every tile.
FFN_TILES: dict[str, dict] = {
    "auto": {},
    "regs": dict(LN_RELOAD=False),
    "regs_w4": dict(LN_RELOAD=False, num_warps=4),
    "regs_f128": dict(LN_RELOAD=False, BLOCK_F=128),
}
#: the feed-forward tiles a build proves: none yet. All four were bit-identical on an H100 (session 41, shapes 3 and 6)
#: once their dots walked K in steps of 64, but the launch did not pay end to end: shape 3 with it 0.0935 ms
#: (`-gemms-pdl`) against 0.0909 without (two processes back to back), though its proof timed it at 11.5 µs against
#: 12.9 for the two launches it replaces; on shape 6 it took 1.32 ms against 0.71 for ffn_in's and ffn_out's streaming
#: tiles (docs/fused-linear.md). A study still proves them (``--launches linear=regs``, ``--all-launches``).
FFN_BUILD_TILES: tuple[str, ...] = ()

#: The LayerNorm prologue's tiles (``norm_linear``; session 51, written without a GPU): the GEMM tile, each row's
#: statistics first from its whole row, in the rows LayerNorm's layout and order (``_rows_stats``), then every k-step's
#: columns normalized as that LayerNorm normalizes them and rounded to float16 before the same dot. On the
#: launch-bound shapes a block's norm1 and norm2 are launches of their own (1.7 µs each in shape 3's proof on an H100,
#: session 47), and each such launch is one more step of the graph's serial chain. The statistics cost registers: at 4
#: warps a 64-row tile holds 64 float32 values of its rows a thread and spills (255 registers), so these run 8 warps,
#: or 32 rows. Offline (Triton 3.6.0, sm_90a, ``scripts/offline_ptx.py --sass``, shape 3's ffn_in with its GELU):
#: "ln_m64n32_w8" 178 registers, no spills, 1,856 SASS instructions a thread (the plain "m64n32" 895 at 4 warps);
#: "ln_m64n16_w8" 184 and 1,725; "ln_m32n32_w8" 98 and 1,026 (mma.sync, as "m32n32", which an H100 proved in session
#: 49; the plain "m32n32" 483); "ln_m16n32" 128 and 1,037 (mma.sync on 16 rows, 4 warps: the plain tile 580);
#: "ln_m64_w8" (the row up to 128 wide, for Q|K|V's 384 columns) 254 and 2,821 at N = 128. Under Triton's
#: interpreter each equals the rows LayerNorm followed by the plain tile (tests/test_fused_linear.py); whether one is
#: bit-identical and faster on a GPU only a proof there can say.
NORM_TILES: dict[str, dict] = {
    "ln_m64n32_w8": dict(BLOCK_M=64, BLOCK_N=32, num_warps=8, num_stages=2, EARLY=True),
    "ln_m64n16_w8": dict(BLOCK_M=64, BLOCK_N=16, num_warps=8, num_stages=2, EARLY=True),
    "ln_m32n32_w8": dict(BLOCK_M=32, BLOCK_N=32, num_warps=8, num_stages=2, EARLY=True),
    "ln_m16n32": dict(BLOCK_M=16, BLOCK_N=32, num_warps=4, num_stages=2, EARLY=True),
    "ln_m64_w8": dict(BLOCK_M=64, num_warps=8, num_stages=2, EARLY=True),
}
#: the LayerNorm prologue's tiles a build proves: none. On an H100 (session 51, weights seed 954) every tile was
#: bit-identical on every case of shapes 3 and 12, and "ln_m16n32" the fastest: shape 3's norm2 + ffn_in + GELU in
#: 3.21 µs against 1.69 + 2.22 for the rows LayerNorm and the GELU GEMM apart. End to end (``scripts/ab_bench.py``,
#: shape 3, one process a side) it paid without dependent launches (`-gemms` 0.0789 -> 0.0767 ms, 29 -> 25 launches)
#: and lost with them (`-gemms-pdl` 0.0665 -> 0.0777 ms), and `-gemms-pdl` is what ships, so builds leave it out until
#: that is understood (docs/fused-linear.md). That A/B's edited side proved every GEMM of the plan again (one digest
#: then keyed all four families), so it may have run other tiles there; ``TILES_DIGESTS`` keys each family apart. A
#: study proves them (``--launches linear=ln_m16n32``), and then the model's proof adds its norm launches
#: (``fused_blocks.norm_launches``)
NORM_BUILD_TILES: tuple[str, ...] = ()

#: the tile tables a launch's proof draws from, by its parts' family (``tile_family``): the tiles' settings and the
#: set a build proves
FAMILY_TABLES: dict[str, tuple] = {
    "gemm": (TILES, BUILD_TILES),
    "layer_norm": (LN_TILES, LN_BUILD_TILES),
    "ffn": (FFN_TILES, FFN_BUILD_TILES),
    "norm": (NORM_TILES, NORM_BUILD_TILES),
}
#: what a proof's "proven" means, per family (part of the proofs' key): a change to one family's table proves again
#: only the launches that family serves, and every other record stands
TILES_DIGESTS: dict[str, str] = {family: launch_table_digest(*tables) for family, tables in FAMILY_TABLES.items()}


def tile_family(form: str) -> str:
    """Which tile table serves a launch with the parts ``form``: the LayerNorm prologue's ("norm"), the feed-forward
    launch's ("ffn"), the LayerNorm epilogue's ("layer_norm"), else the GEMM's ("gemm")."""
    parts = form.split("+")
    if NORM_PROLOGUE in parts:
        return "norm"
    if "ffn_chain" in parts:
        return "ffn"
    if "layer_norm" in parts:
        return "layer_norm"
    return "gemm"


def norm_tile_fits(launch: str, k: int, n: Optional[int] = None) -> bool:
    """Whether a LayerNorm prologue tile applies to rows of ``k`` (one of LN_WIDTHS: a tile reads whole rows) and
    outputs of width ``n`` (a tile no wider than the row's power of two)."""
    if launch not in NORM_TILES or k not in LN_WIDTHS:
        return False
    block_n = NORM_TILES[launch].get("BLOCK_N")
    return block_n is None or n is None or block_n <= max(16, 1 << (max(1, n) - 1).bit_length())


def norm_form(epilogue: str) -> str:
    """The form of a LayerNorm-prologue launch: "layer_norm_prologue+gelu" (norm2, ffn_in and its GELU)."""
    return f"{NORM_PROLOGUE}+{epilogue}"


def ffn_tile_fits(launch: str, d: int, f: Optional[int] = None) -> bool:
    """Whether a feed-forward tile applies to rows of ``d`` with ``f`` hidden columns: the register tiles need rows
    of 128, and a column chunk no wider than F's power of two."""
    if launch not in FFN_TILES:
        return False
    if launch == "auto":
        return True
    block_f = FFN_TILES[launch].get("BLOCK_F", 64)
    return d == 128 and (f is None or block_f <= max(16, 1 << (max(1, f) - 1).bit_length()))


def ln_tile_fits(launch: str, n: int) -> bool:
    """Whether a LayerNorm epilogue tile applies to rows of ``n``: the register tiles need rows of 128."""
    return launch == "auto" or (launch in LN_TILES and n == 128)


#: what Hopper's TMA needs of a tensor it reads: a 16-byte aligned base and row stride
TMA_ALIGNMENT = 16


def tma_fits(k: int) -> bool:
    """Whether rows of ``k`` float16 values can be read by TMA (a row stride of a multiple of 16 bytes)."""
    return (k * 2) % TMA_ALIGNMENT == 0


def tile_fits(launch: str, n: int, k: Optional[int] = None) -> bool:
    """Whether a tile is worth a compile for outputs of width ``n`` (a wider tile than the row only idles), and, for
    a TMA tile, whether rows of ``k`` can be read by TMA (when ``k`` is given)."""
    tile = TILES[launch]
    if tile.get("TMA") and k is not None and not tma_fits(k):
        return False
    if k is not None and tile.get("BLOCK_K", 0) > max(16, k):  # a k-step longer than K only adds zeros
        return False
    block_n = tile.get("BLOCK_N")
    if block_n is None:
        return True
    return n >= block_n * 2 if block_n == 64 else n >= block_n


#: TMA tiles pay where the k-loop is long enough for asynchronous copies to hide latency: the H200 study found them the
#: fastest of ours at K = 384, 768 and 1024 (docs/fused-linear.md); K <= 128 (shapes 1-7, 9-13) was never studied with
#: them and keeps the pointer-load tiles, so those builds compile nothing more
TMA_MIN_K = 256
#: tiles for launches whose "auto" grid leaves multiprocessors idle: more, smaller tiles
SMALL_TILES = ("m64n64", "m64n32", "m64n16", "m32n32")
#: tiles for launches that stream their rows (K <= STREAM_MAX_K and at least STREAM_MIN_WAVES 64-row tiles per
#: multiprocessor: shape 6's 20,000 row tiles on 132, not shape 13's 1,024): more programs per multiprocessor
STREAM_TILES = ("m64s2", "m64s2cols")
STREAM_MAX_K = 128
STREAM_MIN_WAVES = 16
#: X bytes past which a launch's X is taken not to stay in L2 between its column tiles (the H100's and H200's L2 is
#: 50 MB): where a columns-first tile can pay
COLUMNS_FIRST_MIN_X_BYTES = 64 << 20
#: CUDA's limit on a grid's second dimension (a columns-first grid puts the row tiles there)
MAX_GRID_Y = 65535


def auto_block_n(n: int) -> int:
    """The tile width "auto" takes for rows of ``n`` (``launch_config``'s: the row up to 128, at least 16)."""
    return min(128, max(16, 1 << (max(1, n) - 1).bit_length()))


def tile_pays(launch: str, m: Optional[int], n: int, k: Optional[int], sms: Optional[int]) -> bool:
    """Whether a tile that fits can pay for its compile and proof in a build: a TMA tile where K >= TMA_MIN_K, a
    small tile where "auto"'s grid of 128 x 128 tiles is smaller than the multiprocessors (``sms``), a streaming tile
    where the rows stream (``STREAM_TILES``). Unknown sizes (None) do not rule a tile out, except a streaming tile's,
    which is for known large launches only."""
    if TILES[launch].get("TMA"):
        return k is None or k >= TMA_MIN_K
    if TILES[launch].get("COLUMNS_FIRST"):  # several column tiles, X beyond L2, the row tiles within the grid's y
        block_m = TILES[launch].get("BLOCK_M", 128)
        block_n = TILES[launch].get("BLOCK_N", auto_block_n(n))
        if None in (m, k) or n <= block_n or m * k * 2 < COLUMNS_FIRST_MIN_X_BYTES or -(-m // block_m) > MAX_GRID_Y:
            return False
    if launch in STREAM_TILES:
        return (None not in (m, k, sms) and k <= STREAM_MAX_K
                and -(-m // TILES[launch]["BLOCK_M"]) >= STREAM_MIN_WAVES * sms)
    if launch in SMALL_TILES:
        if m is None or sms is None:
            return True
        return -(-m // 128) * -(-n // auto_block_n(n)) < sms
    return True


def multiprocessors(device) -> Optional[int]:
    """The multiprocessors of a CUDA device (None elsewhere): what a small tile's grid is measured against."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_properties(device).multi_processor_count


def proof_launches(n: int, layer_norm: bool = False, k: Optional[int] = None, m: Optional[int] = None,
                   sms: Optional[int] = None) -> list[str]:
    """The tiles a build proves for a launch [m, k] x [k, n] on a device of ``sms`` multiprocessors: those of
    BUILD_TILES that fit (``tile_fits``) and can pay (``tile_pays``). The LayerNorm epilogue holds whole rows in
    tiles of its own: those of LN_BUILD_TILES that fit (``ln_tile_fits``)."""
    if layer_norm:
        return [name for name in LN_BUILD_TILES if ln_tile_fits(name, n) and ln_tile_pays(name, m, sms)]
    return [name for name in BUILD_TILES if tile_fits(name, n, k) and tile_pays(name, m, n, k, sms)]


def ln_tile_pays(launch: str, m: Optional[int], sms: Optional[int]) -> bool:
    """Whether a LayerNorm epilogue tile can pay for its compile and proof in a build: a tile of fewer rows than
    the 64 of the others only where 64-row programs leave multiprocessors idle (the launch-bound shapes; not shape
    6's 20,000 programs or shape 13's 1,024). Unknown sizes (None) do not rule it out."""
    if LN_TILES[launch].get("BLOCK_M", 64) >= 64 or m is None or sms is None:
        return True
    return -(-m // 64) < sms


class LinearPath(KernelPath):
    """``kernel`` is ``"triton"`` (our GEMM with its epilogue) or ``"aten"``; ``reason`` says why."""


def proof_shape(m: int, n: int, k: int, form: str) -> dict:
    """The op shape a proof holds for: the GEMM [m, k] x [k, n] (n: the launch's whole width) with its parts."""
    return {"m": int(m), "n": int(n), "k": int(k), "form": form, "dtype": "float16"}


def proof_environment(device: torch.device | str, form: str) -> dict:
    """The environment key of the proofs of launches with the parts ``form`` (device, torch, CUDA, Triton, the
    kernel's source, the CUDA libdevice its GELU launches link: ``kkdeploy.kernels.libdevice``, and the digest of
    the tile tables of the form's family, ``tile_family``)."""
    from .libdevice import libdevice_sources

    return kernel_environment(device, OP, SOURCES + libdevice_sources(), launches=TILES_DIGESTS[tile_family(form)])


def kernel_refusal(dtype: torch.dtype, device) -> Optional[str]:
    """None when the kernel can run here (proven or not), else why not."""
    return triton_refusal(device, dtype, "GEMM kernels", "ATen's ops run", triton_available)


def linear_path(m: int, n: int, k: int, dtype: torch.dtype, device, epilogue: str = "none") -> LinearPath:
    """Which kernel computes a launch [m, k] x [k, n] with the parts ``epilogue`` (``form``), with which tile, and
    why. No device sync."""
    mode = path_mode(PATH_ENV)
    if mode == "aten":
        return LinearPath("aten", f"{PATH_ENV}=aten")
    refused = kernel_refusal(dtype, device)
    if refused:
        return LinearPath("aten", refused)
    if mode == "triton":
        return LinearPath("triton", f"Triton GEMM (forced by {PATH_ENV}=triton: validate the result)", "auto")
    return path_from_proof(LinearPath, "triton", lookup_proof(proof_environment(device, epilogue), OP,
                                                              proof_shape(m, n, k, epilogue)),
                           f"(M, N, K) = {(m, n, k)} with {epilogue}", "its model's GEMMs")


def proven_ms(m: int, n: int, k: int, form_: str, dtype: torch.dtype, device) -> Optional[tuple]:
    """(our chosen tile's ms or None, ATen's ms) from the proof made here for this launch; None without a timed
    proof. What ``fused_blocks`` weighs one plan against another with."""
    if kernel_refusal(dtype, device):
        return None
    record = lookup_proof(proof_environment(device, form_), OP, proof_shape(m, n, k, form_))
    return None if record is None else record.timings


def tile_config(launch: Optional[str], n: int, k: int) -> dict:
    """The ``triton_linear`` overrides of a tile (BLOCK_N never wider than the row needs)."""
    if launch not in TILES and launch is not None:
        raise KKError(f"unknown GEMM tile {launch!r}; the tiles are {', '.join(TILES)}")
    return dict(TILES.get(launch or "auto", {}))


def check_linear_inputs(x, weights, biases, residual, mask, epilogue, prologue: str = "none") -> tuple[int, int, int]:
    """A one-line KKError for a call outside the op's contract; returns (M, N per weight, K)."""
    if epilogue not in EPILOGUES:
        raise KKError(f"epilogue must be one of {', '.join(EPILOGUES)}, got {epilogue!r}")
    if prologue not in PROLOGUES:
        raise KKError(f"prologue must be one of {', '.join(PROLOGUES)}, got {prologue!r}")
    if not weights or len(weights) != len(biases):
        raise KKError(f"give one bias per weight (got {len(weights)} weights, {len(biases)} biases)")
    if len(weights) > 1 and epilogue != "none":
        raise KKError(f"several weights (packed projections) take epilogue 'none', got {epilogue!r}")
    k = x.shape[-1]
    n = weights[0].shape[0]
    for w, b in zip(weights, biases):
        if w.dim() != 2 or tuple(w.shape) != (n, k) or b is None or tuple(b.shape) != (n,):
            raise KKError(f"every weight must be [{n}, {k}] with a bias [{n}] (x's last dim is {k}); got "
                          f"{list(w.shape)} and {None if b is None else list(b.shape)}")
    if epilogue in ("add_masked", "masked_sum"):
        if residual is None or tuple(residual.shape) != (*x.shape[:-1], n):
            raise KKError(f"epilogue {epilogue} needs a residual of shape {[*x.shape[:-1], n]}, got "
                          f"{None if residual is None else list(residual.shape)}")
        if mask is not None and (mask.dtype != torch.bool or tuple(mask.shape) != tuple(x.shape[:-1])):
            raise KKError(f"the mask must be bool of shape {list(x.shape[:-1])}, got {mask.dtype} "
                          f"{list(mask.shape)}")
    m = x.numel() // k if k else 0
    return m, n, k


def reference_linear(x, weights, biases, residual=None, mask=None, epilogue: str = "none",
                     prologue: str = "none") -> torch.Tensor:
    """The ATen composition the op replaces (the reference's own ops, in its order)."""
    if prologue == "gelu":
        x = F.gelu(x, approximate="none")
    y = torch.cat([F.linear(x, w, b) for w, b in zip(weights, biases)], dim=-1) if len(weights) > 1 else \
        F.linear(x, weights[0], biases[0])
    if epilogue == "gelu":
        return F.gelu(y, approximate="none")
    invalid = None if mask is None else ~mask[..., None]
    if epilogue == "add_masked":
        return residual + (y if invalid is None else y.masked_fill(invalid, 0))
    if epilogue == "masked_sum":
        total = residual + y
        return total if invalid is None else total.masked_fill(invalid, 0)
    return y


@torch.library.custom_op(OP_NAME, mutates_args=())
def _linear_op(x: torch.Tensor, weights: list[torch.Tensor], biases: list[torch.Tensor],
               residual: Optional[torch.Tensor], mask: Optional[torch.Tensor], epilogue: str,
               prologue: str = "none") -> torch.Tensor:
    """Default (CPU and any non-CUDA device): the ATen composition itself."""
    check_linear_inputs(x, weights, biases, residual, mask, epilogue, prologue)
    return reference_linear(x, weights, biases, residual, mask, epilogue, prologue)


def form(epilogue: str, prologue: str = "none", layer_norm: bool = False) -> str:
    """A launch's parts, as proofs name them: "gelu_prologue+masked_sum+layer_norm"."""
    parts = (["gelu_prologue"] if prologue == "gelu" else []) + [epilogue] + (["layer_norm"] if layer_norm else [])
    return "+".join(parts)


@_linear_op.register_kernel("cuda")
def _linear_cuda(x, weights, biases, residual, mask, epilogue, prologue="none"):
    """CUDA: the Triton GEMM where ``linear_path`` allows it, else the composition."""
    m, n, k = check_linear_inputs(x, weights, biases, residual, mask, epilogue, prologue)
    path = linear_path(m, n * len(weights), k, x.dtype, x.device, epilogue=form(epilogue, prologue))
    if path.fused:
        return run_launch(x, weights, biases, residual, mask, epilogue, prologue, path.launch)
    return reference_linear(x, weights, biases, residual, mask, epilogue, prologue)


def run_launch(x, weights, biases, residual, mask, epilogue: str, prologue: str, launch: Optional[str]):
    """The Triton GEMM with one of TILES (no path rule: what a proof runs)."""
    from ._fused_linear_triton import triton_linear

    weight, bias = (weights[0], biases[0]) if len(weights) == 1 else packed(weights, biases)
    return triton_linear(x, weight, bias, residual, mask, epilogue, prologue,
                         **tile_config(launch, weight.shape[0], weight.shape[1]))


_PACKED: "dict[tuple, tuple[torch.Tensor, torch.Tensor]]" = {}
PACKED_CACHE_SIZE = 64


def packed(weights, biases) -> tuple[torch.Tensor, torch.Tensor]:
    """The weights and biases concatenated (Q, K, V side by side), made once per set of tensors and reused.

    Why cached: a model's projections do not change between calls, and a ``torch.cat`` per call would put two
    more kernels per block into every CUDA graph (the launch-bound shapes feel each one). The key holds each
    tensor's storage address and version counter, so an in-place update of a weight (``load_state_dict``,
    ``copy_``) makes a new entry instead of serving stale values. Inference tensors have no version counter: they
    are concatenated per call."""
    tensors = (*weights, *biases)
    if any(t.is_inference() for t in tensors):  # no version counter to key on: concatenate per call
        return torch.cat(list(weights), dim=0), torch.cat(list(biases), dim=0)
    key = tuple((t.data_ptr(), t._version, tuple(t.shape), t.dtype, str(t.device)) for t in tensors)
    hit = _PACKED.get(key)
    if hit is None:
        if len(_PACKED) >= PACKED_CACHE_SIZE:
            _PACKED.pop(next(iter(_PACKED)))  # the oldest entry
        hit = _PACKED[key] = (torch.cat(list(weights), dim=0), torch.cat(list(biases), dim=0))
    return hit


@_linear_op.register_fake
def _linear_fake(x, weights, biases, residual, mask, epilogue, prologue="none"):
    n = sum(w.shape[0] for w in weights)
    return x.new_empty((*x.shape[:-1], n))


def check_norm_linear_inputs(x, ln_weight, ln_bias, weights, biases, epilogue: str) -> tuple[int, int, int]:
    """The contract of ``norm_linear``: a LayerNorm over x's last dim, then the Linear(s) and the epilogue; returns
    (M, N per weight, K)."""
    if epilogue not in NORM_EPILOGUES:
        raise KKError(f"a Linear after a LayerNorm takes the epilogue {' or '.join(NORM_EPILOGUES)}, got {epilogue!r}")
    k = x.shape[-1]
    for name, t in (("ln_weight", ln_weight), ("ln_bias", ln_bias)):
        if t is None or tuple(t.shape) != (k,):
            raise KKError(f"{name} must be [{k}] (the LayerNorm over x's last dim), got "
                          f"{None if t is None else list(t.shape)}")
    return check_linear_inputs(x, weights, biases, None, None, epilogue)


def reference_norm_linear(x, ln_weight, ln_bias, eps: float, weights, biases, epilogue: str = "none"):
    """The ATen composition: ``F.layer_norm`` (what nn.LayerNorm runs), then ``reference_linear``."""
    normed = F.layer_norm(x, (x.shape[-1],), ln_weight, ln_bias, eps)
    return reference_linear(normed, list(weights), list(biases), epilogue=epilogue)


@torch.library.custom_op(NORM_OP_NAME, mutates_args=())
def _norm_linear_op(x: torch.Tensor, ln_weight: torch.Tensor, ln_bias: torch.Tensor, eps: float,
                    weights: list[torch.Tensor], biases: list[torch.Tensor], epilogue: str) -> torch.Tensor:
    """Default (CPU and any non-CUDA device): the ATen composition itself."""
    check_norm_linear_inputs(x, ln_weight, ln_bias, weights, biases, epilogue)
    return reference_norm_linear(x, ln_weight, ln_bias, eps, weights, biases, epilogue)


@_norm_linear_op.register_kernel("cuda")
def _norm_linear_cuda(x, ln_weight, ln_bias, eps, weights, biases, epilogue):
    """CUDA: the GEMM with the LayerNorm prologue where a proof of its form at (M, N, K) allows it, else the
    composition."""
    m, n, k = check_norm_linear_inputs(x, ln_weight, ln_bias, weights, biases, epilogue)
    path = linear_path(m, n * len(weights), k, x.dtype, x.device, epilogue=norm_form(epilogue)) \
        if k in LN_WIDTHS else None
    if path is not None and path.fused:
        return run_norm_launch(x, ln_weight, ln_bias, eps, weights, biases, epilogue, path.launch)
    return reference_norm_linear(x, ln_weight, ln_bias, eps, weights, biases, epilogue)


def run_norm_launch(x, ln_weight, ln_bias, eps, weights, biases, epilogue: str, launch: Optional[str] = None):
    """The GEMM with the LayerNorm prologue in one of NORM_TILES (no path rule: what a proof runs)."""
    from ._fused_linear_triton import triton_norm_linear

    weights, biases = list(weights), list(biases)
    weight, bias = (weights[0], biases[0]) if len(weights) == 1 else packed(weights, biases)
    launch = launch or next(iter(NORM_TILES))
    if not norm_tile_fits(launch, weight.shape[1], weight.shape[0]):
        raise KKError(f"LayerNorm prologue tile {launch!r} does not apply to rows of {weight.shape[1]} and "
                      f"{weight.shape[0]} outputs; the tiles are {', '.join(NORM_TILES)}, for rows of "
                      f"{', '.join(map(str, LN_WIDTHS))}")
    return triton_norm_linear(x, ln_weight, ln_bias, eps, weight, bias, epilogue, **NORM_TILES[launch])


@_norm_linear_op.register_fake
def _norm_linear_fake(x, ln_weight, ln_bias, eps, weights, biases, epilogue):
    return x.new_empty((*x.shape[:-1], sum(w.shape[0] for w in weights)))


def norm_linear(x, norm: torch.nn.LayerNorm, weights, biases, epilogue: str = "none") -> torch.Tensor:
    """``reference_linear(norm(x), weights, biases, epilogue=epilogue)``: one launch where proven, the LayerNorm
    computed by the GEMM on its way in (``kkdeploy_faithful::norm_linear``)."""
    weights, biases = list(weights), list(biases)
    check_norm_linear_inputs(x, norm.weight, norm.bias, weights, biases, epilogue)
    return torch.ops.kkdeploy_faithful.norm_linear(x, norm.weight, norm.bias, float(norm.eps), weights, biases,
                                                   epilogue)


def check_layer_norm_epilogue(x, weight, bias, residual, mask, ln_weight, ln_bias, epilogue,
                              prologue: str = "none") -> tuple[int, int, int]:
    """The contract of ``linear_layer_norm``: a residual epilogue and a LayerNorm over the output's last dim."""
    if epilogue not in LN_EPILOGUES:
        raise KKError(f"the LayerNorm epilogue follows {' or '.join(LN_EPILOGUES)}, got {epilogue!r}")
    m, n, k = check_linear_inputs(x, [weight], [bias], residual, mask, epilogue, prologue)
    for name, t in (("ln_weight", ln_weight), ("ln_bias", ln_bias)):
        if t is None or tuple(t.shape) != (n,):
            raise KKError(f"{name} must be [{n}] (the LayerNorm over the Linear's {n} outputs), got "
                          f"{None if t is None else list(t.shape)}")
    return m, n, k


def reference_linear_layer_norm(x, weight, bias, residual, mask, ln_weight, ln_bias, eps: float, epilogue: str,
                                prologue: str = "none", zero_invalid: bool = False):
    """The ATen composition: the residual epilogue's sum, and ``F.layer_norm`` of it (what nn.LayerNorm runs), its
    invalid rows zeroed with ``zero_invalid`` (the model's ``zero_invalid_rows(final_norm(x))``)."""
    total = reference_linear(x, [weight], [bias], residual, mask, epilogue, prologue)
    normed = F.layer_norm(total, (total.shape[-1],), ln_weight, ln_bias, eps)
    if zero_invalid and mask is not None:
        normed = normed.masked_fill(~mask[..., None], 0)
    return total, normed


@torch.library.custom_op(LN_OP_NAME, mutates_args=())
def _linear_layer_norm_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, residual: torch.Tensor,
                          mask: Optional[torch.Tensor], ln_weight: torch.Tensor, ln_bias: torch.Tensor, eps: float,
                          epilogue: str, prologue: str = "none",
                          zero_invalid: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Default (CPU and any non-CUDA device): the ATen composition itself."""
    check_layer_norm_epilogue(x, weight, bias, residual, mask, ln_weight, ln_bias, epilogue, prologue)
    return reference_linear_layer_norm(x, weight, bias, residual, mask, ln_weight, ln_bias, eps, epilogue, prologue,
                                       zero_invalid)


@_linear_layer_norm_op.register_kernel("cuda")
def _linear_layer_norm_cuda(x, weight, bias, residual, mask, ln_weight, ln_bias, eps, epilogue, prologue="none",
                            zero_invalid=False):
    """CUDA: the Triton GEMM with both epilogues where ``linear_path`` allows it, else the composition."""
    m, n, k = check_layer_norm_epilogue(x, weight, bias, residual, mask, ln_weight, ln_bias, epilogue, prologue)
    path = linear_path(m, n, k, x.dtype, x.device, epilogue=form(epilogue, prologue, True)) if n in LN_WIDTHS else None
    if path is not None and path.fused:
        return run_layer_norm_launch(x, weight, bias, residual, mask, ln_weight, ln_bias, eps, epilogue, prologue,
                                     zero_invalid, path.launch)
    return reference_linear_layer_norm(x, weight, bias, residual, mask, ln_weight, ln_bias, eps, epilogue, prologue,
                                       zero_invalid)


def run_layer_norm_launch(x, weight, bias, residual, mask, ln_weight, ln_bias, eps, epilogue, prologue="none",
                          zero_invalid=False, launch: Optional[str] = None):
    """The Triton GEMM with the residual and LayerNorm epilogues in one of LN_TILES (no path rule: what a proof
    runs)."""
    from ._fused_linear_triton import triton_linear_layer_norm

    if launch is not None and not ln_tile_fits(launch, weight.shape[0]):
        raise KKError(f"LayerNorm epilogue tile {launch!r} does not apply to rows of {weight.shape[0]}; the tiles are "
                      f"{', '.join(LN_TILES)} (the register ones for rows of 128)")
    return triton_linear_layer_norm(x, weight, bias, residual, mask, ln_weight, ln_bias, eps, epilogue, prologue,
                                    zero_invalid, **LN_TILES[launch or "auto"])


@_linear_layer_norm_op.register_fake
def _linear_layer_norm_fake(x, weight, bias, residual, mask, ln_weight, ln_bias, eps, epilogue, prologue="none",
                            zero_invalid=False):
    out = x.new_empty((*x.shape[:-1], weight.shape[0]))
    return out, torch.empty_like(out)


def linear_layer_norm(x, weight, bias, residual, mask, norm: torch.nn.LayerNorm, epilogue: str,
                      prologue: str = "none", zero_invalid: bool = False):
    """(``sum``, ``norm(sum)``) with ``sum`` the residual epilogue of ``F.linear(x, weight, bias)`` (of GELU(x) with
    ``prologue="gelu"``; ``zero_invalid``: ``norm(sum)``'s invalid rows zeroed): one launch where proven
    (``kkdeploy_faithful::linear_layer_norm``)."""
    check_layer_norm_epilogue(x, weight, bias, residual, mask, norm.weight, norm.bias, epilogue, prologue)
    return torch.ops.kkdeploy_faithful.linear_layer_norm(x, weight, bias, residual, mask, norm.weight, norm.bias,
                                                         float(norm.eps), epilogue, prologue, bool(zero_invalid))


def fused_linear(x, weights, biases, residual=None, mask=None, epilogue: str = "none",
                 prologue: str = "none") -> torch.Tensor:
    """``torch.ops.kkdeploy_faithful.linear`` with the contract checked first (one line on bad input)."""
    weights, biases = list(weights), list(biases)
    check_linear_inputs(x, weights, biases, residual, mask, epilogue, prologue)
    return torch.ops.kkdeploy_faithful.linear(x, weights, biases, residual, mask, epilogue, prologue)


def check_ffn_inputs(x, w_in, b_in, w_out, b_out, residual, mask, ln_weight, ln_bias) -> tuple[int, int, int]:
    """The contract of ``ffn_layer_norm``: ffn_in [F, D], ffn_out [D, F], a residual and a LayerNorm over D; returns
    (M, D, F)."""
    d = x.shape[-1]
    if w_in.dim() != 2 or w_in.shape[1] != d or b_in is None or tuple(b_in.shape) != (w_in.shape[0],):
        raise KKError(f"ffn_in must be [F, {d}] with a bias [F] (x's last dim is {d}); got {list(w_in.shape)} and "
                      f"{None if b_in is None else list(b_in.shape)}")
    f = w_in.shape[0]
    if w_out.dim() != 2 or tuple(w_out.shape) != (d, f) or b_out is None or tuple(b_out.shape) != (d,):
        raise KKError(f"ffn_out must be [{d}, {f}] with a bias [{d}] (back to x's width from ffn_in's {f}); got "
                      f"{list(w_out.shape)} and {None if b_out is None else list(b_out.shape)}")
    if residual is None or tuple(residual.shape) != tuple(x.shape):
        raise KKError(f"the feed-forward's residual must have x's shape {list(x.shape)}, got "
                      f"{None if residual is None else list(residual.shape)}")
    if mask is not None and (mask.dtype != torch.bool or tuple(mask.shape) != tuple(x.shape[:-1])):
        raise KKError(f"the mask must be bool of shape {list(x.shape[:-1])}, got {mask.dtype} {list(mask.shape)}")
    for name, t in (("ln_weight", ln_weight), ("ln_bias", ln_bias)):
        if t is None or tuple(t.shape) != (d,):
            raise KKError(f"{name} must be [{d}] (the LayerNorm over the feed-forward's {d} outputs), got "
                          f"{None if t is None else list(t.shape)}")
    return (x.numel() // d if d else 0), d, f


def reference_ffn_layer_norm(x, w_in, b_in, w_out, b_out, residual, mask, ln_weight, ln_bias, eps: float,
                             zero_invalid: bool = False):
    """The ATen composition: ``F.linear`` (ffn_in), then ffn_out's LayerNorm launch with the GELU prologue
    (``reference_linear_layer_norm``): ``where(mask, residual + ffn_out(GELU(ffn_in(x))), 0)`` and its LayerNorm."""
    return reference_linear_layer_norm(F.linear(x, w_in, b_in), w_out, b_out, residual, mask, ln_weight, ln_bias, eps,
                                       "masked_sum", "gelu", zero_invalid)


@torch.library.custom_op(FFN_OP_NAME, mutates_args=())
def _ffn_layer_norm_op(x: torch.Tensor, w_in: torch.Tensor, b_in: torch.Tensor, w_out: torch.Tensor,
                       b_out: torch.Tensor, residual: torch.Tensor, mask: Optional[torch.Tensor],
                       ln_weight: torch.Tensor, ln_bias: torch.Tensor, eps: float,
                       zero_invalid: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Default (CPU and any non-CUDA device): the ATen composition itself."""
    check_ffn_inputs(x, w_in, b_in, w_out, b_out, residual, mask, ln_weight, ln_bias)
    return reference_ffn_layer_norm(x, w_in, b_in, w_out, b_out, residual, mask, ln_weight, ln_bias, eps, zero_invalid)


@_ffn_layer_norm_op.register_kernel("cuda")
def _ffn_layer_norm_cuda(x, w_in, b_in, w_out, b_out, residual, mask, ln_weight, ln_bias, eps, zero_invalid=False):
    """CUDA: the feed-forward launch where ``linear_path`` allows it (a proof of FFN_FORM at (M, D, F)), else the
    composition."""
    m, d, f = check_ffn_inputs(x, w_in, b_in, w_out, b_out, residual, mask, ln_weight, ln_bias)
    path = linear_path(m, d, f, x.dtype, x.device, epilogue=FFN_FORM) if d in LN_WIDTHS else None
    if path is not None and path.fused:
        return run_ffn_launch(x, w_in, b_in, w_out, b_out, residual, mask, ln_weight, ln_bias, eps, zero_invalid,
                              path.launch)
    return reference_ffn_layer_norm(x, w_in, b_in, w_out, b_out, residual, mask, ln_weight, ln_bias, eps, zero_invalid)


def run_ffn_launch(x, w_in, b_in, w_out, b_out, residual, mask, ln_weight, ln_bias, eps, zero_invalid=False,
                   launch: Optional[str] = None, qkv_weights=None, qkv_biases=None):
    """The feed-forward launch in one of FFN_TILES (no path rule: what a proof runs); with ``qkv_weights`` and
    ``qkv_biases`` (Q, K and V's), its second output is the next block's packed Q|K|V."""
    from ._fused_linear_triton import triton_ffn_layer_norm

    if launch is not None and not ffn_tile_fits(launch, w_in.shape[1], w_in.shape[0]):
        raise KKError(f"feed-forward tile {launch!r} does not apply to rows of {w_in.shape[1]} and F = "
                      f"{w_in.shape[0]}; the tiles are {', '.join(FFN_TILES)} (the register ones for rows of 128)")
    qkv = {}
    if qkv_weights is not None:
        weight, bias = packed(list(qkv_weights), list(qkv_biases))
        qkv = dict(qkv_weight=weight, qkv_bias=bias)
    return triton_ffn_layer_norm(x, w_in, b_in, w_out, b_out, residual, mask, ln_weight, ln_bias, eps, zero_invalid,
                                 **qkv, **FFN_TILES[launch or "auto"])


@_ffn_layer_norm_op.register_fake
def _ffn_layer_norm_fake(x, w_in, b_in, w_out, b_out, residual, mask, ln_weight, ln_bias, eps, zero_invalid=False):
    out = x.new_empty((*x.shape[:-1], w_out.shape[0]))
    return out, torch.empty_like(out)


def check_qkv_weights(d: int, qkv_weights, qkv_biases) -> None:
    """The next block's Q, K and V projections: three weights [D, D] and biases [D]."""
    if len(qkv_weights) != 3 or len(qkv_biases) != 3 or any(
            tuple(w.shape) != (d, d) or b is None or tuple(b.shape) != (d, ) for w, b in zip(qkv_weights, qkv_biases)):
        shapes = [list(w.shape) for w in qkv_weights], [None if b is None else list(b.shape) for b in qkv_biases]
        raise KKError(f"the next Q|K|V takes Q, K and V's weights [{d}, {d}] and biases [{d}], got {shapes[0]} and "
                      f"{shapes[1]}")


def reference_ffn_layer_norm_qkv(x, w_in, b_in, w_out, b_out, residual, mask, ln_weight, ln_bias, eps: float,
                                 qkv_weights, qkv_biases):
    """The ATen composition: the feed-forward launch's (sum, LayerNorm), then the packed Q|K|V of the LayerNorm's rows
    (``reference_linear``: Q, K and V concatenated)."""
    total, normed = reference_ffn_layer_norm(x, w_in, b_in, w_out, b_out, residual, mask, ln_weight, ln_bias, eps)
    return total, reference_linear(normed, list(qkv_weights), list(qkv_biases))


@torch.library.custom_op(FFN_QKV_OP_NAME, mutates_args=())
def _ffn_layer_norm_qkv_op(x: torch.Tensor, w_in: torch.Tensor, b_in: torch.Tensor, w_out: torch.Tensor,
                           b_out: torch.Tensor, residual: torch.Tensor, mask: Optional[torch.Tensor],
                           ln_weight: torch.Tensor, ln_bias: torch.Tensor, eps: float, qkv_weights: list[torch.Tensor],
                           qkv_biases: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Default (CPU and any non-CUDA device): the ATen composition itself."""
    _, d, _ = check_ffn_inputs(x, w_in, b_in, w_out, b_out, residual, mask, ln_weight, ln_bias)
    check_qkv_weights(d, qkv_weights, qkv_biases)
    return reference_ffn_layer_norm_qkv(x, w_in, b_in, w_out, b_out, residual, mask, ln_weight, ln_bias, eps,
                                        qkv_weights, qkv_biases)


@_ffn_layer_norm_qkv_op.register_kernel("cuda")
def _ffn_layer_norm_qkv_cuda(x, w_in, b_in, w_out, b_out, residual, mask, ln_weight, ln_bias, eps, qkv_weights,
                             qkv_biases):
    """CUDA: the feed-forward launch with the next Q|K|V where a proof of FFN_QKV_FORM at (M, D, F) allows it, else
    the composition."""
    m, d, f = check_ffn_inputs(x, w_in, b_in, w_out, b_out, residual, mask, ln_weight, ln_bias)
    check_qkv_weights(d, qkv_weights, qkv_biases)
    path = linear_path(m, d, f, x.dtype, x.device, epilogue=FFN_QKV_FORM) if d in LN_WIDTHS else None
    if path is not None and path.fused:
        return run_ffn_launch(x, w_in, b_in, w_out, b_out, residual, mask, ln_weight, ln_bias, eps, False, path.launch,
                              qkv_weights, qkv_biases)
    return reference_ffn_layer_norm_qkv(x, w_in, b_in, w_out, b_out, residual, mask, ln_weight, ln_bias, eps,
                                        qkv_weights, qkv_biases)


@_ffn_layer_norm_qkv_op.register_fake
def _ffn_layer_norm_qkv_fake(x, w_in, b_in, w_out, b_out, residual, mask, ln_weight, ln_bias, eps, qkv_weights,
                             qkv_biases):
    d = w_out.shape[0]
    return x.new_empty((*x.shape[:-1], d)), x.new_empty((*x.shape[:-1], 3 * d))


def ffn_layer_norm_qkv(x, ffn_in: torch.nn.Linear, ffn_out: torch.nn.Linear, residual, mask, norm: torch.nn.LayerNorm,
                       projections):
    """(``sum``, the next block's packed Q|K|V of ``norm(sum)``): ``ffn_layer_norm`` followed by the next block's
    Q, K and V projections (``projections``), one launch where proven (``kkdeploy_faithful::ffn_layer_norm_qkv``)."""
    _, d, _ = check_ffn_inputs(x, ffn_in.weight, ffn_in.bias, ffn_out.weight, ffn_out.bias, residual, mask,
                               norm.weight, norm.bias)
    weights, biases = [p.weight for p in projections], [p.bias for p in projections]
    check_qkv_weights(d, weights, biases)
    return torch.ops.kkdeploy_faithful.ffn_layer_norm_qkv(x, ffn_in.weight, ffn_in.bias, ffn_out.weight, ffn_out.bias,
                                                          residual, mask, norm.weight, norm.bias, float(norm.eps),
                                                          weights, biases)


def ffn_layer_norm(x, ffn_in: torch.nn.Linear, ffn_out: torch.nn.Linear, residual, mask, norm: torch.nn.LayerNorm,
                   zero_invalid: bool = False):
    """(``sum``, ``norm(sum)``) with ``sum = where(mask, residual + ffn_out(GELU(ffn_in(x))), 0)``: the block's whole
    feed-forward and the next LayerNorm, one launch where proven (``kkdeploy_faithful::ffn_layer_norm``)."""
    check_ffn_inputs(x, ffn_in.weight, ffn_in.bias, ffn_out.weight, ffn_out.bias, residual, mask, norm.weight,
                     norm.bias)
    return torch.ops.kkdeploy_faithful.ffn_layer_norm(x, ffn_in.weight, ffn_in.bias, ffn_out.weight, ffn_out.bias,
                                                      residual, mask, norm.weight, norm.bias, float(norm.eps),
                                                      bool(zero_invalid))


# -- the proof ------------------------------------------------------------------------------------------------
def compiled_baseline(x, weights, biases, residual=None, epilogue: str = "none", layer_norm=None,
                      prologue: str = "none"):
    """What the faithful compiled graph runs instead of one launch, for timing: ATen's GELU first where the launch has
    the GELU prologue, cuBLAS's GEMMs one by one (no concatenation: the graph keeps Q, K and V apart), then ATen's
    GELU where the launch has the GELU epilogue, or one elementwise pass where Inductor fuses the residual and mask
    (an add stands for it), then ATen's LayerNorm where the launch has that epilogue."""
    def run():
        source = F.gelu(x, approximate="none") if prologue == "gelu" else x
        ys = [F.linear(source, w, b) for w, b in zip(weights, biases)]
        if epilogue == "gelu":
            ys = [F.gelu(ys[0], approximate="none")]
        if epilogue in ("add_masked", "masked_sum") and residual is not None:
            ys = [torch.add(ys[0], residual)]
        if layer_norm is not None:
            weight, bias, eps = layer_norm
            ys.append(F.layer_norm(ys[0], (ys[0].shape[-1],), weight, bias, eps))
        return ys

    return run


def linear_case(label: str, x, weights, biases, residual=None, mask=None, epilogue: str = "none",
                prologue: str = "none") -> ProofCase:
    """One call of a launch: the ATen composition (``reference_linear``) against a tile of the Triton GEMM, timed
    against ``compiled_baseline``."""
    weights, biases = list(weights), list(biases)
    return ProofCase(label, lambda: reference_linear(x, weights, biases, residual, mask, epilogue, prologue),
                     lambda launch: run_launch(x, weights, biases, residual, mask, epilogue, prologue, launch),
                     compiled_baseline(x, weights, biases, residual, epilogue, prologue=prologue))


def linear_layer_norm_case(label: str, x, weight, bias, residual, mask, ln_weight, ln_bias, eps: float,
                           epilogue: str, prologue: str = "none", zero_invalid: bool = False) -> ProofCase:
    """One call of the LayerNorm epilogue: both outputs compared (stacked)."""
    def reference():
        return torch.stack(reference_linear_layer_norm(x, weight, bias, residual, mask, ln_weight, ln_bias, eps,
                                                       epilogue, prologue, zero_invalid))

    def run(launch):
        return torch.stack(run_layer_norm_launch(x, weight, bias, residual, mask, ln_weight, ln_bias, eps, epilogue,
                                                 prologue, zero_invalid, launch))

    return ProofCase(label, reference, run,
                     compiled_baseline(x, [weight], [bias], residual, epilogue, (ln_weight, ln_bias, eps), prologue))


def norm_linear_case(label: str, x, ln_weight, ln_bias, eps: float, weights, biases,
                     epilogue: str = "none") -> ProofCase:
    """One call of the LayerNorm-prologue launch against the ATen composition (``reference_norm_linear``), timed
    against ATen's LayerNorm followed by ``compiled_baseline``'s GEMMs."""
    weights, biases = list(weights), list(biases)

    def baseline():
        normed = F.layer_norm(x, (x.shape[-1],), ln_weight, ln_bias, eps)
        return compiled_baseline(normed, weights, biases, epilogue=epilogue)()

    return ProofCase(label, lambda: reference_norm_linear(x, ln_weight, ln_bias, eps, weights, biases, epilogue),
                     lambda launch: run_norm_launch(x, ln_weight, ln_bias, eps, weights, biases, epilogue, launch),
                     baseline)


def ffn_baseline(x, w_in, b_in, w_out, b_out, residual, ln_weight, ln_bias, eps):
    """What the faithful compiled graph would run instead of the feed-forward launch, for timing: cuBLAS's ffn_in,
    ATen's GELU, cuBLAS's ffn_out, one elementwise pass for the residual (an add stands for it), ATen's LayerNorm."""
    def run():
        g = F.gelu(F.linear(x, w_in, b_in), approximate="none")
        total = torch.add(F.linear(g, w_out, b_out), residual)
        return [total, F.layer_norm(total, (total.shape[-1],), ln_weight, ln_bias, eps)]

    return run


def ffn_layer_norm_case(label: str, x, w_in, b_in, w_out, b_out, residual, mask, ln_weight, ln_bias, eps: float,
                        zero_invalid: bool = False) -> ProofCase:
    """One call of the feed-forward launch: both outputs compared (stacked) against the ATen composition."""
    def reference():
        return torch.stack(reference_ffn_layer_norm(x, w_in, b_in, w_out, b_out, residual, mask, ln_weight, ln_bias,
                                                    eps, zero_invalid))

    def run(launch):
        return torch.stack(run_ffn_launch(x, w_in, b_in, w_out, b_out, residual, mask, ln_weight, ln_bias, eps,
                                          zero_invalid, launch))

    return ProofCase(label, reference, run,
                     ffn_baseline(x, w_in, b_in, w_out, b_out, residual, ln_weight, ln_bias, eps))


def ffn_layer_norm_qkv_case(label: str, x, w_in, b_in, w_out, b_out, residual, mask, ln_weight, ln_bias, eps: float,
                            qkv_weights, qkv_biases) -> ProofCase:
    """One call of the feed-forward launch with the next Q|K|V: the sum and the packed Q|K|V compared (flattened and
    concatenated), against the ATen composition; timed against it with the Q, K and V GEMMs one by one."""
    def reference():
        total, qkv = reference_ffn_layer_norm_qkv(x, w_in, b_in, w_out, b_out, residual, mask, ln_weight, ln_bias, eps,
                                                  qkv_weights, qkv_biases)
        return torch.cat([total.reshape(-1), qkv.reshape(-1)])

    def run(launch):
        total, qkv = run_ffn_launch(x, w_in, b_in, w_out, b_out, residual, mask, ln_weight, ln_bias, eps, False,
                                    launch, qkv_weights, qkv_biases)
        return torch.cat([total.reshape(-1), qkv.reshape(-1)])

    feed_forward = ffn_baseline(x, w_in, b_in, w_out, b_out, residual, ln_weight, ln_bias, eps)

    def baseline():
        total, normed = feed_forward()
        return [total, *(F.linear(normed, w, b) for w, b in zip(qkv_weights, qkv_biases))]

    return ProofCase(label, reference, run, baseline)


def prove_linear(device: torch.device | str, cases: list[ProofCase], m: int, n: int, k: int, form_: str, *,
                 launches: Optional[list[str]] = None, budget_s: float = 20.0, repeats: int = 5,
                 cache: Optional[ProofCache] = None) -> ProofRecord:
    """Prove the GEMM's tiles on ``cases`` (``linear_case``) for the launch [m, k] x [k, n] with the parts
    ``form_``; remember the record for this process and in the on-disk cache. What the compiled graph would run
    instead is timed too (``compiled_baseline``): a tile slower than it is not chosen (shape 8's (8192, 1024, 1024)
    on the H200: 0.10 ms against cuBLAS's 0.05)."""
    shape = proof_shape(m, n, k, form_)
    environment = proof_environment(device, form_)
    refusal = kernel_refusal(torch.float16, device)
    parts = form_.split("+")
    layer_norm = "layer_norm" in parts
    if not refusal and layer_norm and n not in LN_WIDTHS:
        refusal = f"the LayerNorm epilogue takes rows of {', '.join(map(str, LN_WIDTHS))}, not {n}"
    if not refusal and NORM_PROLOGUE in parts and k not in LN_WIDTHS:
        refusal = f"the LayerNorm prologue takes rows of {', '.join(map(str, LN_WIDTHS))}, not {k}"
    if refusal:
        return ProofRecord(op=OP, shape=shape, environment=environment, reason=refusal)  # not cached: cheap
    family = tile_family(form_)
    if family == "norm":
        tiles = launches or [name for name in NORM_BUILD_TILES if norm_tile_fits(name, k, n)]
    elif family == "ffn":
        tiles = launches or [name for name in FFN_BUILD_TILES if ffn_tile_fits(name, n, k)]
    else:
        tiles = launches or proof_launches(n, layer_norm, k, m, multiprocessors(device))
    record = prove_launches(OP, shape, tiles, cases, device, environment=environment, budget_s=budget_s,
                            repeats=repeats, against_reference=True)
    remember_proof(record, cache)
    return record
