"""What this machine can do, measured in this process, for the roofline of every call.

A roofline built from a data sheet's peak says little: clocks, power caps, the library's GEMM tiles and the host's
launch path decide what a call can actually reach. So each bench process measures, once, with the bench's own timer
(``measure_latency``: CUDA events per call on a GPU, ``time.perf_counter`` on the CPU), medians like the candidates':

* ``gemm``: a large square GEMM in the run's dtype (TF32 as the process has it), FLOP/s = 2·n³ / time;
* ``copy``: a device-to-device copy of a buffer far larger than the caches, bytes/s = 2·size / time (read + write);
* ``launch``: on a GPU, the replay of a CUDA graph holding one tiny kernel (the floor of any graph-replayed call) and
  of one holding a chain of ``CHAIN_KERNELS`` tiny kernels, whose difference per kernel is the cost of one more
  launch inside a graph; on the CPU, a trivial torch call (the floor of any call; launches are not counted there).

Each measurement takes well under a second on a GPU and is bounded on the CPU (the GEMM grows from 128 until one
call takes ``CPU_MIN_CALL_S``, at most ``CPU_MAX_N``). A limit that cannot be measured records its error; the bench
goes on.
"""

from __future__ import annotations

import copy
import functools
import time

import torch

from ..errors import error_summary
from .timing import measure_latency

GPU_GEMM_N = 8192  # 1.1 TFLOP: ~2 ms in FP16 on an H200, long enough to reach the GEMM's steady clock
CPU_START_N, CPU_MAX_N, CPU_MIN_CALL_S = 128, 1024, 0.005
GPU_COPY_BYTES = 256 * 2**20  # far beyond the L2 (50-60 MiB on Hopper)
CPU_COPY_BYTES = 64 * 2**20
CHAIN_KERNELS = 64
FLOOR_WARMUPS, FLOOR_REPEATS = 20, 200


def _median_ms(fn, device: torch.device, warmups: int, repeats: int) -> float:
    """The bench's timer on one function, one round."""
    return measure_latency({"limit": fn}, device, warmups=warmups, repeats=repeats, rounds=1)["limit"].median_ms


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _gemm_size(a_b_for, device: torch.device) -> int:
    """The GEMM's side: fixed on a GPU; on the CPU doubled until one call is long enough to time, within a cap."""
    if device.type == "cuda":
        return GPU_GEMM_N
    n = CPU_START_N
    while n < CPU_MAX_N:
        a, b, c = a_b_for(n)
        torch.mm(a, b, out=c)  # the first call may start a thread pool: not what one call of this size takes
        start = time.perf_counter()
        torch.mm(a, b, out=c)
        if time.perf_counter() - start >= CPU_MIN_CALL_S:
            break
        n *= 2
    return n


def gemm_limit(device: torch.device, dtype: torch.dtype) -> dict:
    """A large GEMM's throughput in ``dtype``: the compute roof."""
    generator = torch.Generator(device=device).manual_seed(0)

    def operands(n: int):
        a = torch.randn(n, n, generator=generator, device=device, dtype=dtype)
        b = torch.randn(n, n, generator=generator, device=device, dtype=dtype)
        return a, b, torch.empty(n, n, device=device, dtype=dtype)

    n = _gemm_size(operands, device)
    a, b, c = operands(n)
    cuda = device.type == "cuda"
    ms = _median_ms(lambda: torch.mm(a, b, out=c), device, warmups=3 if cuda else 1, repeats=10 if cuda else 3)
    return {"tflop_s": 2 * n**3 / (ms * 1e-3) / 1e12, "n": n, "ms": ms,
            "method": f"torch.mm of two {n}x{n} matrices"}


def copy_limit(device: torch.device) -> dict:
    """A device-to-device copy's bandwidth (bytes read plus bytes written per second): the memory roof."""
    size = GPU_COPY_BYTES if device.type == "cuda" else CPU_COPY_BYTES
    src = torch.ones(size, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    cuda = device.type == "cuda"
    ms = _median_ms(lambda: dst.copy_(src), device, warmups=2 if cuda else 1, repeats=10 if cuda else 5)
    return {"gb_s": 2 * size / (ms * 1e-3) / 1e9, "bytes_moved": 2 * size, "ms": ms,
            "method": f"dst.copy_(src) of {size // 2**20} MiB"}


def _tiny_kernel_graph(device: torch.device, kernels: int):
    """A CUDA graph of ``kernels`` dependent one-element adds: launches and almost no work."""
    t = torch.zeros(1, device=device)
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        t.add_(1)  # lazy init off the capture
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(kernels):
            t.add_(1)
    _sync(device)
    return graph, t


def launch_limit(device: torch.device) -> dict:
    """The floor of one call, and on a GPU the cost of each further launch inside a CUDA graph: the launch roof."""
    if device.type != "cuda":
        t = torch.zeros(1)
        floor = _median_ms(lambda: t.add_(1), device, FLOOR_WARMUPS, FLOOR_REPEATS)
        return {"floor_ms": floor, "per_launch_ms": None,
                "method": "a trivial torch call (one-element add_), time.perf_counter; launches not counted on the CPU"}
    one, _t1 = _tiny_kernel_graph(device, 1)
    chain, _tk = _tiny_kernel_graph(device, CHAIN_KERNELS)
    floor = _median_ms(one.replay, device, FLOOR_WARMUPS, FLOOR_REPEATS)
    chained = _median_ms(chain.replay, device, FLOOR_WARMUPS, FLOOR_REPEATS)
    return {"floor_ms": floor, "per_launch_ms": max(chained - floor, 0.0) / (CHAIN_KERNELS - 1),
            "chain_kernels": CHAIN_KERNELS, "chain_ms": chained,
            "method": f"CUDA-graph replay of 1 and of {CHAIN_KERNELS} dependent one-element kernels, CUDA events"}


def _guarded(measure, *args) -> dict:
    """A limit, or the one-line error that kept it from being measured (the bench goes on without it)."""
    start = time.perf_counter()
    try:
        result = measure(*args)
    except Exception as exc:  # a missing library or a full device must not end the bench
        return {"error": error_summary(exc, 300)}
    result["seconds"] = round(time.perf_counter() - start, 4)
    return result


@functools.lru_cache(maxsize=None)
def _measure(device: str, dtype: str, tf32: bool) -> dict:
    from ..config import parse_dtype

    dev = torch.device(device)
    limits = {"device": device, "dtype": dtype, "tf32": tf32,
              "gemm": _guarded(gemm_limit, dev, parse_dtype(dtype)),
              "copy": _guarded(copy_limit, dev),
              "launch": _guarded(launch_limit, dev)}
    if dev.type == "cuda":
        torch.cuda.empty_cache()  # hand the large buffers back before the models are built
    return limits


def measure_limits(device, dtype: torch.dtype) -> dict:
    """The machine's limits for ``dtype`` on ``device``, measured once per process (cached; TF32 is part of the key,
    as the process has it set). Returns a copy the caller may change."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    tf32 = device.type == "cuda" and dtype == torch.float32 and bool(torch.backends.cuda.matmul.allow_tf32)
    return copy.deepcopy(_measure(str(device), str(dtype).replace("torch.", ""), tf32))
