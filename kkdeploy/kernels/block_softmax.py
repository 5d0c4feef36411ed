"""ATen's block softmax for rows longer than 1024, described, emulated, and fused for causal attention tiles.

Why: shape 14's rows are 100,000 keys, so its reference softmax is ATen's block softmax, not the warp softmax
that ``faithful_attention`` reproduces. Its element order (read in ``aten/src/ATen/native/cuda/SoftMax.cu``;
``csrc/block_softmax.cu`` states it in full) decides which skips of masked keys are exact: a row cut at a
multiple of 4096 keys leaves every thread the same elements minus trailing -inf ones, so it is bitwise;
a cut elsewhere moves elements between threads.

* ``block_softmax_layout(L)``: which ATen kernel a float32 row of length L takes (``"smem"`` or
  ``"regular"``) and its scalar tail.
* ``emulate_block_softmax(x)``: the softmax in exactly that order with torch ops (one IEEE op per element per
  step), on any device: on the GPU it must equal ``torch.softmax(x, -1)`` bit for bit
  (scripts/block_softmax_selftest.py checks it); on the CPU it documents and tests the order.
* ``causal_block_softmax(raw, ...)``: the reference's scale, fp16 roundings, causal mask, casts and softmax of a
  tile of raw fp16 Q.K^T scores, as one CUDA kernel (``csrc/block_softmax.cu``, built by nvcc on demand) that
  reads only the keys each row can see; on the CPU, the reference composition itself. It goes through the
  custom op ``kkdeploy_faithful::causal_block_softmax`` (fake kernel included), so FX and torch.compile see
  one opaque node.

Proven on the H200 (torch 2.11.0+cu130, commit 09f3635, scripts/block_softmax_selftest.py): the emulation equals
``torch.softmax`` bit for bit for every regular-kernel length tried (12,256..100,000, with and without a scalar
tail) and the kernel equals the reference composition on every tile tried (row lengths 20,000 and 100,000, cut
and uncut widths; 0 differing of 2.9e9), 0.67 ms against 6.07 ms for a 256-query tile. The shared-memory kernel
(rows under 12,256 floats) orders its sums differently (30,590-96,402 differing against the emulation), so the
kernel refuses those rows. ``fast_path_reason(device, dtype)`` gates the long-context default on that platform.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path
from typing import Callable, Optional

import torch

from kkdeploy.errors import KKError

from .cuda_build import load_problem, platform_key

THREADS = 1024  # ATen's block for rows of 1024 elements or more
VEC = 4  # ILP = sizeof(float4) / sizeof(float)
WARP = 32
CHUNK = THREADS * VEC  # one pass of the whole block over vectors: 4096 elements
#: cudaDeviceProp.sharedMemPerBlock on the GPUs we target (48 KiB, the non-opt-in limit ATen reads)
DEFAULT_SMEM_PER_BLOCK = 49152
SOURCE = Path(__file__).resolve().parent / "csrc" / "block_softmax.cu"


#: (compute capability, torch, CUDA) where scripts/block_softmax_selftest.py found the kernel bit-identical
PROVEN_PLATFORMS: set[tuple[tuple[int, int], str, str]] = {((9, 0), "2.11.0+cu130", "13.0")}


def fast_path_reason(device: torch.device | str, dtype: torch.dtype) -> Optional[str]:
    """None when the long-context path may use this kernel by default on ``device`` for ``dtype``, else why not."""
    device = torch.device(device)
    if device.type != "cuda":
        return f"{device.type} device: the block-softmax kernel is CUDA-only"
    if dtype != torch.float16:
        return f"{dtype}: the block-softmax kernel reproduces the float16 reference only"
    key = platform_key(device)
    if key not in PROVEN_PLATFORMS:
        return (f"compute capability {key[0][0]}.{key[0][1]}, torch {key[1]}, CUDA {key[2]}: the block-softmax kernel "
                f"was not measured bit-identical here (scripts/block_softmax_selftest.py)")
    problem = load_problem(_load, str(device))
    if problem:  # e.g. no nvcc where this runs: full key rows with ATen's ops give the reference's bits too
        return f"the block-softmax kernel cannot be built or loaded here ({problem})"
    return None


def block_softmax_layout(row_len: int, smem_per_block: int = DEFAULT_SMEM_PER_BLOCK) -> tuple[str, int]:
    """``(kind, tail)`` of ATen's float32 softmax over contiguous, 16-byte aligned rows of ``row_len``:
    ``"smem"`` (cunn_SoftMaxForwardSmem, no scalar tail) or ``"regular"`` (cunn_SoftMaxForward, whose last
    ``row_len mod 4096`` elements are folded one at a time). Rows of at most 1024 take the warp softmax."""
    if row_len <= 1024:
        raise KKError(f"rows of {row_len} <= 1024 elements take ATen's warp softmax "
                      f"(kkdeploy.kernels.faithful_attention), not the block softmax")
    warps = THREADS // WARP
    max_elements = (smem_per_block - warps * 4) // 4
    aligned = row_len % VEC == 0  # every row of a contiguous float32 tensor then starts 16-byte aligned
    if row_len < max_elements and aligned:
        return "smem", 0
    if not aligned:
        raise KKError(f"rows of {row_len} (not a multiple of 4) start at varying alignments, which this "
                      f"description does not cover")
    return "regular", row_len % CHUNK


def kernel_covers(row_len: int, smem_per_block: int = DEFAULT_SMEM_PER_BLOCK) -> bool:
    """Whether ``causal_block_softmax`` reproduces ATen for rows of ``row_len``: the regular kernel only.
    Rows that take the shared-memory kernel are left to ATen: its order differs from the regular kernel's
    (H200, torch 2.11: a causal row cut at 4096 keys moved 18 of 1M probabilities against the same row at
    100,000 keys; scripts/shape14_tile_study.py)."""
    try:
        return block_softmax_layout(row_len, smem_per_block)[0] == "regular"
    except KKError:
        return False


def thread_order(row_len: int, smem_per_block: int = DEFAULT_SMEM_PER_BLOCK) -> torch.Tensor:
    """[THREADS, steps] element indices: row t lists thread t's elements in the order it folds them
    (-1 pads threads with fewer elements)."""
    kind, tail = block_softmax_layout(row_len, smem_per_block)
    main_end = row_len - tail
    vectors = torch.arange(0, main_end // VEC)
    per_thread = -(-vectors.numel() // THREADS)
    grid = torch.full((per_thread * THREADS,), -1, dtype=torch.long)
    grid[: vectors.numel()] = vectors
    vec_of = grid.view(per_thread, THREADS).t()  # thread t: vectors t, t + 1024, ...
    elements = torch.where(vec_of[:, :, None] >= 0, vec_of[:, :, None] * VEC + torch.arange(VEC), -1)
    order = elements.reshape(THREADS, -1)
    if tail:
        tail_steps = -(-tail // THREADS)
        tail_idx = torch.full((tail_steps * THREADS,), -1, dtype=torch.long)
        tail_idx[:tail] = torch.arange(main_end, row_len)
        order = torch.cat([order, tail_idx.view(tail_steps, THREADS).t()], dim=1)
    return order


def _tree(values: torch.Tensor) -> torch.Tensor:
    """A warp's shuffle-down sum over the last dim of 32: lane i += lane i + offset, offsets 16..1."""
    width = values.shape[-1]
    while width > 1:
        width //= 2
        values = values[..., :width] + values[..., width: 2 * width]
    return values[..., 0]


def emulate_block_softmax(x: torch.Tensor, exp: Optional[Callable] = None,
                          smem_per_block: int = DEFAULT_SMEM_PER_BLOCK) -> torch.Tensor:
    """Softmax over the last dim of a float32 tensor in exactly ATen's block-softmax order (see the module
    docstring): per-thread sequential sums of ``exp(x - max)``, then cuda_utils::BlockReduce's trees."""
    if x.dtype != torch.float32:
        raise KKError(f"emulate_block_softmax expects float32, got {x.dtype}")
    exp = torch.exp if exp is None else exp
    length = x.shape[-1]
    order = thread_order(length, smem_per_block).to(x.device)
    rows = x.reshape(-1, length)
    row_max = rows.amax(dim=-1)  # exact in any order; the -FLT_MAX start changes nothing for real rows
    e = exp(rows - row_max[:, None])
    padded = torch.cat([e, torch.zeros_like(e[:, :1])], dim=1)  # index -1 -> the appended +0
    lane = torch.zeros(rows.shape[0], THREADS, dtype=torch.float32, device=x.device)
    for step in range(order.shape[1]):  # thread t: sum = sum + e, in its own order
        lane = lane + padded[:, order[:, step]]
    warp_sums = _tree(lane.view(-1, THREADS // WARP, WARP))  # each warp's lane 0
    row_sum = _tree(warp_sums)  # warp 0 over the 32 warp values
    return (e / row_sum[:, None]).reshape(x.shape)


def reference_causal_softmax(raw: torch.Tensor, scale: float, row_len: int, first_query: int, queries: int,
                             causal: bool = True) -> torch.Tensor:
    """The reference's composition on a tile of raw fp16 scores [rows, width] (row r = query first_query +
    r % queries): ``fp16 * scale``, -inf past the query, the float32 softmax over the whole row of
    ``row_len`` (keys past ``width`` are masked), cast back; the first ``width`` columns."""
    rows, width = raw.shape
    scores = torch.full((rows, row_len), float("-inf"), dtype=raw.dtype, device=raw.device)
    scores[:, :width] = raw * scale
    if causal:
        query = first_query + torch.arange(rows, device=raw.device) % queries
        scores = scores.masked_fill(torch.arange(row_len, device=raw.device)[None, :] > query[:, None],
                                    float("-inf"))
    return torch.softmax(scores.float(), dim=-1).to(raw.dtype)[:, :width]


@functools.lru_cache(maxsize=None)
def _load(device: str):
    from .cuda_build import build_kernel_library

    lib = ctypes.CDLL(str(build_kernel_library("kkdeploy_block_softmax", [SOURCE], device)))
    i64, vp = ctypes.c_int64, ctypes.c_void_p
    lib.kk_block_softmax_last_error.restype = ctypes.c_char_p
    lib.kk_causal_block_softmax_f16.argtypes = [vp, vp, i64, i64, i64, i64, i64, i64, i64, i64, ctypes.c_float,
                                                ctypes.c_int, vp]
    return lib


def load_kernel(device: torch.device | str) -> None:
    """Build (nvcc, cached) and load the kernel now, e.g. before a timed run; a one-line KKError if it cannot."""
    _load(str(torch.device(device)))


OP_NAME = "kkdeploy_faithful::causal_block_softmax"


@torch.library.custom_op(OP_NAME, mutates_args=())
def _causal_block_softmax_op(raw: torch.Tensor, scale: float, row_len: int, first_query: int, queries: int,
                             causal: bool, smem_per_block: int) -> torch.Tensor:
    """Default (CPU and any non-CUDA device): the reference composition itself (a contiguous copy of its first
    ``width`` columns, laid out as the kernel's output is)."""
    return reference_causal_softmax(raw, scale, row_len, first_query, queries, causal).contiguous()


@_causal_block_softmax_op.register_kernel("cuda")
def _causal_block_softmax_cuda(raw, scale, row_len, first_query, queries, causal, smem_per_block):
    """CUDA: the fused kernel (``csrc/block_softmax.cu``) for rows that take ATen's regular block softmax."""
    kind, tail = block_softmax_layout(row_len, smem_per_block)
    if kind != "regular":
        raise KKError(f"causal_block_softmax: rows of {row_len} take ATen's shared-memory softmax, whose order "
                      f"this kernel does not reproduce; use the reference composition")
    rows, width = raw.shape
    out = torch.empty_like(raw)
    lib = _load(str(raw.device))
    rc = lib.kk_causal_block_softmax_f16(raw.data_ptr(), out.data_ptr(), rows, width, raw.stride(0), out.stride(0),
                                         row_len, tail, first_query, queries, float(scale), int(causal),
                                         torch.cuda.current_stream(raw.device).cuda_stream)
    if rc != 0:
        raise KKError(lib.kk_block_softmax_last_error().decode())
    return out


@_causal_block_softmax_op.register_fake
def _causal_block_softmax_fake(raw, scale, row_len, first_query, queries, causal, smem_per_block):
    return torch.empty_like(raw)


def causal_block_softmax(raw: torch.Tensor, scale: float, row_len: int, first_query: int, queries: int,
                         causal: bool = True, smem_per_block: int = DEFAULT_SMEM_PER_BLOCK) -> torch.Tensor:
    """``reference_causal_softmax`` as one CUDA kernel on a GPU (the composition itself elsewhere), through the
    custom op ``kkdeploy_faithful::causal_block_softmax``. ``raw`` [rows, width] fp16 with unit column stride;
    every row's visible keys must lie within ``width``."""
    if raw.dim() != 2 or raw.dtype != torch.float16 or raw.stride(1) != 1:
        raise KKError("causal_block_softmax takes [rows, width] float16 scores with unit column stride")
    rows, width = raw.shape
    last_query = first_query + min(rows, queries) - 1
    if width > row_len or (causal and width < min(row_len, last_query + 1)) or (not causal and width != row_len):
        raise KKError(f"causal_block_softmax: width {width} must hold every visible key (row_len {row_len}, "
                      f"queries up to {last_query})")
    return torch.ops.kkdeploy_faithful.causal_block_softmax(raw, float(scale), int(row_len), int(first_query),
                                                            int(queries), bool(causal), int(smem_per_block))
