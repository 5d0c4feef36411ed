"""ATen's float16 LayerNorm as one warp per row: the same bits, a launch that fits.

Why: the compiled faithful graph keeps every LayerNorm as ATen's own kernel (Inductor's fused LayerNorm rounds
differently, design.md §6). ATen's ``vectorized_layer_norm_kernel`` runs one 4-warp block per row, and a row of
128 float16 values occupies one warp of it: on shape 6 the 9 LayerNorms took 12.7 of the graph's 31.8 ms
(H200, torch 2.11, ``scripts/profile_candidate.py --shape 6 --candidate torch-compile-faithful-attention``).
``csrc/layer_norm.cu`` computes each row with ATen's arithmetic in ATen's order (``csrc/welford.cuh``, shared with
the ONNX Runtime custom op that was proven bit-identical) on one warp, 8 rows per block. Rows of at most 128
elements take the rows1 / rows2 launches (proven on the H200); wider rows take block4, where the warp plays ATen's
whole block (its four warps' states in each lane, ATen's tree over them in registers; ``emulate_layer_norm_rows``
spells out the order), proven by the build like every launch before it runs.

* ``rows_kernel_reason(x, normalized_shape, weight, bias)``: None when the kernel computes this call (CUDA,
  float16, a last dim that is a multiple of 4, weight and bias given, ATen's vector-path alignment), else why ATen
  runs.
* ``layer_norm_path(device, rows, width)``: whether a proof made in this environment found a launch bit-identical
  to ``F.layer_norm`` at this op shape (``prove_layer_norm``; the build proves its model's LayerNorms);
  ``$KKDEPLOY_LAYER_NORM=aten|kernel`` forces either (validate the result).
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
from kkdeploy.inputs import check_mask

from .cuda_build import load_problem
from .dependent_launch import enabled as dependent_launch_enabled
from .paths import KernelPath, path_from_proof
from .proof import (ProofCache, ProofCase, ProofRecord, kernel_environment, launch_table_digest, lookup_proof,
                    prove_launches, remember_proof)

OP_NAME = "kkdeploy_faithful::layer_norm_rows"
#: the model's final LayerNorm with the reference's ``zero_invalid_rows`` after it, as one op (one launch, where the
#: launch has a masked form: ``MASKED_LAUNCHES``)
MASKED_OP_NAME = "kkdeploy_faithful::layer_norm_rows_zero_invalid"
SOURCE = Path(__file__).resolve().parent / "csrc" / "layer_norm.cu"
HEADER = SOURCE.with_name("welford.cuh")
MAX_ROW = 128  # one warp of 4-wide vectors: the rows1 / rows2 launches
MAX_WIDTH = 1 << 24  # ATen's vector path (its float counts stay exact): the block4 launch
BLOCK_WARPS, BLOCK_THREADS = 4, 128  # ATen's block per row: (32, 4) threads
#: the kernel's launches (the C entry's ``rows_per_warp``). For rows of at most 128: "rows2", two 16-lane halves per
#: warp, ATen's offset-16 step inside the lane; "rows1", one row per warp. For wider rows: "block4", one row per warp
#: playing ATen's 4 warps. "rows2_full" (FULL_ROW_WIDTHS) and "block4_full" (FULL_BLOCK_WIDTHS) are rows2 and
#: block4 with every count of the Welford folds and trees known when the kernel is compiled: the same operations, the
#: reciprocals done by the compiler and the counts not shuffled (``kk_welford::merge_counted``). Each is proven on
#: its own (``prove_layer_norm``). "rows2_full_early" is rows2_full with the lane's gamma and beta loaded before the
#: tree instead of after it (csrc/layer_norm.cu, ``kEarly``: the same arithmetic, one round trip to L2 fewer after
#: the last shuffle); a study launch (STUDY_LAUNCHES) until a GPU build ships it through strict validation.
LAUNCHES = {"rows2": 2, "rows1": 1, "block4": 4, "rows2_full": 3, "block4_full": 5, "rows2_full_early": 6}
#: the row widths block4_full is compiled for: multiples of 128, so that every lane of one of ATen's warps holds as
#: many elements as the others; the widths of our shapes (each more width costs the kernel library's first compile
#: about 0.25 s here)
FULL_BLOCK_WIDTHS = (256, 384, 512, 768, 1024)
#: the row widths rows2_full is compiled for: 4-wide vectors a power of two, so that every count ATen's lane 0 depends
#: on is the same in every lane it comes from
FULL_ROW_WIDTHS = (16, 32, 64, 128)
#: launches proven only where asked for by name (``prove_layer_norm(..., launches=...)``, ``scripts/kernel_selftest.py
#: --launches layer_norm=rows2_full_early``), not in builds, and the widths they take
STUDY_LAUNCHES = {"rows2_full_early": FULL_ROW_WIDTHS}
#: the launches with a masked form (csrc/layer_norm.cu, ``kMasked``): the rows of invalid tokens written as +0 by the
#: launch itself, as the reference's ``zero_invalid_rows`` (``masked_fill``) writes them after the final LayerNorm.
#: The same arithmetic; only the store of an invalid row changes. Other launches apply the mask after the kernel.
MASKED_LAUNCHES = ("rows2", "rows2_full", "rows2_full_early")
#: whether builds run the final LayerNorm as ``MASKED_OP_NAME`` (engines/inductor.py) and prove the masked launches
#: on the final norm's cases (model_proofs). Off until a GPU build ships it through strict validation: written in
#: session 46 without a GPU (its PTX checked offline; ``scripts/ab_edits/masked_final_joins_builds.sh`` turns it
#: on for a device run's A/B).
MASKED_FINAL = False
#: what a proof's "proven" means: these launches' rows per warp and the widths the full forms take (part of the
#: proofs' key: a record made when a launch took other widths would name a launch that no longer takes its rows)
LAUNCHES_DIGEST = launch_table_digest(LAUNCHES, FULL_ROW_WIDTHS, FULL_BLOCK_WIDTHS)
DEFAULT_LAUNCH = "rows2"

DEFAULT_ROWS_PER_WARP = LAUNCHES[DEFAULT_LAUNCH]


def launches_for(width: int) -> list[str]:
    """The launches that take rows of ``width``: rows2 and rows1 up to 128 elements (rows2_full first at
    FULL_ROW_WIDTHS), block4 beyond (block4_full first at FULL_BLOCK_WIDTHS)."""
    if width <= MAX_ROW:
        return (["rows2_full"] if width in FULL_ROW_WIDTHS else []) + ["rows2", "rows1"]
    return (["block4_full"] if width in FULL_BLOCK_WIDTHS else []) + ["block4"]


def takes(launch: str, width: int) -> bool:
    """Whether ``launch`` takes rows of ``width``: a build's launch (``launches_for``) or a study launch."""
    return launch in launches_for(width) or width in STUDY_LAUNCHES.get(launch, ())


def proof_launches(width: int, asked: Optional[list[str]] = None) -> list[str]:
    """The launches a proof tries on rows of ``width``: those ``asked`` for that take them (study launches too), else
    every one a build proves that does."""
    chosen = [name for name in asked or () if takes(name, width)]
    return chosen or launches_for(width)


PATH_ENV = "KKDEPLOY_LAYER_NORM"
OP = "layer_norm_rows"


class LayerNormPath(KernelPath):
    """``kernel`` is ``"rows"`` (our rows kernel) or ``"aten"``; ``reason`` says why."""


def proof_shape(rows: int, width: int) -> dict:
    """The op shape a proof holds for: ``rows`` rows of ``width`` float16 values."""
    return {"rows": int(rows), "width": int(width), "dtype": "float16"}


def proof_environment(device: torch.device | str) -> dict:
    """The environment key of the kernel's proofs (device, torch, CUDA, the kernel's sources, nvcc and its flags)."""
    return kernel_environment(device, OP, (SOURCE, HEADER), compiler="nvcc", launches=LAUNCHES_DIGEST)


def kernel_refusal(device: torch.device | str) -> Optional[str]:
    """None when the rows kernel can run on ``device`` (CUDA, built and loaded), else why not."""
    device = torch.device(device)
    if device.type != "cuda":
        return f"{device.type} device: ATen's layer_norm runs (the kernel is CUDA-only)"
    problem = load_problem(_load, str(device))
    if problem:  # e.g. a serving image without nvcc: ATen's kernel gives the same bits, only slower
        return f"the rows kernel cannot be built or loaded here ({problem}); ATen's layer_norm runs (the same bits)"
    return None


def _mode() -> str:
    mode = os.environ.get(PATH_ENV, "auto")
    if mode not in ("auto", "aten", "kernel"):
        raise KKError(f"{PATH_ENV}={mode!r}: use auto, aten or kernel")
    return mode


def layer_norm_path(device: torch.device | str, rows: int, width: int) -> LayerNormPath:
    """Whether CUDA calls on ``device`` over ``rows`` rows of ``width`` run the rows kernel, with which launch, and
    why (recorded in build manifests)."""
    device = torch.device(device)
    mode = _mode()
    if device.type != "cuda":
        return LayerNormPath("aten", f"{device.type} device: ATen's layer_norm runs (the kernel is CUDA-only)")
    if mode == "aten":
        return LayerNormPath("aten", f"{PATH_ENV}=aten")
    refusal = kernel_refusal(device)
    if refusal:
        return LayerNormPath("aten", refusal)
    if mode == "kernel":
        return LayerNormPath("rows", f"rows kernel (forced by {PATH_ENV}=kernel: validate the result)",
                             DEFAULT_LAUNCH if width <= MAX_ROW else "block4")
    return path_from_proof(LayerNormPath, "rows", lookup_proof(proof_environment(device), OP, proof_shape(rows, width)),
                           f"{rows} rows of {width}", "its model's LayerNorms")


def proven_ms(rows: int, width: int, dtype: torch.dtype, device) -> Optional[tuple]:
    """(our chosen launch's ms or None, ATen's ms) from the proof made here at this shape; None without a timed
    proof. (No kernel build is attempted: only the records are read.)"""
    if torch.device(device).type != "cuda" or dtype != torch.float16:
        return None
    record = lookup_proof(proof_environment(device), OP, proof_shape(rows, width))
    return None if record is None else record.timings


def row_reason(width: int, dtype: torch.dtype) -> Optional[str]:
    """None when rows of ``width`` in ``dtype`` are the kernel's (float16, a multiple of 4 up to 2^24: ATen's
    vector path), else why not."""
    if dtype != torch.float16:
        return f"{dtype}: the kernel is float16 only"
    if not 4 <= width <= MAX_WIDTH or width % 4:
        return f"rows of {width}: the kernel takes rows of a multiple of 4 elements up to 2^24 (ATen's vector path)"
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
    """ATen's float16 vectorized LayerNorm on rows of any width its vector path takes (a multiple of 4), as plain
    float32 tensor ops in the order of nvcc's code for ``csrc/layer_norm.cu`` (read in its PTX, nvcc 13.0, sm_90):
    what a fused kernel must reproduce, and a check of that reading against ``F.layer_norm`` on a GPU (``rsqrt``:
    ``torch.rsqrt``, which on CUDA is the same ``rsqrt.approx.f32``; elsewhere the caller's).

    ATen's block has 128 threads, 4 warps of 32 lanes; thread t folds the 4-wide vectors t, t + 128, ... (threads
    past the row hold nothing), a Welford push per element: ``mean = fma(delta, RN(1/count), mean)``, ``m2 =
    fma(delta, x - mean, m2)``. Then ATen's shuffle-down tree in each warp (offsets 16..1: lane i merges lane
    i + offset), the tree over the warps (warps 0 and 1 merge warps 2 and 3, then warp 0 merges warp 1; for rows
    of at most 128 elements warps 1..3 are empty, and those merges still happen), ``var = m2 / N``, ``rstd =
    rsqrt(var + eps)`` and ``y = fma(g, rstd * (x - mean), b)``. A merge of ``own`` with ``other``: ``count =
    other.count + own.count``, ``coef = RN(1/count)``, ``mean = fma(coef * other.count, other.mean, own.mean *
    (own.count * coef))``, ``m2 = fma(delta * delta * other.count, own.count * coef, own.m2 + other.m2)`` with
    ``delta = own.mean - other.mean`` (zeros where count is 0)."""
    rsqrt = rsqrt or torch.rsqrt
    n = x.shape[-1]
    reason = row_reason(n, x.dtype)
    if reason:
        raise KKError(f"emulate_layer_norm_rows: {reason}")
    rows = x.reshape(-1, n).float()
    m, vectors = rows.shape[0], n // 4
    turns = -(-vectors // BLOCK_THREADS)  # vectors each of ATen's threads folds, at most
    flat = torch.zeros(m, turns * BLOCK_THREADS, 4, dtype=torch.float32, device=x.device)
    flat[:, :vectors] = rows.view(m, vectors, 4)
    threads = flat.view(m, turns, BLOCK_THREADS, 4)  # [row, turn j, thread t]: vector j * 128 + t
    has = torch.zeros(turns * BLOCK_THREADS, dtype=torch.bool, device=x.device)
    has[:vectors] = True
    has = has.view(turns, BLOCK_THREADS)
    mean = torch.zeros(m, BLOCK_THREADS, device=x.device)
    m2 = torch.zeros(m, BLOCK_THREADS, device=x.device)
    count = torch.zeros(m, BLOCK_THREADS, device=x.device)
    for turn in range(turns):
        for k in range(4):
            value = threads[:, turn, :, k]
            delta = value - mean
            new_count = count + 1
            new_mean = fma32(delta, torch.ones_like(new_count) / new_count, mean)
            new_m2 = fma32(delta, value - new_mean, m2)
            mean, m2, count = (torch.where(has[turn], new, old) for new, old in ((new_mean, mean), (new_m2, m2),
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

    state = tuple(t.view(m, BLOCK_WARPS, 32) for t in (mean, m2, count))
    width = 32
    while width > 1:  # lane i (< width / 2) merges lane i + width / 2: lane 0 ends with ATen's warp state
        half = width // 2
        state = merge(tuple(t[..., :half] for t in state), tuple(t[..., half:width] for t in state))
        width = half
    warps = [tuple(t[:, w, 0] for t in state) for w in range(BLOCK_WARPS)]
    low = merge(warps[0], warps[2])  # ATen's block step, offset 2: warps 0 and 1 merge warps 2 and 3
    high = merge(warps[1], warps[3])
    mean, m2, _ = merge(low, high)  # offset 1: warp 0 merges warp 1
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
    lib.kk_layer_norm_rows_f16.argtypes = [vp, vp, vp, vp, i64, i64, ctypes.c_float, ctypes.c_int, ctypes.c_int, vp]
    lib.kk_layer_norm_rows_masked_f16.argtypes = [vp, vp, vp, vp, vp, i64, i64, ctypes.c_float, ctypes.c_int,
                                                  ctypes.c_int, vp]
    return lib


def layer_norm_rows_kernel(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float,
                           rows_per_warp: int = DEFAULT_ROWS_PER_WARP,
                           valid: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The rows kernel itself (no fallback): what the self-test compares with ``F.layer_norm``. With ``valid``
    (bool, x's leading dims) the rows of invalid tokens come out +0, as ``zero_invalid_rows`` writes them: in the
    launch itself where it has a masked form (``MASKED_LAUNCHES``), else by ``masked_fill_`` after it."""
    launch = next((name for name, code in LAUNCHES.items() if code == rows_per_warp), None)
    if launch is None:
        raise KKError(f"rows_per_warp is one of {sorted(LAUNCHES.values())} (the launches {', '.join(LAUNCHES)}), got "
                      f"{rows_per_warp!r}")
    reason = rows_kernel_reason(x, [x.shape[-1]], weight, bias)
    if reason:
        raise KKError(f"layer_norm_rows_kernel: {reason}")
    if not takes(launch, x.shape[-1]):
        raise KKError(f"layer_norm_rows_kernel: the {launch} launch does not take rows of {x.shape[-1]}; those take "
                      f"{', '.join(launches_for(x.shape[-1]))}")
    check_mask(valid, tuple(x.shape[:-1]), x.device, "x")
    out = torch.empty_like(x)
    lib = _load(str(x.device))
    rows, width = x.numel() // x.shape[-1], x.shape[-1]
    pdl, stream = int(dependent_launch_enabled()), torch.cuda.current_stream(x.device).cuda_stream
    if valid is not None and launch in MASKED_LAUNCHES:
        valid = valid.contiguous()
        rc = lib.kk_layer_norm_rows_masked_f16(x.data_ptr(), weight.data_ptr(), bias.data_ptr(), valid.data_ptr(),
                                               out.data_ptr(), rows, width, float(eps), int(rows_per_warp), pdl,
                                               stream)
        valid = None  # applied by the launch
    else:
        rc = lib.kk_layer_norm_rows_f16(x.data_ptr(), weight.data_ptr(), bias.data_ptr(), out.data_ptr(), rows, width,
                                        float(eps), int(rows_per_warp), pdl, stream)
    if rc != 0:
        raise KKError(lib.kk_layer_norm_last_error().decode())
    from kkdeploy.models.reference import zero_invalid_rows

    return zero_invalid_rows(out, valid)  # the launches without a masked form: the reference's own step after it


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
    """CUDA: the rows kernel where the call fits it and a proof here covers its shape, else ATen's kernel."""
    if rows_kernel_reason(x, normalized_shape, weight, bias) is None:
        width = x.shape[-1]
        path = layer_norm_path(x.device, x.numel() // width, width)
        if path.fused:
            return layer_norm_rows_kernel(x, weight, bias, eps, LAUNCHES[path.launch])
    return torch.ops.aten.layer_norm.default(x, normalized_shape, weight, bias, eps)


@layer_norm_rows.register_fake
def _layer_norm_rows_fake(x, normalized_shape, weight, bias, eps):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def zero_invalid_rows_reference(x, normalized_shape, weight, bias, eps, valid_token_mask) -> torch.Tensor:
    """The reference's final LayerNorm and ``zero_invalid_rows`` (models/reference.py), ATen's ops as it runs them."""
    from kkdeploy.models.reference import zero_invalid_rows

    return zero_invalid_rows(torch.ops.aten.layer_norm.default(x, normalized_shape, weight, bias, eps),
                             valid_token_mask)


@_custom_op(MASKED_OP_NAME)
def layer_norm_rows_zero_invalid(x: torch.Tensor, normalized_shape: list[int], weight: Optional[torch.Tensor],
                                 bias: Optional[torch.Tensor], eps: float,
                                 valid_token_mask: torch.Tensor) -> torch.Tensor:
    """Default (CPU and any non-CUDA device): ATen's layer_norm, then the invalid tokens' rows set to 0."""
    check_mask(valid_token_mask, tuple(x.shape[:-1]), x.device, "x")  # never a broadcast of a misshapen mask
    return zero_invalid_rows_reference(x, normalized_shape, weight, bias, eps, valid_token_mask)


@layer_norm_rows_zero_invalid.register_kernel("cuda")
def _layer_norm_rows_zero_invalid_cuda(x, normalized_shape, weight, bias, eps, valid_token_mask):
    """CUDA: the rows kernel's masked launch where the call fits it and a proof here covers its shape (the proof's
    final-norm cases run it masked), else ATen's two ops."""
    check_mask(valid_token_mask, tuple(x.shape[:-1]), x.device, "x")  # never a broadcast of a misshapen mask
    if rows_kernel_reason(x, normalized_shape, weight, bias) is None:
        width = x.shape[-1]
        path = layer_norm_path(x.device, x.numel() // width, width)
        if path.fused:
            return layer_norm_rows_kernel(x, weight, bias, eps, LAUNCHES[path.launch], valid=valid_token_mask)
    return zero_invalid_rows_reference(x, normalized_shape, weight, bias, eps, valid_token_mask)


@layer_norm_rows_zero_invalid.register_fake
def _layer_norm_rows_zero_invalid_fake(x, normalized_shape, weight, bias, eps, valid_token_mask):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


# -- the proof ------------------------------------------------------------------------------------------------
def layer_norm_case(label: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float,
                    valid: Optional[torch.Tensor] = None) -> ProofCase:
    """One LayerNorm call: ``F.layer_norm`` (what nn.LayerNorm runs) against a launch of the rows kernel. With
    ``valid`` (the model's final LayerNorm), the reference's ``zero_invalid_rows`` follows it, and the launch runs
    masked: so the proof of the op shape covers the masked launches the final LayerNorm takes."""
    if valid is None:
        return ProofCase(label, lambda: torch.nn.functional.layer_norm(x, (x.shape[-1],), weight, bias, eps),
                         lambda launch: layer_norm_rows_kernel(x, weight, bias, eps, LAUNCHES[launch]))
    return ProofCase(label, lambda: zero_invalid_rows_reference(x, [x.shape[-1]], weight, bias, eps, valid),
                     lambda launch: layer_norm_rows_kernel(x, weight, bias, eps, LAUNCHES[launch], valid=valid))


def prove_layer_norm(device: torch.device | str, cases: list[ProofCase], rows: int, width: int, *,
                     launches: Optional[list[str]] = None, budget_s: float = 20.0, repeats: int = 5,
                     cache: Optional[ProofCache] = None) -> ProofRecord:
    """Prove the kernel's launches on ``cases`` (``layer_norm_case``) for ``rows`` rows of ``width``; remember the
    record for this process and in the on-disk cache. Where the kernel cannot run, the record says why."""
    shape = proof_shape(rows, width)
    environment = proof_environment(device)
    refusal = kernel_refusal(device) or row_reason(width, torch.float16)
    if refusal:
        return ProofRecord(op=OP, shape=shape, environment=environment, reason=refusal)  # not cached: cheap
    record = prove_launches(OP, shape, proof_launches(width, launches), cases, device, environment=environment,
                            budget_s=budget_s, repeats=repeats, against_reference=True)
    remember_proof(record, cache)
    return record
