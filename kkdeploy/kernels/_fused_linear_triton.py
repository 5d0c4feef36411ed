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

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

EPILOGUE_CODES = {"none": 0, "gelu": 1, "add_masked": 2, "masked_sum": 3}
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
def _fused_linear_kernel(
    X, W, B, R, MASK, OUT,
    M, N, K,
    stride_xm, stride_wn, stride_rm, stride_om,
    EPILOGUE: tl.constexpr, HAS_MASK: tl.constexpr, ACCURATE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    row_ok = offs_m < M
    col_ok = offs_n < N

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):  # K in order, one accumulator
        kk = k0 + offs_k
        a = tl.load(X + offs_m[:, None] * stride_xm + kk[None, :], mask=row_ok[:, None] & (kk[None, :] < K), other=0.0)
        w = tl.load(W + offs_n[:, None] * stride_wn + kk[None, :], mask=col_ok[:, None] & (kk[None, :] < K), other=0.0)
        acc = tl.dot(a, tl.trans(w), acc)

    bias = tl.load(B + offs_n, mask=col_ok, other=0.0).to(tl.float32)
    y = (acc + bias[None, :]).to(tl.float16)  # the bias inside the float32 accumulator, one rounding

    if EPILOGUE == 1:  # exact GELU, ATen's expression order
        f = y.to(tl.float32)
        out = ((f * 0.5) * (1.0 + _erf(f * 0.7071067811865476, ACCURATE))).to(tl.float16)
    elif EPILOGUE >= 2:
        r = tl.load(R + offs_m[:, None] * stride_rm + offs_n[None, :], mask=row_ok[:, None] & col_ok[None, :],
                    other=0.0)
        if HAS_MASK:
            valid = tl.load(MASK + offs_m, mask=row_ok, other=0) != 0
        else:
            valid = row_ok
        zero = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float16)
        if EPILOGUE == 2:  # r + where(mask, y, 0)
            out = (r.to(tl.float32) + tl.where(valid[:, None], y, zero).to(tl.float32)).to(tl.float16)
        else:  # where(mask, r + y, 0)
            out = tl.where(valid[:, None], (r.to(tl.float32) + y.to(tl.float32)).to(tl.float16), zero)
    else:
        out = y
    tl.store(OUT + offs_m[:, None] * stride_om + offs_n[None, :], out, mask=row_ok[:, None] & col_ok[None, :])


def launch_config(n: int, k: int) -> dict:
    """Tile sizes for an [M, K] x [K, N] call: BLOCK_M 128 (>= 64 keeps wgmma), BLOCK_N the whole row up to 128,
    BLOCK_K up to 64 (the k16 chain is the same whatever BLOCK_K is; it only sets the unrolling)."""
    block_n = min(128, max(16, triton.next_power_of_2(n)))
    block_k = min(64, max(16, triton.next_power_of_2(k)))
    return dict(BLOCK_M=128, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=8 if block_n >= 128 else 4, num_stages=3)


def triton_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, residual=None, mask=None,
                  epilogue: str = "none", **overrides) -> torch.Tensor:
    """Launch the kernel on x [..., K] (unit last stride), weight [N, K], bias [N]; returns [..., N] float16.
    ``residual`` [..., N] and ``mask`` [...] (bool, the rows' validity) for the residual epilogues."""
    code = EPILOGUE_CODES[epilogue]
    n, k = weight.shape
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    weight = weight.contiguous()
    m = x2.shape[0]
    out = torch.empty((*lead, n), dtype=torch.float16, device=x.device)
    out2 = out.view(-1, n)
    if code >= 2:
        r2 = residual.reshape(-1, n)
        if r2.stride(-1) != 1:
            r2 = r2.contiguous()
    else:
        r2 = out2  # never read
    has_mask = mask is not None and code >= 2
    mask1 = mask.reshape(-1).contiguous() if has_mask else out2
    config = {**launch_config(n, k), **overrides}
    block_m, block_n = config["BLOCK_M"], config["BLOCK_N"]
    launch = {key: config.pop(key) for key in ("num_warps", "num_stages") if key in config}
    if not INTERPRET:
        launch.update({key: config.pop(key, value) for key, value in COMPILE_FLAGS.items()})
    else:
        for key in COMPILE_FLAGS:
            config.pop(key, None)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _fused_linear_kernel[grid](
        x2, weight, bias, r2, mask1, out2,
        m, n, k,
        x2.stride(0), weight.stride(0), r2.stride(0), out2.stride(0),
        EPILOGUE=code, HAS_MASK=has_mask, ACCURATE=not INTERPRET, **config, **launch,
    )
    return out
