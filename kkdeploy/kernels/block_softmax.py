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

Measured on the H200 (scripts/block_softmax_selftest.py; docs/long-context.md has the run): the emulation equals
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

from .cuda_build import load_problem
from .proof import ProofCase, ProofRecord, kernel_environment, lookup_proof, prove_launches, remember_proof

THREADS = 1024  # ATen's block for rows of 1024 elements or more
VEC = 4  # ILP = sizeof(float4) / sizeof(float)
WARP = 32
CHUNK = THREADS * VEC  # one pass of the whole block over vectors: 4096 elements
#: cudaDeviceProp.sharedMemPerBlock on the GPUs we target (48 KiB, the non-opt-in limit ATen reads)
DEFAULT_SMEM_PER_BLOCK = 49152
SOURCE = Path(__file__).resolve().parent / "csrc" / "block_softmax.cu"


OP = "block_softmax"


def kernel_refusal(device: torch.device | str, dtype: torch.dtype) -> Optional[str]:
    """None when the kernel can run on ``device`` for ``dtype`` (CUDA, float16, built and loaded), else why not.
    Whether it may run is the proof's question (``proven_launch``)."""
    device = torch.device(device)
    if device.type != "cuda":
        return f"{device.type} device: the block-softmax kernel is CUDA-only"
    if dtype != torch.float16:
        return f"{dtype}: the block-softmax kernel reproduces the float16 reference only"
    problem = load_problem(_load, str(device))
    if problem:  # e.g. no nvcc where this runs: full key rows with ATen's ops give the reference's bits too
        return f"the block-softmax kernel cannot be built or loaded here ({problem})"
    return None


def proof_shape(row_len: int, rows: int) -> dict:
    """The op shape a proof holds for: rows of ``row_len`` keys, ``rows`` rows (heads x queries) per launch."""
    return {"row_len": int(row_len), "rows": int(rows), "dtype": "float16"}


def proof_environment(device: torch.device | str) -> dict:
    """The environment key of this kernel's proofs: device, torch, CUDA, plus its source and compiler (computed once
    per device and process: every tiled layer of every call asks)."""
    return kernel_environment(device, OP, [SOURCE], compiler="nvcc")


def proven_launch(device: torch.device | str, dtype: torch.dtype, row_len: int, rows: int) -> Optional[str]:
    """The launch a proof in this environment found bit-identical and fastest at this op shape, else None."""
    if kernel_refusal(device, dtype):
        return None
    record = lookup_proof(proof_environment(device), OP, proof_shape(row_len, rows))
    return record.chosen if record is not None else None


def fast_path_reason(device: torch.device | str, dtype: torch.dtype, row_len: Optional[int] = None,
                     rows: Optional[int] = None) -> Optional[str]:
    """None when the long-context path may use this kernel on ``device`` for ``dtype`` (and, given an op shape,
    a proof here found a bit-identical launch for it), else why not."""
    refusal = kernel_refusal(device, dtype)
    if refusal or row_len is None:
        return refusal
    if proven_launch(device, dtype, row_len, rows) is None:
        return (f"no proof in this environment that the block-softmax kernel is bit-identical for rows of "
                f"{row_len} keys, {rows} per launch (the build proves it: kkdeploy build --shape 14)")
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


def emulate_block_sums(x: torch.Tensor, exp: Optional[Callable] = None,
                       smem_per_block: int = DEFAULT_SMEM_PER_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """(``exp(x - max)``, the row sums) of a float32 [rows, length] tensor in exactly ATen's block-softmax order:
    per-thread sequential sums, then cuda_utils::BlockReduce's trees. The sums are what a kernel must reproduce
    bit for bit; the fp16 probabilities hide most of a sum's last-bit errors."""
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
    return e, _tree(warp_sums)  # warp 0 over the 32 warp values


def emulate_block_softmax(x: torch.Tensor, exp: Optional[Callable] = None,
                          smem_per_block: int = DEFAULT_SMEM_PER_BLOCK) -> torch.Tensor:
    """Softmax over the last dim of a float32 tensor in exactly ATen's block-softmax order (see the module
    docstring): per-thread sequential sums of ``exp(x - max)``, then cuda_utils::BlockReduce's trees."""
    e, row_sum = emulate_block_sums(x, exp, smem_per_block)
    return (e / row_sum[:, None]).reshape(x.shape)


def sequence_of_rows(rows: int, rows_per_sequence: int, device) -> torch.Tensor:
    """The sequence each row of a [b, H, T] tile flattened to rows belongs to."""
    return torch.arange(rows, device=device) // rows_per_sequence


def reference_causal_softmax(raw: torch.Tensor, scale: float, row_len: int, first_query: int, queries: int,
                             causal: bool = True, lengths: Optional[torch.Tensor] = None,
                             rows_per_sequence: int = 0) -> torch.Tensor:
    """The reference's composition on a tile of raw fp16 scores [rows, width] (row r = query first_query +
    r % queries): ``fp16 * scale``, -inf past the query, -inf at keys at or past the row's sequence length
    (``lengths`` [b], row r in sequence r // rows_per_sequence: the reference's invalid keys, masked for every
    query), the float32 softmax over the whole row of ``row_len`` (keys past ``width`` are masked), cast back;
    the first ``width`` columns."""
    rows, width = raw.shape
    scores = torch.full((rows, row_len), float("-inf"), dtype=raw.dtype, device=raw.device)
    scores[:, :width] = raw * scale
    keys = torch.arange(row_len, device=raw.device)[None, :]
    if causal:
        query = first_query + torch.arange(rows, device=raw.device) % queries
        scores = scores.masked_fill(keys > query[:, None], float("-inf"))
    if lengths is not None:
        valid = lengths.to(raw.device)[sequence_of_rows(rows, rows_per_sequence, raw.device)]
        scores = scores.masked_fill(keys >= valid[:, None], float("-inf"))
    return torch.softmax(scores.float(), dim=-1).to(raw.dtype)[:, :width]


@functools.lru_cache(maxsize=None)
def _load(device: str):
    from .cuda_build import build_kernel_library

    lib = ctypes.CDLL(str(build_kernel_library("kkdeploy_block_softmax", [SOURCE], device)))
    i64, vp = ctypes.c_int64, ctypes.c_void_p
    lib.kk_block_softmax_last_error.restype = ctypes.c_char_p
    lib.kk_causal_block_softmax_f16.argtypes = [vp, vp, i64, i64, i64, i64, i64, i64, i64, i64, ctypes.c_float,
                                                ctypes.c_int, vp, i64, ctypes.c_int, ctypes.c_int, vp]
    return lib


def load_kernel(device: torch.device | str) -> None:
    """Build (nvcc, cached) and load the kernel now, e.g. before a timed run; a one-line KKError if it cannot."""
    _load(str(torch.device(device)))


OP_NAME = "kkdeploy_faithful::causal_block_softmax"

#: the kernel's launch variants (csrc/block_softmax.cu): bits of the ``variant`` argument. None changes what is
#: computed, only how; each must be proven bit-identical on the device that runs it (``proof``).
LAUNCHES: dict[str, int] = {"exact": 0, "raw-max": 1, "markstein": 2, "raw-max+markstein": 3}
#: the launch the op takes when none is named (the kernel as first proven on the H200)
DEFAULT_LAUNCH = "exact"


def launch_variant(launch: str) -> int:
    if launch not in LAUNCHES:
        raise KKError(f"block-softmax launch must be one of {', '.join(LAUNCHES)}, got {launch!r}")
    return LAUNCHES[launch]


@torch.library.custom_op(OP_NAME, mutates_args=())
def _causal_block_softmax_op(raw: torch.Tensor, scale: float, row_len: int, first_query: int, queries: int,
                             causal: bool, smem_per_block: int, lengths: Optional[torch.Tensor] = None,
                             rows_per_sequence: int = 0, variant: int = 0) -> torch.Tensor:
    """Default (CPU and any non-CUDA device): the reference composition itself (a contiguous copy of its first
    ``width`` columns, laid out as the kernel's output is). ``variant`` changes nothing here."""
    return reference_causal_softmax(raw, scale, row_len, first_query, queries, causal, lengths,
                                    rows_per_sequence).contiguous()


@_causal_block_softmax_op.register_kernel("cuda")
def _causal_block_softmax_cuda(raw, scale, row_len, first_query, queries, causal, smem_per_block, lengths=None,
                               rows_per_sequence=0, variant=0):
    """CUDA: the fused kernel (``csrc/block_softmax.cu``) for rows that take ATen's regular block softmax."""
    kind, tail = block_softmax_layout(row_len, smem_per_block)
    if kind != "regular":
        raise KKError(f"causal_block_softmax: rows of {row_len} take ATen's shared-memory softmax, whose order "
                      f"this kernel does not reproduce; use the reference composition")
    rows, width = raw.shape
    out = torch.empty_like(raw)
    lib = _load(str(raw.device))
    if lengths is not None:
        lengths = lengths.to(device=raw.device, dtype=torch.int64).contiguous()
    rc = lib.kk_causal_block_softmax_f16(raw.data_ptr(), out.data_ptr(), rows, width, raw.stride(0), out.stride(0),
                                         row_len, tail, first_query, queries, float(scale), int(causal),
                                         None if lengths is None else lengths.data_ptr(), int(rows_per_sequence),
                                         int(variant), 1, torch.cuda.current_stream(raw.device).cuda_stream)
    if rc != 0:
        raise KKError(lib.kk_block_softmax_last_error().decode())
    return out


@_causal_block_softmax_op.register_fake
def _causal_block_softmax_fake(raw, scale, row_len, first_query, queries, causal, smem_per_block, lengths=None,
                               rows_per_sequence=0, variant=0):
    return torch.empty_like(raw)


def causal_block_softmax(raw: torch.Tensor, scale: float, row_len: int, first_query: int, queries: int,
                         causal: bool = True, smem_per_block: int = DEFAULT_SMEM_PER_BLOCK,
                         lengths: Optional[torch.Tensor] = None, rows_per_sequence: int = 0,
                         launch: str = DEFAULT_LAUNCH) -> torch.Tensor:
    """``reference_causal_softmax`` as one CUDA kernel on a GPU (the composition itself elsewhere), through the
    custom op ``kkdeploy_faithful::causal_block_softmax``. ``raw`` [rows, width] fp16 with unit column stride;
    every row's visible keys must lie within ``width``. ``lengths`` [b] (padded calls): the valid-prefix length
    of each sequence, rows ``rows_per_sequence`` at a time."""
    if raw.dim() != 2 or raw.dtype != torch.float16 or raw.stride(1) != 1:
        raise KKError("causal_block_softmax takes [rows, width] float16 scores with unit column stride")
    rows, width = raw.shape
    last_query = first_query + min(rows, queries) - 1
    visible_end = min(row_len, last_query + 1)
    if lengths is not None:
        if lengths.dim() != 1 or rows_per_sequence < 1 or lengths.numel() * rows_per_sequence != rows:
            raise KKError(f"causal_block_softmax: lengths must hold one length per {rows_per_sequence} rows "
                          f"({rows} rows, {lengths.numel()} lengths)")
    needed = visible_end if causal else row_len  # the keys some row can see
    if lengths is not None and width < needed:  # padded keys need not be stored (one sync, rare tiles only)
        needed = min(needed, int(lengths.max()))
    if not needed <= width <= row_len:
        raise KKError(f"causal_block_softmax: width {width} must hold every visible key (row_len {row_len}, "
                      f"queries up to {last_query})")
    return torch.ops.kkdeploy_faithful.causal_block_softmax(raw, float(scale), int(row_len), int(first_query),
                                                            int(queries), bool(causal), int(smem_per_block),
                                                            lengths, int(rows_per_sequence),
                                                            launch_variant(launch))


# -- the proof ------------------------------------------------------------------------------------------------
def tile_case(label: str, q: torch.Tensor, k: torch.Tensor, scale: float, t0: int, query_tile: int,
              k_end: int, lengths: Optional[torch.Tensor]) -> ProofCase:
    """One causal tile of a layer's attention as the long-context path runs it: raw fp16 Q.K^T of queries
    [t0, t0 + query_tile) against keys [0, k_end) of q, k [b,H,S,Dh], and (padded) each sequence's length."""
    b, heads, seq_len, _ = q.shape
    t1 = min(seq_len, t0 + query_tile)
    raw = torch.matmul(q[:, :, t0:t1], k[:, :, :k_end].transpose(-2, -1)).reshape(-1, k_end)
    rows_per_sequence = heads * (t1 - t0)

    def reference():
        return reference_causal_softmax(raw, scale, seq_len, t0, t1 - t0, True, lengths, rows_per_sequence)

    def run(launch: str):
        return causal_block_softmax(raw, scale, seq_len, t0, t1 - t0, lengths=lengths,
                                    rows_per_sequence=rows_per_sequence, launch=launch)

    return ProofCase(label, reference, run)


def prove_block_softmax(device: torch.device | str, cases: list[ProofCase], row_len: int, rows: int, *,
                        launches: Optional[list[str]] = None, budget_s: float = 60.0, repeats: int = 5,
                        timing_case: Optional[int] = None) -> ProofRecord:
    """Prove the kernel's launches on ``cases`` (``tile_case``) at op shape (row_len, rows); remember the record
    for this process and in the on-disk cache. Where the kernel cannot run at all, the record says why."""
    environment = proof_environment(device)
    shape = proof_shape(row_len, rows)
    refusal = kernel_refusal(device, torch.float16)
    if refusal:
        record = ProofRecord(op=OP, shape=shape, environment=environment, reason=refusal)
    elif not kernel_covers(row_len):
        record = ProofRecord(op=OP, shape=shape, environment=environment,
                             reason=f"rows of {row_len} keys take ATen's shared-memory or warp softmax, which this "
                                    f"kernel does not reproduce")
    else:
        record = prove_launches(OP, shape, launches or list(LAUNCHES), cases, device, environment=environment,
                                timing_case=timing_case, repeats=repeats, budget_s=budget_s)
    remember_proof(record)
    return record
