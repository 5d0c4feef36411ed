"""The reference's Linear layers with their next elementwise ops in one launch, bit for bit.

Why: on shape 6 the faithful graph moves every activation through memory once per op: a cuBLAS GEMM writes
``ffn_in``'s output, ATen's GELU reads and writes it again, Inductor's pointwise kernels re-read each residual
and mask, and ``h`` is read three times for Q, K and V. A GEMM whose epilogue does those ops saves the passes;
it is admissible only if it is bit-identical (design.md §6), and a Triton ``tl.dot`` GEMM with the bias added to
its float32 accumulator and rounded once was measured equal to ``F.linear`` (issue 19). The epilogues are exact
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
* ``linear_path(m, n, k, dtype, device, epilogue=form(...))`` decides: the Triton kernel on a proven platform for
  the reference GEMM shapes (M, N, K) that ``scripts/fused_linear_selftest.py`` measured bit-identical
  (``PROVEN_GEMMS``: cuBLAS picks the reference's algorithm per problem size) when every part of the launch is in
  ``PROVEN_EPILOGUES``, else ATen. ``$KKDEPLOY_FUSED_LINEAR=aten|triton`` forces either (validate the result).
* ``$KKDEPLOY_FUSED_LINEAR_PARTS`` adds parts that ``scripts/fused_linear_selftest.py`` has just measured
  bit-identical on this machine (``scripts/proven_parts.py`` prints the line), with their compile flags:
  ``layer_norm,gelu_prologue:fp_fusion``. Why: a GPU session can prove a part and benchmark with it in one run,
  before the part is committed to ``PROVEN_EPILOGUES`` (validate the result, as the bench and build do).

``kkdeploy.kernels.fused_blocks`` composes these ops into the reference's blocks: what the
``torch-compile-faithful-gemms`` candidate exports.
"""

from __future__ import annotations

import functools
import os
from typing import Optional

import torch
import torch.nn.functional as F

from kkdeploy.errors import KKError

from .cuda_build import platform_key
from .paths import KernelPath, float16_cuda_refusal, path_mode, triton_available

OP_NAME = "kkdeploy_faithful::linear"
EPILOGUES = ("none", "gelu", "add_masked", "masked_sum")
PATH_ENV = "KKDEPLOY_FUSED_LINEAR"
#: (compute capability, torch, CUDA) on which scripts/fused_linear_selftest.py measured the kernel bit-identical:
#: H200, torch 2.11.0+cu130 (campaign 11, commit dcf24a4; docs/fused-linear.md).
PROVEN_PLATFORMS: set[tuple[tuple[int, int], str, str]] = {((9, 0), "2.11.0+cu130", "13.0")}
#: the reference GEMMs (M = B*S, N, K) of the official shapes 1-13, each measured bit-identical there with the
#: epilogues in PROVEN_EPILOGUES and packed Q/K/V: every Linear of the seeded model on the official input, all-valid
#: and padded, and random inputs at scales 0.1, 1 and 10 (0 differing elements in all).
PROVEN_GEMMS: frozenset[tuple[int, int, int]] = frozenset({
    (8192, 128, 128), (128, 128, 128), (512, 128, 128), (2048, 128, 128), (16384, 128, 128), (1280000, 128, 128),
    (8192, 32, 32), (8192, 1024, 1024), (65536, 128, 128)})
#: proven, but slower than cuBLAS on the H200 (CUDA events, median of 20): ATen keeps them. (8192, 1024, 1024):
#: 0.1007 ms against cuBLAS's 0.0482 ms per Linear (shape 8).
SLOWER_GEMMS: frozenset[tuple[int, int, int]] = frozenset({(8192, 1024, 1024)})
#: the parts of a launch proven with PROVEN_GEMMS (a launch runs our kernel only if every part is here: ``form``).
#: Out, measured in campaign 12 (commit f779cd9, docs/fused-linear.md): "layer_norm" (the next LayerNorm of the rows
#: in the same tile) is bit-identical everywhere but slower on shape 6 (1.002 ms against 0.624 for masked_sum and the
#: rows LayerNorm kernel); "gelu" and "gelu_prologue" differ from ATen's GELU in 151 of 63,486 float16 values with
#: Triton's bundled libdevice (0 with CUDA 13.0's, TRITON_LIBDEVICE_PATH) and are not faster on shape 6 either.
PROVEN_EPILOGUES: frozenset[str] = frozenset({"none", "add_masked", "masked_sum"})
LN_EPILOGUES = ("add_masked", "masked_sum")
#: the row widths the LayerNorm epilogue takes (ATen's one-warp rows, whole in one tile)
LN_WIDTHS = (16, 32, 64, 128)
#: what the GEMM may do to its input first: "gelu" (ffn_out reading ffn_in's output and computing GELU on the way
#: in, so the GELU's output never reaches memory); proven as the part "gelu_prologue" of PROVEN_EPILOGUES
PROLOGUES = ("none", "gelu")
LN_OP_NAME = "kkdeploy_faithful::linear_layer_norm"
#: every part a launch can have (``form``), and the compile flags a part may be proven with
PARTS = ("none", "gelu", "add_masked", "masked_sum", "gelu_prologue", "layer_norm")
PART_FLAGS = {"fp_fusion": {"enable_fp_fusion": True}}
PARTS_ENV = "KKDEPLOY_FUSED_LINEAR_PARTS"


def extra_parts() -> dict[str, dict]:
    """``$KKDEPLOY_FUSED_LINEAR_PARTS`` as {part: compile flags}: "layer_norm,gelu_prologue:fp_fusion" gives
    {"layer_norm": {}, "gelu_prologue": {"enable_fp_fusion": True}}. A one-line KKError names a bad entry.
    Asked on every CUDA call, so the parse is cached per value of the variable (do not mutate the result)."""
    return _parse_parts(os.environ.get(PARTS_ENV, "").strip())


@functools.lru_cache(maxsize=8)
def _parse_parts(text: str) -> dict[str, dict]:
    parts: dict[str, dict] = {}
    for entry in filter(None, (e.strip() for e in text.split(","))):
        name, _, flag = entry.partition(":")
        if name not in PARTS:
            raise KKError(f"{PARTS_ENV}: unknown part {name!r}; the parts are {', '.join(PARTS)}")
        if flag and flag not in PART_FLAGS:
            raise KKError(f"{PARTS_ENV}: unknown flag {flag!r} on {name}; the flags are {', '.join(PART_FLAGS)}")
        parts[name] = dict(PART_FLAGS[flag]) if flag else {}
    return parts


#: per-part departures from the kernel's IEEE compile flags (``_fused_linear_triton.COMPILE_FLAGS``), each proven
#: first. Empty: the GELU epilogue with contraction on (as nvcc builds ATen's GELU) is checked over every float16
#: value by scripts/fused_linear_selftest.py and goes here ({"gelu": {"enable_fp_fusion": True}}) only if that
#: check shows 0 differing.
EPILOGUE_FLAGS: dict[str, dict] = {}


def part_flags(*parts: str) -> dict:
    """The compile-flag departures of a launch's parts, merged in order: EPILOGUE_FLAGS, then the flags
    ``$KKDEPLOY_FUSED_LINEAR_PARTS`` gives a part (the flags it was just proven with here)."""
    extra = extra_parts()
    merged: dict = {}
    for part in parts:
        merged.update(EPILOGUE_FLAGS.get(part, {}))
        merged.update(extra.get(part, {}))
    return merged


def proven_parts() -> frozenset[str]:
    """PROVEN_EPILOGUES and the parts ``$KKDEPLOY_FUSED_LINEAR_PARTS`` adds in this process."""
    extra = extra_parts()
    return PROVEN_EPILOGUES | frozenset(extra) if extra else PROVEN_EPILOGUES


class LinearPath(KernelPath):
    """``kernel`` is ``"triton"`` (our GEMM with its epilogue) or ``"aten"``; ``reason`` says why."""


def linear_path(m: int, n: int, k: int, dtype: torch.dtype, device, platform: Optional[tuple] = None,
                epilogue: str = "none") -> LinearPath:
    """Which kernel computes a reference GEMM of this size (``n`` per weight) with ``epilogue``, and why. No device
    sync."""
    mode = path_mode(PATH_ENV)
    refused = float16_cuda_refusal(LinearPath, device, mode, PATH_ENV, dtype,
                                   "ATen's ops run (the kernel is CUDA-only)", "the kernel reproduces float16 GEMMs only")
    if refused:
        return refused
    device = torch.device(device)
    if not triton_available():
        return LinearPath("aten", "triton is not importable")
    if mode == "triton":
        return LinearPath("triton", f"Triton GEMM (forced by {PATH_ENV}=triton: validate the result)")
    proven = proven_parts()
    unproven = [part for part in epilogue.split("+") if part not in proven]
    if unproven:
        return LinearPath("aten", f"the {' and '.join(unproven)} epilogue was not measured bit-identical")
    platform = platform_key(device) if platform is None else tuple(platform)
    if platform not in PROVEN_PLATFORMS:
        return LinearPath("aten", f"platform {platform} not proven: run scripts/fused_linear_selftest.py here, "
                                  f"or set {PATH_ENV}=triton and validate")
    if (m, n, k) not in PROVEN_GEMMS:
        return LinearPath("aten", f"GEMM (M, N, K) = {(m, n, k)} was not measured bit-identical (cuBLAS picks the "
                                  f"reference's algorithm per size)")
    if (m, n, k) in SLOWER_GEMMS:
        return LinearPath("aten", f"GEMM (M, N, K) = {(m, n, k)} is bit-identical but slower than cuBLAS here")
    added = [part for part in epilogue.split("+") if part not in PROVEN_EPILOGUES]
    return LinearPath("triton", f"Triton GEMM with fused epilogue ((M, N, K) = {(m, n, k)} proven bit-identical"
                                + (f"; {', '.join(added)} from {PARTS_ENV}" if added else "") + ")")


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
    """A launch's parts as ``linear_path`` checks them against PROVEN_EPILOGUES: "gelu_prologue+masked_sum+..."."""
    parts = (["gelu_prologue"] if prologue == "gelu" else []) + [epilogue] + (["layer_norm"] if layer_norm else [])
    return "+".join(parts)


@_linear_op.register_kernel("cuda")
def _linear_cuda(x, weights, biases, residual, mask, epilogue, prologue="none"):
    """CUDA: the Triton GEMM where ``linear_path`` allows it, else the composition."""
    m, n, k = check_linear_inputs(x, weights, biases, residual, mask, epilogue, prologue)
    if linear_path(m, n, k, x.dtype, x.device, epilogue=form(epilogue, prologue)).fused:
        from ._fused_linear_triton import triton_linear

        weight, bias = (weights[0], biases[0]) if len(weights) == 1 else packed(weights, biases)
        return triton_linear(x, weight, bias, residual, mask, epilogue, prologue)
    return reference_linear(x, weights, biases, residual, mask, epilogue, prologue)


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
    if n in LN_WIDTHS and linear_path(m, n, k, x.dtype, x.device, epilogue=form(epilogue, prologue, True)).fused:
        from ._fused_linear_triton import triton_linear_layer_norm

        return triton_linear_layer_norm(x, weight, bias, residual, mask, ln_weight, ln_bias, eps, epilogue, prologue,
                                        zero_invalid)
    return reference_linear_layer_norm(x, weight, bias, residual, mask, ln_weight, ln_bias, eps, epilogue, prologue,
                                       zero_invalid)


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
