"""A fused attention that is bit-identical to the reference's ATen composition (S <= 1024).

Why this exists (design.md §6): one ulp anywhere in an FP16 layer grows through residual + LayerNorm
into a strict-rule failure after a few layers, so a faster attention is admissible only if it is
*bit-identical* to the op sequence it replaces. SDPA/flash attention are not: they skip the FP16
rounding of the scores and use an online softmax with another summation order. The reference
(``ReferenceTransformer``'s ``Attention.attend``) computes, per head, with q/k/v the Linear outputs
``[B, S, D]`` (head ``h`` = columns ``h*Dh:(h+1)*Dh``)::

    scores = matmul(q, k^T)            # fp16 GEMM: fp32 accumulation, one rounding to fp16
             * scale                   # Dh**-0.5 as a Python float: fp32 multiply, rounded to fp16
    scores[causal future | invalid key] = -inf
    probs  = softmax(scores.float(), -1).half()
    context = matmul(probs, v)         # fp32 accumulation over the keys in order, rounded to fp16

``reference_attention`` is that composition as a pure function (it is also the CPU kernel and the
CUDA fallback of the custom op). The Triton kernel (``_faithful_attention_triton``) keeps every
rounding point and, for the float32 softmax, the exact arithmetic of the kernel ATen runs for rows of
<= 1024 elements: the persistent warp softmax (``softmax_warp_forward`` in
``aten/src/ATen/native/cuda/PersistentSoftmax.cuh``), whose result depends on its summation order:

* WARP = min(next_pow2(S), 32) lanes, lane ``t`` owns the elements ``t + WARP*it``;
* the row max (order-free) then, per lane, ``sum = 0; sum += expf(x - max)`` in ``it`` order, out of
  range / masked elements adding ``expf(-inf) = +0``;
* a ``__shfl_xor`` butterfly over the lanes at offsets WARP/2, ..., 1 (a fixed pairwise tree);
* ``p = e / sum`` with IEEE division, then the cast to fp16.

``emulate_persistent_softmax`` replays that order with plain tensor ops, so the reading of the
source can be checked against ``torch.softmax`` on a GPU independently of the kernel.

The custom op ``kkdeploy_faithful::attention`` dispatches: CPU -> the reference composition; CUDA ->
the Triton kernel when ``select_attention_path`` says so (fp16, S <= 1024, head_dim <= 256, and a
proof made in this environment at this (B*H, S, Dh, causal) that a launch is bit-identical: see
``prove_attention`` for why it is per shape), else the reference composition. Either way the result is
the reference's bits; only the speed differs. This module imports only torch and the standard library;
Triton is imported lazily, on CUDA, when the kernel actually runs.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Callable, Optional

import torch

from kkdeploy.errors import KKError
from kkdeploy.inputs import check_mask
from kkdeploy.models.reference import attention_core

# triton_available is looked up here at call time, so tests can patch it on this module
from .paths import KernelPath, path_from_proof, path_mode, triton_available, triton_refusal
from .proof import (ProofCache, ProofCase, ProofRecord, kernel_environment, launch_table_digest, lookup_proof,
                    prove_launches, remember_proof)

OP_NAMESPACE = "kkdeploy_faithful"
OP_NAME = f"{OP_NAMESPACE}::attention"

#: The kernel's scope. ATen's float32 softmax over the last dim runs the persistent warp softmax for
#: dim_size <= 1024 (host_softmax in SoftMax.cu: dim_size <= 1024 and
#: dim_size * sizeof(float) <= 4096); torch 2.11's PersistentSoftmax.cuh also instantiates 2048 and
#: torch.softmax measured equal to the emulation at S = 2048, but the kernel is built and proven for <= 1024.
MAX_FUSED_SEQ_LEN = 1024
#: the longest row ``softmax_warp_forward`` handles (log2_elements <= 11 in torch 2.11's header).
MAX_PERSISTENT_SOFTMAX_LEN = 2048
#: the largest head size the kernel was built and measured for (accumulator [64, 256] in registers).
MAX_FUSED_HEAD_DIM = 256
#: Why a proof per shape, not per kernel: the reference's own GEMMs are cuBLAS calls whose algorithm cuBLAS picks
#: from the problem size, and a few picks do not accumulate like one in-order tensor-core pass. On the H200, at
#: (B*H, S, Dh) = (2, 333, 256), (2, 333, 128) and (2, 700, 128) ATen's P.V differed from the
#: kernel's in 13-50 elements (scores and probabilities equal), and ATen's own scores changed when the same rows sat
#: in a batch of 32 instead of 2 (docs/faithful-attention.md). So the kernel runs only at an op shape where a proof
#: made here found a launch bit-identical (``prove_attention``; the build proves its model's shape).
OP = "faithful_attention"
SOURCES = (Path(__file__).resolve().with_name("_faithful_attention_triton.py"),)
#: The kernel's launches (name -> ``triton_attention`` options). Each is proven on its own: tile sizes change which
#: MMA instructions the dots lower to.
LAUNCHES = {
    "bm64": dict(block_m=64, sub=1),
    "bm64x2": dict(block_m=64, sub=2),
    "bm128x2": dict(block_m=128, sub=2),
    "onepass": dict(block_m=64, one_pass=True),  # S <= 128: the whole row in one chunk
    # finer causal skipping (block i reads key chunks 0..i): fewer scores computed; smaller tl.dot tiles may take
    # other MMA instructions, so each needs its own bitwise proof
    "bm32": dict(block_m=32, sub=1),
    "bm16": dict(block_m=16, sub=1),
    # S <= 128: each chunk scored once and kept in registers (the three-pass arithmetic without recomputing);
    # ptxas (Triton 3.6, sm_90a): 100 registers at 64 rows / 8 warps, 119 at 32 rows, 80 at 16 rows, no spills
    "cached64w8": dict(block_m=64, cached=True, num_warps=8),
    # 64 rows keep Hopper's wgmma (the 32- and 16-row launches lower to mma.sync and differed under padded masks
    # on the H200, docs/faithful-attention.md). 4 warps: 183 registers, no spills (ptxas, Triton 3.6, sm_90a)
    "cached64w4": dict(block_m=64, cached=True, num_warps=4),
    # the probabilities' division as one reciprocal per row and two fmas (Markstein; exact-rational and interpreter
    # checks in tests/test_faithful_attention.py); ptxas: 130 and 171 registers, no spills
    "bm64_mdiv": dict(block_m=64, sub=1, fast_div=True),
    # three passes whose first takes the max of the raw dot products and rounds and scales it once per row: the same
    # max (the rounding and the scale are monotone), 80 instructions fewer per key chunk (245 -> 165 in the first pass,
    # 64 of its 67 conversions gone; offline PTX, Triton 3.6, sm_90a) where shape 13's attention is compute-bound
    "bm64_mdiv_rawmax": dict(block_m=64, sub=1, fast_div=True, raw_max=True),
    # and each pass over the interior chunks (keys below S and, causal, at or before the block's first row) without
    # the bound and causal masks, then the edge chunks with them: the same scores in the same order. Shape 13's
    # attention is bound by the integer/select pipe (ncu, H100: ALU 63%, FMA 39%); the interior loops have about
    # half its instructions there (offline SASS, Triton 3.6, sm_90a: docs/faithful-attention.md)
    "bm64_mdiv_interior": dict(block_m=64, sub=1, fast_div=True, raw_max=True, interior=True),
    # and the second pass's exps kept in a float32 scratch the third pass reads back: the third pass neither scores
    # its chunks nor takes their exps again. Bit-identical on an H100 but slower at shape 13 (0.484 against 0.359 ms:
    # 23% fewer instructions, but the scratch spills from L2 to DRAM; docs/faithful-attention.md): studies only
    "bm64_mdiv_ecache": dict(block_m=64, sub=1, fast_div=True, raw_max=True, interior=True, ecache=True),
    # the same with a persistent grid of one program per multiprocessor, each reusing one slot of the scratch: at
    # S = 1024 the slots take 132 x 256 KB = 34 MB, under the 50 MB of L2 (the launch above had about 70 MB in
    # flight). 4 warps: 168 registers; 8 warps: 136, its dots m64n16k16 where the others' are m64n32k16 (offline,
    # Triton 3.6, sm_90a). Written on the CPU, not yet run on a GPU: studies only
    "bm64_mdiv_eslots1": dict(block_m=64, sub=1, fast_div=True, raw_max=True, interior=True, ecache=True,
                              ecache_slots=1),
    "bm64w8_mdiv_eslots1": dict(block_m=64, sub=1, fast_div=True, raw_max=True, interior=True, ecache=True,
                                ecache_slots=1, num_warps=8),
    "cached64w4_mdiv": dict(block_m=64, cached=True, num_warps=4, fast_div=True),
    # and each chunk that ends at or before the block's first row (and S) scored without the bound and causal masks:
    # the same scores. Offline SASS (Triton 3.6, sm_90a): such a chunk issues about a third fewer integer/compare/
    # select instructions, on the pipe the S <= 128 launches are heaviest on; at S = 128 two of a head's six chunks
    # are interior. Both branches take 131 registers; capped at 128 (no spills) four 4-warp programs still fit a
    # multiprocessor. Not yet run on a GPU (nor its maxnreg launch option): studies only until a GPU build has
    # proven it and shipped it through strict validation
    "cached64w4_mdiv_interior": dict(block_m=64, cached=True, num_warps=4, fast_div=True, interior=True,
                                     max_registers=128),
    # for wide heads (shape 8's Dh = 256): at 4 warps the cached launch takes 253 registers there, one 4-warp program
    # per multiprocessor; at 8 warps 219, no spills (offline, Triton 3.6, sm_90a, 2 stages). The same 64-row wgmma
    # tiles; for studies (``--all-launches``) until a GPU shows it bit-identical and faster
    "cached64w8_mdiv": dict(block_m=64, cached=True, num_warps=8, fast_div=True),
    "cached32": dict(block_m=32, cached=True),
    "cached16": dict(block_m=16, cached=True),
}
#: the launch a forced kernel (``$KKDEPLOY_FAITHFUL_ATTENTION=triton``) takes, unproven
DEFAULT_LAUNCH = "bm64"
#: the launches a build proves, fastest first where they fit (``proof_launches``): the 64-row tiles, cached in
#: registers for short rows. The others stay for studies (``prove_attention(launches=...)``); a build does not
#: spend compiles on tiles that lower to other MMA instructions or were never faster (docs/faithful-attention.md).
BUILD_LAUNCHES = ("cached64w4_mdiv", "cached64w4", "bm64_mdiv_interior", "bm64_mdiv_rawmax", "bm64_mdiv", "bm64",
                  "bm128x2")
#: what a proof's "proven" means: these launches' settings, and the set a build proves (part of the proofs' key)
LAUNCHES_DIGEST = launch_table_digest(LAUNCHES, BUILD_LAUNCHES)


def launch_fits(name: str, seq_len: int) -> bool:
    """Whether a launch takes rows of ``seq_len`` keys (one-pass and cached launches hold at most 128)."""
    opts = LAUNCHES[name]
    return not ((opts.get("one_pass") or opts.get("cached")) and seq_len > 128)


def proof_launches(seq_len: int) -> list[str]:
    """The launches a build proves for rows of ``seq_len`` keys: BUILD_LAUNCHES that take such rows; where the
    register-cached launches fit (S <= 128), those and bm64 only (three compiles, not five)."""
    fitting = [name for name in BUILD_LAUNCHES if launch_fits(name, seq_len)]
    cached = [name for name in fitting if LAUNCHES[name].get("cached")]
    return cached + [DEFAULT_LAUNCH] if cached else fitting


#: ``auto`` (default): the rules above; ``aten``: never the kernel; ``triton``: the kernel (DEFAULT_LAUNCH) wherever
#: it can run (CUDA, fp16, S <= 1024, head_dim <= 256, Triton importable), proven or not: validate before shipping.
PATH_ENV = "KKDEPLOY_FAITHFUL_ATTENTION"


# ----------------------------------------------------------------------------------------------
# input checks
# ----------------------------------------------------------------------------------------------


def check_attention_inputs(q, k, v, valid_token_mask, num_heads, causal) -> tuple[int, int, int, int]:
    """Reject a call that breaks the op's contract with one line naming the fix; returns B, S, D, Dh."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise KKError(f"{name} must be a torch.Tensor [B, S, D] (a Linear output), got {type(t).__name__}")
        if t.dim() != 3:
            raise KKError(f"{name} must have shape [B, S, D] (heads not split), got {list(t.shape)}")
        if not t.is_floating_point():
            raise KKError(f"{name} must be a floating-point tensor, got {t.dtype}")
    if q.shape != k.shape or q.shape != v.shape:
        raise KKError(
            f"q, k and v must have one shape [B, S, D], got {list(q.shape)}, {list(k.shape)}, {list(v.shape)}"
        )
    if q.dtype != k.dtype or q.dtype != v.dtype:
        raise KKError(f"q, k and v must have one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.device != k.device or q.device != v.device:
        raise KKError(f"q, k and v must be on one device, got {q.device}, {k.device}, {v.device}")
    if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads <= 0:
        raise KKError(f"num_heads must be a positive integer, got {num_heads!r}")
    if not isinstance(causal, bool):
        raise KKError(f"causal must be True or False, got {causal!r}")
    b, s, d = q.shape
    if d % num_heads:
        raise KKError(f"D = {d} is not divisible by num_heads = {num_heads}; pass the model's num_heads")
    check_mask(valid_token_mask, (b, s), q.device, "q")
    return b, s, d, d // num_heads


# ----------------------------------------------------------------------------------------------
# the reference composition and an emulation of ATen's softmax order
# ----------------------------------------------------------------------------------------------


def reference_attention(q, k, v, valid_token_mask, num_heads: int, causal: bool) -> torch.Tensor:
    """The reference attention, op for op (``Attention.attend`` after ``split_heads``): [B, S, D] out.

    Kept as ATen ops on purpose: this is what the fused kernel must equal bit for bit, the CPU kernel
    of the custom op, and its CUDA fallback. The same views and strides as the reference are used so
    that cuBLAS picks the same GEMMs.
    """
    b, s, d, dh = check_attention_inputs(q, k, v, valid_token_mask, num_heads, causal)

    def split_heads(t):
        return t.view(b, s, num_heads, dh).transpose(1, 2)

    q, k, v = split_heads(q), split_heads(k), split_heads(v)
    context = attention_core(q, k, v, valid_token_mask, dh ** -0.5, causal)  # scale: a Python float, as in the reference
    return context.transpose(1, 2).reshape(b, s, num_heads * dh)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def persistent_softmax_layout(seq_len: int) -> tuple[int, int]:
    """(WARP lanes, iterations per lane) of ATen's softmax_warp_forward for a row of ``seq_len``."""
    p2 = _next_pow2(seq_len)
    warp = min(p2, 32)
    return warp, p2 // warp


def emulate_persistent_softmax(x: torch.Tensor, exp: Optional[Callable] = None) -> torch.Tensor:
    """Softmax over the last dim of a float32 tensor in the exact order of ATen's warp softmax.

    ``exp`` defaults to ``torch.exp`` (on CUDA: the accurate ``expf``, as ATen's kernel uses). Every
    step is one IEEE float32 operation per element, so on a GPU this equals ``torch.softmax(x, -1)``
    bit for bit iff the description in the module docstring is right (the selftest checks it).
    """
    if x.dtype != torch.float32:
        raise KKError(f"emulate_persistent_softmax expects float32, got {x.dtype}")
    exp = torch.exp if exp is None else exp
    s = x.shape[-1]
    if not 1 <= s <= MAX_PERSISTENT_SOFTMAX_LEN:
        raise KKError(f"ATen's persistent warp softmax covers rows of 1..{MAX_PERSISTENT_SOFTMAX_LEN} elements, got {s}")
    lead = x.shape[:-1]
    rows = x.reshape(-1, s)
    warp, iters = persistent_softmax_layout(s)
    padded = torch.full((rows.shape[0], warp * iters), float("-inf"), dtype=torch.float32, device=x.device)
    padded[:, :s] = rows
    elements = padded.view(-1, iters, warp)  # element t + warp*it sits at [it, t]
    row_max = elements.amax(dim=(1, 2))  # max is order-free
    e = exp(elements - row_max[:, None, None])
    lane = torch.zeros(rows.shape[0], warp, dtype=torch.float32, device=x.device)
    for it in range(iters):  # per-lane sequential sum, `sum += e` in `it` order
        lane = lane + e[:, it, :]
    width = warp
    while width > 1:  # __shfl_xor butterfly: offset width/2 pairs lane t with t + width/2
        width //= 2
        lane = lane[:, :width] + lane[:, width : 2 * width]
    probs = e / lane[:, :1, None]
    return probs.reshape(rows.shape[0], -1)[:, :s].reshape(*lead, s)


# ----------------------------------------------------------------------------------------------
# which path a call takes
# ----------------------------------------------------------------------------------------------


class AttentionPath(KernelPath):
    """The path a call takes: ``kernel`` is ``"triton"`` (the fused kernel) or ``"aten"``; ``reason`` says why."""


def proof_shape(batch_heads: int, seq_len: int, head_dim: int, causal: bool = True) -> dict:
    """The op shape a proof holds for: the reference's batched GEMMs are (B*H) x [S, Dh] x [Dh, S]."""
    return {"batch_heads": int(batch_heads), "seq_len": int(seq_len), "head_dim": int(head_dim),
            "causal": bool(causal), "dtype": "float16"}


def proof_environment(device: torch.device | str) -> dict:
    """The environment key of the kernel's proofs (device, torch, CUDA, Triton, the kernel's source)."""
    return kernel_environment(device, OP, SOURCES, launches=LAUNCHES_DIGEST)


def kernel_refusal(seq_len: int, head_dim: int, dtype: torch.dtype, device) -> Optional[str]:
    """None when the kernel can run a call of this shape here (proven or not), else why not."""
    platform = triton_refusal(device, dtype, "attention kernels", "the reference composition runs",
                              triton_available)
    if platform:
        return platform
    if not 1 <= seq_len <= MAX_FUSED_SEQ_LEN:
        return (f"S = {seq_len} outside 1..{MAX_FUSED_SEQ_LEN}: the kernel is built and proven for ATen's persistent "
                f"warp softmax up to {MAX_FUSED_SEQ_LEN} keys (longer rows take another softmax kernel)")
    if head_dim > MAX_FUSED_HEAD_DIM:
        return f"head_dim = {head_dim} > {MAX_FUSED_HEAD_DIM}: not built or measured"
    return None


def select_attention_path(seq_len: int, head_dim: int, dtype: torch.dtype, device, *, batch_heads=None,
                          causal: bool = True) -> AttentionPath:
    """Which kernel runs a call of this shape, and why. A pure function of shape, dtype, device and the proofs this
    process knows (no sync). ``batch_heads`` is B * H (the batch count of the reference's GEMMs)."""
    mode = path_mode(PATH_ENV)
    if mode == "aten":
        return AttentionPath("aten", f"{PATH_ENV}=aten")
    refused = kernel_refusal(seq_len, head_dim, dtype, device)
    if refused:
        return AttentionPath("aten", refused)
    if mode == "triton":
        return AttentionPath("triton", f"fused kernel (forced by {PATH_ENV}=triton: validate the result)",
                             DEFAULT_LAUNCH)
    shape = proof_shape(batch_heads or 0, seq_len, head_dim, causal)
    return path_from_proof(AttentionPath, "triton", lookup_proof(proof_environment(device), OP, shape),
                           f"(B*H, S, Dh) = {(batch_heads, seq_len, head_dim)}", "its model's shape")


def proven_ms(batch_heads: int, seq_len: int, head_dim: int, causal: bool, dtype: torch.dtype,
              device) -> Optional[tuple]:
    """(our chosen launch's ms or None, ATen's ms) from the proof made here at this shape; None without a timed
    proof. What ``fused_blocks`` weighs one plan against another with, as ``fused_linear.proven_ms``."""
    if kernel_refusal(seq_len, head_dim, dtype, device):
        return None
    record = lookup_proof(proof_environment(device), OP, proof_shape(batch_heads, seq_len, head_dim, causal))
    return None if record is None else record.timings


def fp32_scale(head_dim: int) -> float:
    """``head_dim ** -0.5`` rounded to float32 (what ATen multiplies the fp16 scores by), as a Python float."""
    return struct.unpack("f", struct.pack("f", head_dim ** -0.5))[0]


def attention_path_for(q: torch.Tensor, num_heads: int, causal: bool = True) -> AttentionPath:
    """``select_attention_path`` for a q of shape [B, S, D] split into ``num_heads`` heads."""
    b, s, d = q.shape
    return select_attention_path(s, d // num_heads, q.dtype, q.device, batch_heads=b * num_heads, causal=causal)


# ----------------------------------------------------------------------------------------------
# the custom op
# ----------------------------------------------------------------------------------------------


@torch.library.custom_op(OP_NAME, mutates_args=())
def _attention_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    valid_token_mask: Optional[torch.Tensor],
    num_heads: int,
    causal: bool,
) -> torch.Tensor:
    """Default (CPU and any non-CUDA device): the reference composition itself."""
    return reference_attention(q, k, v, valid_token_mask, num_heads, causal)


@_attention_op.register_kernel("cuda")
def _attention_cuda(q, k, v, valid_token_mask, num_heads, causal):
    """CUDA: the fused Triton kernel where ``select_attention_path`` allows it, else the composition."""
    b, s, _, dh = check_attention_inputs(q, k, v, valid_token_mask, num_heads, causal)
    path = select_attention_path(s, dh, q.dtype, q.device, batch_heads=b * num_heads, causal=causal)
    if path.fused:
        return run_launch(q, k, v, valid_token_mask, num_heads, causal, path.launch)
    return reference_attention(q, k, v, valid_token_mask, num_heads, causal)


def run_launch(q, k, v, valid_token_mask, num_heads: int, causal: bool, launch: str) -> torch.Tensor:
    """The Triton kernel with one of LAUNCHES (no path rule: what a proof runs)."""
    from ._faithful_attention_triton import triton_attention

    if launch not in LAUNCHES:
        raise KKError(f"unknown attention launch {launch!r}; the launches are {', '.join(LAUNCHES)}")
    return triton_attention(q, k, v, valid_token_mask, num_heads, causal, validate=False, **LAUNCHES[launch])


@_attention_op.register_fake
def _attention_fake(q, k, v, valid_token_mask, num_heads, causal):
    """Shapes only: the output is [B, S, D] like q, in q's dtype and device."""
    if q.dim() != 3 or q.shape != k.shape or q.shape != v.shape:
        raise KKError(f"q, k and v must have one shape [B, S, D], got {list(q.shape)}, {list(k.shape)}, {list(v.shape)}")
    if q.shape[-1] % num_heads != 0:
        raise KKError(f"D = {q.shape[-1]} is not divisible by num_heads = {num_heads}")
    return torch.empty_like(q, memory_format=torch.contiguous_format)


def faithful_attention(q, k, v, valid_token_mask=None, *, num_heads: int, causal: bool = True) -> torch.Tensor:
    """Reference-exact attention on Linear outputs q, k, v [B, S, D]; returns the merged context [B, S, D].

    Invalid query rows are computed like any other (the caller zeros them, as the reference does).
    Goes through ``torch.ops.kkdeploy_faithful.attention`` so that ``torch.compile`` and CUDA graphs
    see one opaque op.
    """
    check_attention_inputs(q, k, v, valid_token_mask, num_heads, causal)
    return torch.ops.kkdeploy_faithful.attention(q, k, v, valid_token_mask, num_heads, causal)


# ----------------------------------------------------------------------------------------------
# the proof
# ----------------------------------------------------------------------------------------------


def attention_case(label: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid_token_mask,
                   num_heads: int, causal: bool) -> ProofCase:
    """One input set of the op (Linear outputs q, k, v [B, S, D], the mask): the reference composition against a
    launch of the kernel."""
    return ProofCase(label, lambda: reference_attention(q, k, v, valid_token_mask, num_heads, causal),
                     lambda launch: run_launch(q, k, v, valid_token_mask, num_heads, causal, launch))


def prove_attention(device: torch.device | str, cases: list[ProofCase], batch_heads: int, seq_len: int,
                    head_dim: int, causal: bool = True, *, launches: Optional[list[str]] = None,
                    budget_s: float = 20.0, repeats: int = 5,
                    cache: Optional[ProofCache] = None) -> ProofRecord:
    """Prove the kernel's launches on ``cases`` (``attention_case``) at this op shape; remember the record for this
    process and in the on-disk cache. Where the kernel cannot run at all, the record says why."""
    shape = proof_shape(batch_heads, seq_len, head_dim, causal)
    environment = proof_environment(device)
    refusal = kernel_refusal(seq_len, head_dim, torch.float16, device)
    if refusal:
        return ProofRecord(op=OP, shape=shape, environment=environment, reason=refusal)  # not cached: cheap
    record = prove_launches(OP, shape, launches or proof_launches(seq_len), cases, device,
                            environment=environment, budget_s=budget_s, repeats=repeats,
                            against_reference=True)
    remember_proof(record, cache)
    return record
