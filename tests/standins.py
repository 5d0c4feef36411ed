"""Stand-ins for a GPU engine's parts, on the CPU, for the serving tests: a captured graph, a bucket engine over such
captures, and the CUDA driver's copies on host memory. Free of pytest and of side effects, so that the stand-in a
real tritonserver loads (tests/native_standin) is made of the same parts as the tests' own."""

from __future__ import annotations

import ctypes

import torch

#: a "graph" the stub driver launches by calling it (tests/native_standin/stub_cuda.c)
LAUNCH = ctypes.CFUNCTYPE(ctypes.c_int)


class CapturedStandIn:
    """A CUDA graph capture's shape on the CPU: static buffers (rows of ``row_shape``), a replay that reads them
    (``y = 2 * x * mask``) into a static output, and an ordinary call that must never run where the static call
    exists. ``launchable``: it also has an executable graph for the native route (a callback the stub driver calls).
    ``note(route size valid_tokens)``: told of each run, by which route."""
    backend, reason = "captured", ""

    def __init__(self, size: int, row_shape=(3, 2), dtype=torch.float32, launchable: bool = False, note=None):
        self.size, self.note = size, note
        self.x, self.mask = torch.zeros(size, *row_shape, dtype=dtype), torch.zeros(size, row_shape[0], dtype=torch.bool)
        self.y, self.replays = torch.zeros(size, *row_shape, dtype=dtype), []
        self.launch = LAUNCH(self._launch) if launchable else None  # kept alive with the capture

    def _compute(self, route: str) -> None:
        self.replays.append((self.x.clone(), self.mask.clone()))
        self.y.copy_(self.x * 2 * self.mask[..., None])
        if self.note is not None:
            self.note(f"{route} {self.size} {int(self.mask.sum())}")

    def _replay(self):
        self._compute("python")
        return self.y

    def _launch(self) -> int:
        self._compute("native")
        return 0

    def graph_exec(self) -> int:
        return ctypes.cast(self.launch, ctypes.c_void_p).value if self.launch is not None else 0

    def static_call(self):
        from engines.cuda_graph import StaticCall

        return StaticCall(self.x, self.mask, self._replay, self.y, self.graph_exec)

    def __call__(self, x, mask):
        raise AssertionError("the ordinary call ran")


def captured_bucket_engine(sizes=(1, 4), row_shape=(3, 2), dtype=torch.float32, cuda: bool = False,
                           launchable=(), note=None):
    """``(BucketEngine on the CPU over CapturedStandIn buckets, {size: capture})``, built without loading artifacts.
    ``cuda``: it says it serves a GPU (the in-process backend's routes take it), its "pinned" host buffers made here
    (pinning needs a GPU); ``launchable``: the buckets whose captures the native route can launch."""
    from kkdeploy.pipeline.runtime import BucketedRunner
    from kkdeploy.serving import triton_model

    captures = {b: CapturedStandIn(b, row_shape, dtype, b in launchable, note) for b in sizes}
    engine = triton_model.BucketEngine.__new__(triton_model.BucketEngine)
    engine.name, engine.runner = "standin", BucketedRunner(captures)
    engine.described = ", ".join(f"{b}: {c.backend}" for b, c in captures.items())
    engine.row_shape, engine.dtype, engine.device, engine.cuda = list(row_shape), dtype, torch.device("cpu"), cuda
    engine.inference_mode, engine.buffers, engine.static_all_true = torch.inference_mode, {}, {}
    engine.static_mask_shared = False
    engine.static, engine.gpu_outputs = {b: r.static_call() for b, r in captures.items()}, False
    engine.all_valid = {b: torch.ones([b, row_shape[0]], dtype=torch.bool) for b in sizes}
    engine.host_inputs, engine.host_outputs, engine.max_batch = {}, {}, max(sizes)
    if cuda:  # what staging() and host_output() would pin
        engine.host_inputs = {b: (torch.zeros_like(c.x), torch.zeros_like(c.mask)) for b, c in captures.items()}
        engine.host_outputs = {b: torch.zeros_like(c.y) for b, c in captures.items()}
    return engine, captures


class HostDriver:
    """``cuda_driver.Driver``'s calls on host memory (a CPU tensor's pointer stands for a device pointer), each call
    recorded."""

    def __init__(self):
        self.calls = []

    def to_device(self, dst, src, nbytes, stream):
        self.calls.append(("to_device", nbytes))
        ctypes.memmove(dst, src, nbytes)

    def to_host(self, dst, src, nbytes, stream):
        self.calls.append(("to_host", nbytes))
        ctypes.memmove(dst, src, nbytes)

    def fill(self, dst, value, nbytes, stream):
        if nbytes:  # as the driver: no call for nothing
            self.calls.append(("fill", value, nbytes))
            ctypes.memset(dst, value, nbytes)

    def wait(self, stream):
        self.calls.append(("wait",))
