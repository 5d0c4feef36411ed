"""A CUDA engine's shape on the CPU, inside a real tritonserver, for the in-process backend's native route.

``install()`` (called by this folder's sitecustomize) patches what an in-process instance would ask of a GPU (its
engine, stream, device, the driver of its Python route) with the tests' host-memory stand-ins (tests/standins.py).
Bucket 1 is a capture the native route can launch (its "graph" a callback the stub driver calls); bucket 2 has no
executable graph, so its runs stay with Python's direct route (KKDEPLOY_STANDIN_LAUNCHABLE=1,2 makes both launchable).
Each capture computes y = 2 * x * mask and appends which route ran it to KKDEPLOY_STANDIN_LOG."""

import os
import sys
import types
from pathlib import Path


def note(what: str) -> None:
    log = os.environ.get("KKDEPLOY_STANDIN_LOG", "")
    if log:
        with open(log, "a") as f:
            f.write(what + "\n")


def install() -> None:
    sys.path.append(str(Path(__file__).resolve().parents[2]))  # the repository root, for tests.standins
    import torch

    from kkdeploy.serving import cuda_driver, inprocess
    from tests.standins import HostDriver, captured_bucket_engine

    def engine(name, artifacts, device, row_shape, dtype, max_batch, gpu_outputs=False, canary_file=None):
        launchable = tuple(int(v) for v in os.environ.get("KKDEPLOY_STANDIN_LAUNCHABLE", "1").split(","))
        made, _ = captured_bucket_engine((1, 2), row_shape, dtype, cuda=True, launchable=launchable, note=note)
        made.name, made.max_batch = name, max_batch
        return made

    inprocess.BucketEngine = engine
    inprocess.cuda_sync_mode = lambda: "stand-in"
    cuda_driver.Driver = HostDriver
    torch.cuda.Stream = lambda device=None: types.SimpleNamespace(cuda_stream=0)
    torch.cuda.set_device = lambda device: None
    torch.cuda.set_stream = lambda stream: None
