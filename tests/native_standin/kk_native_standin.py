"""A CUDA engine's shape on the CPU, inside a real tritonserver, for the in-process backend's native route.

Patches what an in-process instance would ask of a GPU (its engine, stream, device, the driver of its Python route)
with host-memory stand-ins. Bucket 1 is a capture the native route can launch (its "graph" a ctypes callback the
stub driver calls); bucket 2 is a capture without an executable graph, so its runs stay with Python's direct route.
Each capture computes y = 2 * x * mask and appends which route ran it to KKDEPLOY_STANDIN_LOG."""

import ctypes
import os
import types

import torch

from engines.cuda_graph import StaticCall
from kkdeploy.pipeline.runtime import BucketedRunner
from kkdeploy.serving import cuda_driver, inprocess, triton_model

LAUNCH = ctypes.CFUNCTYPE(ctypes.c_int)
LOG = os.environ.get("KKDEPLOY_STANDIN_LOG", "")


def note(what: str) -> None:
    if LOG:
        with open(LOG, "a") as f:
            f.write(what + "\n")


class Capture:
    backend, reason = "standin", "stand-in capture"

    def __init__(self, size: int, row_shape, launchable: bool):
        self.size = size
        self.x = torch.zeros(size, *row_shape)
        self.mask = torch.zeros(size, row_shape[0], dtype=torch.bool)
        self.y = torch.zeros(size, *row_shape)
        self.launch = LAUNCH(self._launch) if launchable else None  # kept alive with the capture

    def _compute(self):
        self.y.copy_(self.x * 2 * self.mask[..., None])

    def _launch(self) -> int:
        self._compute()
        note(f"native {self.size} {int(self.mask.sum())}")
        return 0

    def _replay(self):
        self._compute()
        note(f"python {self.size} {int(self.mask.sum())}")
        return self.y

    def _graph_exec(self) -> int:
        return ctypes.cast(self.launch, ctypes.c_void_p).value if self.launch is not None else 0

    def static_call(self):
        return StaticCall(self.x, self.mask, self._replay, self.y, self._graph_exec)

    def __call__(self, x, mask):
        raise AssertionError("the ordinary call ran")


def engine(name, artifacts, device, row_shape, dtype, max_batch, gpu_outputs=False, canary_file=None):
    captures = {1: Capture(1, row_shape, True), 2: Capture(2, row_shape, False)}
    e = triton_model.BucketEngine.__new__(triton_model.BucketEngine)
    e.name, e.runner = name, BucketedRunner(captures)
    e.row_shape, e.dtype, e.device, e.cuda, e.max_batch = list(row_shape), dtype, torch.device("cpu"), True, max_batch
    e.inference_mode, e.buffers, e.static_all_true, e.static_mask_shared = torch.inference_mode, {}, {}, False
    e.static, e.gpu_outputs = {b: c.static_call() for b, c in captures.items()}, False
    e.all_valid = {b: torch.ones([b, row_shape[0]], dtype=torch.bool) for b in captures}
    # the buckets' "pinned" host buffers, made here: pinning needs a GPU
    e.host_inputs = {b: (torch.zeros(b, *row_shape, dtype=dtype), torch.zeros(b, row_shape[0], dtype=torch.bool))
                     for b in captures}
    e.host_outputs = {b: torch.zeros(b, *row_shape, dtype=dtype) for b in captures}
    e.described = ", ".join(f"{b}: {c.backend}" for b, c in captures.items())
    return e


class HostDriver:
    """``cuda_driver.Driver`` on host memory, for Python's direct route."""

    def to_device(self, dst, src, nbytes, stream):
        ctypes.memmove(dst, src, nbytes)

    def to_host(self, dst, src, nbytes, stream):
        ctypes.memmove(dst, src, nbytes)

    def fill(self, dst, value, nbytes, stream):
        ctypes.memset(dst, value, nbytes)

    def wait(self, stream):
        pass


inprocess.BucketEngine = engine
inprocess.cuda_sync_mode = lambda: "stand-in"
cuda_driver.Driver = HostDriver
torch.cuda.Stream = lambda device=None: types.SimpleNamespace(cuda_stream=0)
torch.cuda.set_device = lambda device: None
torch.cuda.set_stream = lambda stream: None
