"""The few CUDA driver calls kkdeploy's in-process backend makes itself, through ctypes on ``libcuda.so.1``.

Why not torch: a batch-1 request on a GPU spends more time in Python's wrapping of Triton's buffers and torch's
dispatch of small copies than in the copies (docs/serving.md: wrapping two buffers 19 us, each pageable copy
about 12 us, outside the server). The in-process backend's direct route (``inprocess.DirectRoute``) moves a request's
bytes with ``memmove`` into pinned staging and one asynchronous copy each way, so an execution waits for the GPU
once. The driver library is where the GPU is (the runtime's pointers and streams are the driver's), and its calls
need no CUDA toolkit. Every call's result is checked: a failure is raised with the call's name, never ignored.
"""

from __future__ import annotations

import ctypes
import os

#: CUctx_flags' scheduling bits (cuda.h): how a host thread waits for the GPU (a stream sync, a pageable copy)
SCHED_MODES = {0: "auto", 1: "spin", 2: "yield", 4: "blocking-sync"}


def cuda_sync_mode(lib=None) -> str:
    """How the current CUDA context makes a host thread wait for the GPU: the scheduling bits of ``cuCtxGetFlags``.

    Why: inside tritonserver each stage of a batch-1 run took longer than the same Python half outside it, on the same
    H100 artifact's kind (gather 179 against 66 us, engine 139 against 111, respond 86 against 34;
    ``scripts/serving_gather_study.py``), and each stage ends in a host wait. The in-process backend shares the
    server's context, whose flags the server may have set; a blocking sync costs a thread wake-up per wait where a spin
    costs none. So the instance's log line says which it is."""
    try:
        lib = lib if lib is not None else ctypes.CDLL("libcuda.so.1")
        flags = ctypes.c_uint(0)
        result = lib.cuCtxGetFlags(ctypes.byref(flags))
    except (OSError, AttributeError) as exc:
        return f"unknown ({type(exc).__name__}: {exc})"
    if result != 0:
        return f"unknown (cuCtxGetFlags returned CUresult {result})"
    return SCHED_MODES.get(flags.value & 0x7, f"flags {flags.value:#x}")


#: The host-wait mode an in-process instance sets on the server's CUDA context (``cuCtxSetFlags``): ``leave`` (the
#: default: the context's flags as tritonserver made them), ``auto``, ``spin``, ``yield`` or ``blocking-sync``
HOST_WAIT_ENV = "KKDEPLOY_HOST_WAIT"


def host_wait_wanted(mode: str | None = None) -> str:
    """``mode`` (default: ``$KKDEPLOY_HOST_WAIT``, else ``leave``), checked before an instance builds anything."""
    mode = os.environ.get(HOST_WAIT_ENV, "leave") if mode is None else mode
    if mode != "leave" and mode not in SCHED_MODES.values():
        raise ValueError(f"{HOST_WAIT_ENV}={mode!r} is not a host-wait mode; use leave, "
                         f"{', '.join(SCHED_MODES.values())}")
    return mode


def set_cuda_sync_mode(mode: str, lib=None) -> str:
    """Make the current CUDA context's host waits ``mode`` (a name of ``SCHED_MODES``), keeping its other flags;
    answers the mode now in force (``cuda_sync_mode``'s words).

    Why: every stage of a batch-1 run ends in a host wait for the GPU, and inside tritonserver each stage took longer
    than the same Python outside it (see ``cuda_sync_mode``). ``cuCtxSetFlags`` (CUDA 12.1 and later) changes the
    scheduling bits of a context that is already in use, so the study can serve the same artifact both ways."""
    bits = {name: value for value, name in SCHED_MODES.items()}
    host_wait_wanted(mode)
    try:
        lib = lib if lib is not None else ctypes.CDLL("libcuda.so.1")
        flags = ctypes.c_uint(0)
        result = lib.cuCtxGetFlags(ctypes.byref(flags))
        if result == 0:
            result = lib.cuCtxSetFlags(ctypes.c_uint((flags.value & ~0x7) | bits[mode]))
    except (OSError, AttributeError) as exc:
        return f"unchanged ({type(exc).__name__}: {exc})"
    if result != 0:
        return f"unchanged (CUresult {result}); {cuda_sync_mode(lib)}"
    return cuda_sync_mode(lib)


class Driver:
    """Copies, fills and a stream wait on ``libcuda.so.1`` (or ``lib``, a stand-in with the same functions)."""

    def __init__(self, lib=None):
        if lib is None:
            lib = ctypes.CDLL("libcuda.so.1")
            c, p, n, s = ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p
            lib.cuMemcpyHtoDAsync_v2.argtypes = [ctypes.c_uint64, p, n, s]
            lib.cuMemcpyDtoHAsync_v2.argtypes = [p, ctypes.c_uint64, n, s]
            lib.cuMemsetD8Async.argtypes = [ctypes.c_uint64, ctypes.c_ubyte, n, s]
            lib.cuStreamSynchronize.argtypes = [s]
            for f in (lib.cuMemcpyHtoDAsync_v2, lib.cuMemcpyDtoHAsync_v2, lib.cuMemsetD8Async,
                      lib.cuStreamSynchronize):
                f.restype = c
        self.lib = lib

    @staticmethod
    def _check(name: str, result: int) -> None:
        if result != 0:
            raise RuntimeError(f"{name} failed with CUresult {result}")

    def to_device(self, device_ptr: int, host_ptr: int, nbytes: int, stream: int) -> None:
        """Host to device on ``stream``; asynchronous when the host memory is pinned."""
        if nbytes:
            self._check("cuMemcpyHtoDAsync", self.lib.cuMemcpyHtoDAsync_v2(device_ptr, host_ptr, nbytes, stream))

    def to_host(self, host_ptr: int, device_ptr: int, nbytes: int, stream: int) -> None:
        """Device to host on ``stream`` (complete after ``wait``)."""
        if nbytes:
            self._check("cuMemcpyDtoHAsync", self.lib.cuMemcpyDtoHAsync_v2(host_ptr, device_ptr, nbytes, stream))

    def fill(self, device_ptr: int, value: int, nbytes: int, stream: int) -> None:
        """``nbytes`` bytes of ``value`` on the device, on ``stream``."""
        if nbytes:
            self._check("cuMemsetD8Async", self.lib.cuMemsetD8Async(device_ptr, value, nbytes, stream))

    def wait(self, stream: int) -> None:
        """The host waits until everything on ``stream`` is done (the context's host-wait mode says how)."""
        self._check("cuStreamSynchronize", self.lib.cuStreamSynchronize(stream))
