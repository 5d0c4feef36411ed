"""ATen's float16 LayerNorm for narrow rows (<= 128 elements) as one warp per row: the same bits, a launch that fits.

Why: the compiled faithful graph keeps every LayerNorm as ATen's own kernel (Inductor's fused LayerNorm rounds
differently, design.md §6). ATen's ``vectorized_layer_norm_kernel`` runs one 4-warp block per row, and a row of
128 float16 values occupies one warp of it: on shape 6 the 9 LayerNorms took 12.7 of the graph's 31.8 ms
(H200, torch 2.11, ``scripts/profile_candidate.py --shape 6 --candidate torch-compile-faithful-attention``).
``csrc/layer_norm.cu`` computes each row with ATen's arithmetic in ATen's order (``csrc/welford.cuh``, shared with
the ONNX Runtime custom op that was proven bit-identical) on one warp, 8 rows per block.

* ``rows_kernel_reason(x, normalized_shape, weight, bias)``: None when the kernel computes this call (CUDA,
  float16, a last dim of 4..128 that is a multiple of 4, weight and bias given, ATen's vector-path alignment),
  else why ATen runs.
* ``layer_norm_path(device)``: whether this platform was proven (``PROVEN_PLATFORMS``,
  ``scripts/layer_norm_selftest.py``); ``$KKDEPLOY_LAYER_NORM=aten|kernel`` forces either (validate the result).
* The custom op ``kkdeploy_faithful::layer_norm_rows`` has ``aten.layer_norm``'s schema: on the CPU, or where
  the kernel does not apply, it *is* ``aten.layer_norm``; so a graph can swap it in without changing a bit
  anywhere the kernel is not proven.
"""

from __future__ import annotations

import ctypes
import functools
import os
from pathlib import Path
from typing import Callable, Optional

import torch

from kkdeploy.errors import KKError

from .cuda_build import load_problem, platform_key
from .paths import KernelPath

OP_NAME = "kkdeploy_faithful::layer_norm_rows"
SOURCE = Path(__file__).resolve().parent / "csrc" / "layer_norm.cu"
HEADER = SOURCE.with_name("welford.cuh")
MAX_ROW = 128  # one warp of 4-wide vectors
#: rows per warp of the op's launch: 2 (two 16-lane halves, ATen's offset-16 step inside the lane). Both launches
#: were proven on the H200 (campaign 11, commit 5274854, scripts/layer_norm_selftest.py): 0 differing elements on
#: every LayerNorm call of shapes 1-7 and 9-13 and the 112 random cases; on shape 6's rows 0.310 ms for two rows
#: per warp against 0.449 ms for one and ATen's 1.385 ms.
DEFAULT_ROWS_PER_WARP = 2
PATH_ENV = "KKDEPLOY_LAYER_NORM"
#: (compute capability, torch, CUDA) on which scripts/layer_norm_selftest.py measured the kernel bit-identical
#: to F.layer_norm: H200, torch 2.11.0+cu130 (commit 09f3635): 0 differing elements over the 18 LayerNorm calls of
#: each official shape with D <= 128 (official input and 0.25-padded; 2.95e9 elements on shape 6) and 112 random
#: cases (widths 4..128, scales 1e-3..1e3, weight/bias away from identity); docs/results.md, campaign 10.
PROVEN_PLATFORMS: set[tuple[tuple[int, int], str, str]] = {((9, 0), "2.11.0+cu130", "13.0")}


class LayerNormPath(KernelPath):
    """``kernel`` is ``"rows"`` (our rows kernel) or ``"aten"``; ``reason`` says why."""


def layer_norm_path(device: torch.device | str, platform: Optional[tuple] = None) -> LayerNormPath:
    """Whether CUDA calls on ``device`` run the rows kernel, and why (recorded in build manifests)."""
    device = torch.device(device)
    mode = os.environ.get(PATH_ENV, "auto")
    if mode not in ("auto", "aten", "kernel"):
        raise KKError(f"{PATH_ENV}={mode!r}: use auto, aten or kernel")
    if device.type != "cuda":
        return LayerNormPath("aten", f"{device.type} device: ATen's layer_norm runs (the kernel is CUDA-only)")
    if mode == "aten":
        return LayerNormPath("aten", f"{PATH_ENV}=aten")
    if mode == "kernel":
        return LayerNormPath("rows", f"rows kernel (forced by {PATH_ENV}=kernel: validate the result)")
    key = platform_key(device) if platform is None else tuple(platform)
    if key not in PROVEN_PLATFORMS:
        (major, minor), version, cuda = key
        return LayerNormPath("aten", f"compute capability {major}.{minor}, torch {version}, CUDA {cuda}: the rows "
                                     f"kernel was not measured bit-identical here; run scripts/layer_norm_selftest.py, "
                                     f"or set {PATH_ENV}=kernel and validate")
    problem = load_problem(_load, str(device))
    if problem:  # e.g. a serving image without nvcc: ATen's kernel gives the same bits, only slower
        return LayerNormPath("aten", f"the rows kernel cannot be built or loaded here ({problem}); ATen's "
                                     f"layer_norm runs (the same bits)")
    return LayerNormPath("rows", "rows kernel (proven bit-identical to ATen on this platform)")


def row_reason(width: int, dtype: torch.dtype) -> Optional[str]:
    """None when rows of ``width`` in ``dtype`` are the kernel's (float16, 4..128, a multiple of 4), else why not."""
    if dtype != torch.float16:
        return f"{dtype}: the kernel is float16 only"
    if not 4 <= width <= MAX_ROW or width % 4:
        return f"rows of {width}: the kernel takes rows of 4..{MAX_ROW} elements, a multiple of 4"
    return None


def rows_kernel_reason(x: torch.Tensor, normalized_shape: list[int], weight: Optional[torch.Tensor],
                       bias: Optional[torch.Tensor]) -> Optional[str]:
    """None when the rows kernel computes this call exactly as ATen's vectorized kernel would, else why not."""
    n = x.shape[-1] if x.dim() else 0
    if x.device.type != "cuda" or x.dtype != torch.float16:
        return f"{x.device.type} {x.dtype}: the kernel is float16 CUDA only"
    if list(normalized_shape) != [n]:
        return f"normalized_shape {list(normalized_shape)}: the kernel normalizes the last dim only"
    reason = row_reason(n, x.dtype)
    if reason:
        return reason
    if weight is None or bias is None:
        return "no weight or bias: the kernel always applies both"
    for name, t in (("x", x), ("weight", weight), ("bias", bias)):
        if t.dtype != torch.float16 or not t.is_contiguous() or t.data_ptr() % 8:
            return f"{name}: not a contiguous, 8-byte aligned float16 tensor (ATen would not take its vector path)"
    if weight.shape != (n,) or bias.shape != (n,):
        return f"weight/bias shapes {list(weight.shape)}/{list(bias.shape)} are not [{n}]"
    return None


def fma32(a: torch.Tensor, b: torch.Tensor, c) -> torch.Tensor:
    """float32 ``fma(a, b, c)`` rounded once, on any device: the product is exact in float64 (24 + 24 bits), the
    sum's float64 rounding error is recovered (TwoSum), and an inexact sum is rounded to odd before the float32
    rounding, which then equals the single rounding of the exact value (53 >= 24 + 2 bits)."""
    a, b = a.double(), b.double()
    c = c.double() if isinstance(c, torch.Tensor) else torch.tensor(float(c), dtype=torch.float64, device=a.device)
    p = a * b
    s = p + c
    bb = s - p
    err = (p - (s - bb)) + (c - bb)
    bits = s.view(torch.int64) if s.dim() else s.reshape(1).view(torch.int64)[0]
    even = (bits & 1) == 0
    towards = torch.nextafter(s, s + torch.where(err > 0, torch.full_like(s, float("inf")),
                                                 torch.full_like(s, float("-inf"))))
    s = torch.where((err != 0) & even & torch.isfinite(s), towards, s)
    return s.float()


def emulate_layer_norm_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float,
                            rsqrt: Optional[Callable] = None) -> torch.Tensor:
    """ATen's float16 vectorized LayerNorm on rows of 4..128 (a multiple of 4), as plain float32 tensor ops in the
    order of nvcc's code for ``csrc/layer_norm.cu`` (read in its PTX, nvcc 13.0, sm_90): what a fused kernel must
    reproduce, and a check of that reading against ``F.layer_norm`` on a GPU (``rsqrt``: ``torch.rsqrt``, which
    on CUDA is the same ``rsqrt.approx.f32``; elsewhere the caller's).

    Lane t of a 32-lane warp holds elements 4t..4t+3 (lanes past the row hold nothing); per lane a Welford push per
    element, ``mean = fma(delta, RN(1/count), mean)``, ``m2 = fma(delta, x - mean, m2)``; then ATen's
    shuffle-down tree (offsets 16..1: lane i merges lane i + offset), the two merges with the idle warps' empty
    states, ``var = m2 / N``, ``rstd = rsqrt(var + eps)`` and ``y = fma(g, rstd * (x - mean), b)``. A merge of
    ``own`` with ``other``: ``count = other.count + own.count``, ``coef = RN(1/count)``, ``mean =
    fma(coef * other.count, other.mean, own.mean * (own.count * coef))``, ``m2 = fma(delta * delta * other.count,
    own.count * coef, own.m2 + other.m2)`` with ``delta = own.mean - other.mean`` (zeros where count is 0)."""
    rsqrt = rsqrt or torch.rsqrt
    n = x.shape[-1]
    reason = row_reason(n, x.dtype)
    if reason:
        raise KKError(f"emulate_layer_norm_rows: {reason}")
    rows = x.reshape(-1, n).float()
    m = rows.shape[0]
    lanes = torch.zeros(m, 32, 4, dtype=torch.float32, device=x.device)
    lanes[:, : n // 4] = rows.view(m, n // 4, 4)
    has = torch.zeros(32, dtype=torch.bool, device=x.device)
    has[: n // 4] = True
    mean = torch.zeros(m, 32, device=x.device)
    m2 = torch.zeros(m, 32, device=x.device)
    count = torch.zeros(m, 32, device=x.device)
    for k in range(4):
        value = lanes[:, :, k]
        delta = value - mean
        new_count = count + 1
        new_mean = fma32(delta, torch.ones_like(new_count) / new_count, mean)
        new_m2 = fma32(delta, value - new_mean, m2)
        mean, m2, count = (torch.where(has, new, old) for new, old in ((new_mean, mean), (new_m2, m2),
                                                                     (new_count, count)))

    def merge(own, other):
        (om, o2, oc), (tm, t2, tc) = own, other
        total = tc + oc
        coef = torch.ones_like(total) / total
        n_own = oc * coef
        delta = om - tm
        merged_mean = fma32(coef * tc, tm, om * n_own)
        merged_m2 = fma32(delta * delta * tc, n_own, o2 + t2)
        live = total > 0
        return (torch.where(live, merged_mean, torch.zeros_like(total)),
                torch.where(live, merged_m2, torch.zeros_like(total)), total)

    state = (mean, m2, count)
    width = 32
    while width > 1:  # lane i (< width / 2) merges lane i + width / 2: lane 0 ends with ATen's warp state
        half = width // 2
        state = merge(tuple(t[:, :half] for t in state), tuple(t[:, half:width] for t in state))
        width = half
    state = tuple(t[:, 0] for t in state)
    empty = tuple(torch.zeros(m, device=x.device) for _ in range(3))
    state = merge(state, empty)
    state = merge(state, merge(empty, empty))
    mean, m2, _ = state
    var = m2 / float(n)
    rstd = rsqrt(var + torch.tensor(eps, dtype=torch.float32))
    g, b = weight.float(), bias.float()
    y = fma32(g.expand(m, n), rstd[:, None] * (rows - mean[:, None]), b.expand(m, n))
    return y.to(x.dtype).view(x.shape)


@functools.lru_cache(maxsize=None)
def _load(device: str):
    from .cuda_build import build_kernel_library

    lib = ctypes.CDLL(str(build_kernel_library("kkdeploy_layer_norm", [SOURCE, HEADER], device)))
    i64, vp = ctypes.c_int64, ctypes.c_void_p
    lib.kk_layer_norm_last_error.restype = ctypes.c_char_p
    lib.kk_layer_norm_rows_f16.argtypes = [vp, vp, vp, vp, i64, i64, ctypes.c_float, ctypes.c_int, vp]
    return lib


def layer_norm_rows_kernel(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float,
                           rows_per_warp: int = DEFAULT_ROWS_PER_WARP) -> torch.Tensor:
    """The rows kernel itself (no fallback): what the self-test compares with ``F.layer_norm``."""
    if rows_per_warp not in (1, 2):
        raise KKError(f"rows_per_warp is 1 or 2, got {rows_per_warp!r}")
    reason = rows_kernel_reason(x, [x.shape[-1]], weight, bias)
    if reason:
        raise KKError(f"layer_norm_rows_kernel: {reason}")
    out = torch.empty_like(x)
    lib = _load(str(x.device))
    rc = lib.kk_layer_norm_rows_f16(x.data_ptr(), weight.data_ptr(), bias.data_ptr(), out.data_ptr(),
                                    x.numel() // x.shape[-1], x.shape[-1], float(eps), int(rows_per_warp),
                                    torch.cuda.current_stream(x.device).cuda_stream)
    if rc != 0:
        raise KKError(lib.kk_layer_norm_last_error().decode())
    return out


def _custom_op(name: str):
    """custom_op with exact-stride inputs, like the opaque ATen wrappers (engines/inductor_ops.py)."""
    try:
        return torch.library.custom_op(name, mutates_args=(), tags=(torch.Tag.needs_exact_strides,))
    except (TypeError, AttributeError):  # older torch without tags= or the tag
        return torch.library.custom_op(name, mutates_args=())


@_custom_op(OP_NAME)
def layer_norm_rows(x: torch.Tensor, normalized_shape: list[int], weight: Optional[torch.Tensor],
                    bias: Optional[torch.Tensor], eps: float) -> torch.Tensor:
    """Default (CPU and any non-CUDA device): ATen's layer_norm itself."""
    return torch.ops.aten.layer_norm.default(x, normalized_shape, weight, bias, eps)


@layer_norm_rows.register_kernel("cuda")
def _layer_norm_rows_cuda(x, normalized_shape, weight, bias, eps):
    """CUDA: the rows kernel where the platform is proven and the call fits it, else ATen's kernel."""
    if layer_norm_path(x.device).fused and rows_kernel_reason(x, normalized_shape, weight, bias) is None:
        return layer_norm_rows_kernel(x, weight, bias, eps)
    return torch.ops.aten.layer_norm.default(x, normalized_shape, weight, bias, eps)


@layer_norm_rows.register_fake
def _layer_norm_rows_fake(x, normalized_shape, weight, bias, eps):
    return torch.empty_like(x, memory_format=torch.contiguous_format)
