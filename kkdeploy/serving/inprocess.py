"""The Python half of kkdeploy's in-process Triton backend (``csrc/kkdeploy_backend.cc``).

The backend embeds this interpreter in ``tritonserver`` itself, so a request never leaves the server's process:
no Python-backend stub, no shared-memory message queue, no copy into and out of the stub. The C++ half speaks
Triton's C API and calls in here with plain Python values:

* ``Model(config_json, repository, version)`` once per model; ``model.instance(name, kind, device_id)`` once per
  model instance (its ``BucketEngine``: ``kkdeploy.load`` of ``<version>/artifacts``, every check it makes);
* ``instance.execute(requests)`` once per execution. Each request is ``(x, mask)``, each input ``(shape, buffers)``
  with ``buffers`` a list of ``(pointer, bytes, memory type, memory type id)`` in Triton's own memory (wrapped as
  torch tensors here, not copied), ``mask`` None when the request sent none. The answer is ``(outcomes, runs)``:
  per request ``(shape, pointer, bytes, on_host)`` of its answer, valid until the next execute of this instance,
  or ``(error code, message)``; per engine run ``(gather_ns, engine_ns, respond_ns, bucket, real rows)`` for the
  metrics;
* ``instance.copy_out(targets)`` when an answer must go where the C++ half does not copy (GPU memory on either
  side, except the native route's answers into buffers on its own GPU, which it copies on the device): ``(request
  index, pointer, bytes, memory type, memory type id)``;
* ``instance.finalize()`` when Triton unloads the instance (the release marker ``kkdeploy serve`` waits for);
* ``instance.native_plan()`` once, after the instance is made: what the C++ half needs to serve the executions it
  can by itself, without calling here (the native route: the captures' and staging buffers' addresses, the
  executable graphs, the stream), or None; ``instance.native_refused(why)`` when it cannot use the plan, and
  ``instance.enter_thread()`` before its first native run on a thread.

The batching, padding and answers are the Python backend's one-hop model's (``triton_model.BucketEngine``), so the
two backends cannot differ in what they compute; the serving tests check both bit for bit.
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import sys
import threading
import time

from .cuda_driver import HOST_WAIT_ENV, cuda_sync_mode, host_wait_wanted, set_cuda_sync_mode
from .triton_model import (ARTIFACTS, CANARY_FILE, DEVICE_TYPE, INPUT_X, OUTPUT_Y, RELEASE_DIR, BucketEngine,
                           gpu_outputs_wanted, leave_release_marker, parameter, release_marker, torch_dtype)

# TRITONSERVER_Error_Code and TRITONSERVER_MemoryType (triton/core/tritonserver.h)
ERROR_INTERNAL, ERROR_INVALID_ARG = 1, 3
MEMORY_CPU, MEMORY_CPU_PINNED, MEMORY_GPU = 0, 1, 2


class _CudaMemory:
    """A device buffer Triton owns, seen by torch through ``__cuda_array_interface__`` (no copy)."""

    def __init__(self, pointer: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (pointer, False),
                                         "version": 3, "strides": None}


def wrap_buffer(pointer: int, nbytes: int, memory_type: int, memory_id: int):
    """A uint8 torch tensor over ``nbytes`` at ``pointer`` in Triton's memory: host or GPU, never copied."""
    import torch

    if memory_type == MEMORY_GPU:
        return torch.as_tensor(_CudaMemory(pointer, nbytes), device=f"cuda:{memory_id}")
    return torch.frombuffer((ctypes.c_char * nbytes).from_address(pointer), dtype=torch.uint8)


def input_tensor(described, dtype):
    """The request's tensor (``(shape, buffers)`` from the C++ half), or None. One buffer: a view of Triton's
    memory; several (a tensor Triton holds in pieces): joined into one tensor on the first piece's device."""
    import torch

    if described is None:
        return None
    shape, buffers = described
    parts = [wrap_buffer(*b) for b in buffers]
    raw = parts[0] if len(parts) == 1 else torch.cat([p.to(parts[0].device) for p in parts])
    return raw.view(dtype).view(shape)


#: "0" turns off the direct route (``DirectRoute``): every execution goes through torch's copies
DIRECT_ROUTE_ENV = "KKDEPLOY_DIRECT_ROUTE"
#: "0": the C++ half never serves an execution by itself (the native route); Python's routes take every one
NATIVE_ROUTE_ENV = "KKDEPLOY_NATIVE_ROUTE"


class DirectRoute:
    """A CUDA instance's executions whose inputs all lie in host memory, one buffer each, bound for a bucket whose
    engine is a captured graph serving every mask (``BucketEngine.static``), and whose answers go to host memory.

    Why: outside the server a batch-1 execution spent 66 us gathering (Python wrapping Triton's two buffers as
    tensors 19 us, each pageable copy 12 us and a host wait), 111 us in the engine and 34 us responding (a copy and a
    second wait), on an H100 (docs/serving.md). Here no tensor is made for a request: each request's bytes are
    ``memmove``d into the bucket's pinned staging, cross to the graph's own input buffers in one asynchronous copy
    each (padding rows zeroed and masked out on the device), the graph replays, the answer comes back in one
    asynchronous copy into the bucket's pinned answer buffer, and the host waits for the GPU once. The bytes are
    those ``BucketEngine.run`` writes and reads (the tests compare the two routes); anything else (a request in
    pieces or in GPU memory, a bucket without a capture, GPU answers, more rows than a run holds) takes that route.
    The engine stage's clock (``ran``) stops after the one wait, so it includes the answer's copy to the host."""

    def __init__(self, engine, driver):
        self.engine, self.driver = engine, driver
        self.seq = engine.row_shape[0]
        self.x_row = engine.dtype.itemsize * math.prod(engine.row_shape)
        self.stream = 0  # the instance's stream handle, set on its thread (``Instance._enter_thread``)

    def rows(self, requests: list) -> list[int] | None:
        """Each request's row count, or None where any request is not for this route (the other route answers,
        errors included)."""
        rows, seq, x_row, row_shape = [], self.seq, self.x_row, self.engine.row_shape
        for described in requests:
            if described is None or described[0] is None:
                return None
            (shape, buffers), mask = described[0], described[1]
            if len(buffers) != 1 or buffers[0][2] == MEMORY_GPU or len(shape) != 1 + len(row_shape):
                return None
            k = int(shape[0])
            if list(shape[1:]) != row_shape or buffers[0][1] != k * x_row:
                return None
            if mask is not None:
                mshape, mbuffers = mask
                if (len(mbuffers) != 1 or mbuffers[0][2] == MEMORY_GPU or list(mshape) != [k, seq]
                        or mbuffers[0][1] != k * seq):
                    return None
            rows.append(k)
        return rows

    def execute(self, requests: list, start: int):
        """``(outcomes, kept, runs)`` as ``Instance.execute`` makes them, or None: not for this route."""
        engine = self.engine
        rows = self.rows(requests)
        if rows is None:
            return None
        n = sum(rows)
        if n == 0 or n > engine.max_batch:
            return None
        size = engine.runner.bucket_for(n)
        static = engine.static.get(size)
        if static is None:
            return None
        driver, stream, seq, x_row = self.driver, self.stream, self.seq, self.x_row
        stage_x, stage_mask = engine.staging(size)
        sx, smask = stage_x.data_ptr(), stage_mask.data_ptr()
        all_valid = all(r[1] is None for r in requests)
        row = 0
        for described, k in zip(requests, rows):
            ctypes.memmove(sx + row * x_row, described[0][1][0][0], k * x_row)
            if not all_valid:
                if described[1] is None:
                    ctypes.memset(smask + row * seq, 1, k * seq)
                else:
                    ctypes.memmove(smask + row * seq, described[1][1][0][0], k * seq)
            row += k
        x, mask = static.x.data_ptr(), static.mask.data_ptr()
        driver.to_device(x, sx, n * x_row, stream)
        driver.fill(x + n * x_row, 0, (size - n) * x_row, stream)  # padding rows: zeros, fully masked
        if engine.static_mask_stale(size, all_true=all_valid and n == size):
            if all_valid:
                driver.fill(mask, 1, n * seq, stream)
            else:
                driver.to_device(mask, smask, n * seq, stream)
            driver.fill(mask + n * seq, 0, (size - n) * seq, stream)
        gathered = time.perf_counter_ns()
        with engine.inference_mode():
            y = static.run()
        if not y.is_contiguous():
            y = y.contiguous()
        host = engine.host_output(size, y)
        y_row = y[0].numel() * y.element_size()
        driver.to_host(host.data_ptr(), y.data_ptr(), n * y_row, stream)
        driver.wait(stream)
        ran = time.perf_counter_ns()
        outcomes, kept, base, row = [], {}, host.data_ptr(), 0
        answer_shape = tuple(y.shape[1:])
        for i, k in enumerate(rows):
            outcomes.append(((k, *answer_shape), base + row * y_row, k * y_row, True))
            kept[i] = host[row:row + k]
            row += k
        return outcomes, kept, [(gathered - start, ran - gathered, time.perf_counter_ns() - ran, size, n)]


def error_code(exc: BaseException) -> int:
    """A caller's mistake (a KKError or ValueError from the engine) is INVALID_ARG (HTTP 400), anything else
    INTERNAL (500), as in the Python backend's model."""
    from ..errors import KKError

    return ERROR_INVALID_ARG if isinstance(exc, (KKError, ValueError)) else ERROR_INTERNAL


class Model:
    """One Triton model served in-process: its config, and the instances Triton asks for."""

    def __init__(self, config_json: str, repository: str, version: int):
        config = json.loads(config_json)
        self.config = config
        self.name = config["name"]
        self.version_dir = os.path.join(repository, str(version))
        x = next(i for i in config["input"] if i["name"] == INPUT_X)
        y = next(o for o in config["output"] if o["name"] == OUTPUT_Y)
        self.row_shape = [int(d) for d in x["dims"]]
        try:
            self.x_dtype, _ = torch_dtype(x["data_type"]), torch_dtype(y["data_type"])
        except KeyError as exc:
            raise ValueError(f"{self.name}: data type {exc} is not one kkdeploy serves (FP32, FP16, BF16)") from None
        self.output_datatype = y["data_type"].removeprefix("TYPE_")  # read by the C++ half: "FP16", ...
        self.max_batch = int(config["max_batch_size"])

    def instance(self, name: str, kind: str, device_id: int) -> "Instance":
        return Instance(self, name, kind, device_id)


class Instance:
    """One model instance: a ``BucketEngine`` on its device, and the answers of its last execution."""

    def __init__(self, model: Model, name: str, kind: str, device_id: int):
        import torch

        self.model, self.name = model, name
        wanted = host_wait_wanted()
        config = model.config
        device = "cpu"
        if parameter(config, DEVICE_TYPE, "cpu") == "cuda":
            device = f"cuda:{int(device_id) if kind == 'GPU' else 0}"
        self.engine = BucketEngine(
            model.name, os.path.join(model.version_dir, parameter(config, ARTIFACTS, "artifacts")), device,
            model.row_shape, model.x_dtype, model.max_batch,
            gpu_outputs=gpu_outputs_wanted(config), canary_file=parameter(config, CANARY_FILE))
        self.x_dtype, self.mask_dtype = model.x_dtype, torch.bool
        # Instances are threads of one process here, sharing one CUDA context: each runs on a stream of its own, so
        # one instance's engine can run on the GPU while another's Python gathers (the Python backend's instances
        # are processes whose contexts take turns on the GPU). Every run ends with its stream synchronized.
        self.stream = torch.cuda.Stream(self.engine.device) if self.engine.cuda else None
        self.direct = None
        if self.engine.cuda and self.engine.static and not self.engine.gpu_outputs \
                and os.environ.get(DIRECT_ROUTE_ENV, "1") != "0":
            from .cuda_driver import Driver

            self.direct = DirectRoute(self.engine, Driver())
        self.native = self._native_plan() if self.direct is not None else None
        self.released = release_marker(parameter(config, RELEASE_DIR), model.name, os.getpid())
        self.last: dict = {}  # request index -> its answer, from the last execution: alive until the next one
        self.engine_thread = None
        waits = ""
        if self.engine.cuda:
            found = cuda_sync_mode()
            if wanted == "leave":
                waits = f", host waits for the GPU: {found}"
            else:  # the server's context, shared by every instance: the last instance made sets it again, the same
                waits = f", host waits for the GPU: {found}, set to {set_cuda_sync_mode(wanted)} ({HOST_WAIT_ENV})"
            waits += (", native route (C++), direct route" if self.native is not None else
                      ", direct route" if self.direct is not None else ", torch copies")
        print(f"{model.name} ({name}): in-process on {device} (Python {sys.version.split()[0]}, {sys.executable}"
              f"{waits}), buckets {self.engine.described}; {self.engine.runner.reason}", file=sys.stderr, flush=True)

    def _native_plan(self):
        """What the C++ half needs to take ``DirectRoute``'s steps by itself, without the GIL (the native route), or
        None: ``(stream, seq, x row bytes, y row bytes, x row shape, y row shape, buckets)``, each bucket ``(size, x,
        mask, y, staging x, staging mask, host y, graph exec)`` as addresses, every bucket listed smallest first
        (the route picks the smallest that holds a run, as ``bucket_for`` does) and ``graph exec`` 0 for one without
        a capture it can launch (its runs stay with Python). The buffers are made here, once, and are the ones
        ``DirectRoute`` uses, so the two routes stay interchangeable; the capture's mask is then written every run
        (``BucketEngine.static_mask_shared``), as neither route sees what the other left there."""
        if os.environ.get(NATIVE_ROUTE_ENV, "1") == "0":
            return None
        engine, buckets, y_row, answer = self.engine, [], None, None
        for size in engine.runner.sizes:
            static = engine.static.get(size)
            graph_exec = static.graph_exec() if static is not None else 0
            y = static.y if static is not None else None
            if not graph_exec or y is None or not y.is_contiguous() or list(static.x.shape[1:]) != engine.row_shape:
                buckets.append((size, 0, 0, 0, 0, 0, 0, 0))
                continue
            stage_x, stage_mask = engine.staging(size)
            host = engine.host_output(size, y)
            y_row, answer = y[0].numel() * y.element_size(), tuple(y.shape[1:])
            buckets.append((size, static.x.data_ptr(), static.mask.data_ptr(), y.data_ptr(), stage_x.data_ptr(),
                            stage_mask.data_ptr(), host.data_ptr(), graph_exec))
        if y_row is None:
            return None
        engine.static_mask_shared = True
        return (self.stream.cuda_stream, self.direct.seq, self.direct.x_row, y_row, tuple(engine.row_shape), answer,
                buckets)

    def native_plan(self):
        """The C++ half asks once, after the instance is made (``_native_plan``)."""
        return self.native

    def native_refused(self, why: str) -> None:
        """The C++ half cannot take the plan (no CUDA driver library, say): Python's routes serve every execution,
        and the capture's mask is again Python's alone."""
        self.native = None
        self.engine.static_mask_shared = False
        print(f"{self.model.name} ({self.name}): no native route: {why}", file=sys.stderr, flush=True)

    def enter_thread(self) -> None:
        """The C++ half calls this on the execution thread before its first native run there (the device and stream,
        as Python's routes set them on their first run)."""
        if self.engine_thread != threading.get_ident():
            self._enter_thread()

    def execute(self, requests: list) -> tuple[list, list]:
        """``(outcomes, runs)`` for one execution (see the module docstring)."""
        start = time.perf_counter_ns()
        if self.engine_thread != threading.get_ident():
            self._enter_thread()
        if self.direct is not None:
            try:
                done = self.direct.execute(requests, start)
            except Exception as exc:  # noqa: BLE001 - a failed copy or replay: every caller gets the error
                message = f"{self.model.name}: {type(exc).__name__}: {exc}"
                self.last = {}
                return [(error_code(exc), message) for _ in requests], []
            if done is not None:
                outcomes, self.last, runs = done
                return outcomes, runs
        outcomes: list = [None] * len(requests)
        xs, masks, index = [], [], []
        for i, described in enumerate(requests):
            if described is None:  # the C++ half already has this request's error
                outcomes[i] = (ERROR_INTERNAL, "input refused")
                continue
            try:
                x, mask = input_tensor(described[0], self.x_dtype), input_tensor(described[1], self.mask_dtype)
                if x is None:  # Triton checks required inputs first; kept from the engine all the same
                    raise ValueError(f"the request has no input {INPUT_X!r}")
            except Exception as exc:  # noqa: BLE001 - one malformed request must not fail the others
                outcomes[i] = (error_code(exc), f"{self.model.name}: {type(exc).__name__}: {exc}")
                continue
            xs.append(x)
            masks.append(mask)
            index.append(i)
        runs, kept = [], {}
        if not xs:  # every request refused or malformed: nothing to run
            self.last = kept
            return outcomes, runs
        for group in self.engine.groups([x.shape[0] for x in xs]):
            try:
                # on the instance's stream: current on its thread (_enter_thread)
                outputs, size, n, gathered, ran = self.engine.run([xs[k] for k in group], [masks[k] for k in group])
                for k, y in zip(group, outputs):
                    y = y if y.is_contiguous() else y.contiguous()
                    kept[index[k]] = y
                    outcomes[index[k]] = (tuple(y.shape), y.data_ptr(), y.numel() * y.element_size(),
                                          y.device.type == "cpu")
                runs.append((gathered - start, ran - gathered, time.perf_counter_ns() - ran, size, n))
            except Exception as exc:  # noqa: BLE001 - the engine's error goes back to each caller
                for k in group:
                    outcomes[index[k]] = (error_code(exc), f"{self.model.name}: {type(exc).__name__}: {exc}")
            start = time.perf_counter_ns()
        self.last = kept
        return outcomes, runs

    def _enter_thread(self) -> None:
        """Triton runs an instance's executions on a thread of its own. There, torch's CPU ops with an OpenMP pool
        of more than one thread are several times slower than on a main thread (measured on this project's 2-core
        CPU machine, the same CPU artifact: 0.32 ms a call on the main thread, 1.67 ms on another thread, 0.29 ms
        there with one thread). The thread count is per calling thread in OpenMP, so a CPU engine's thread runs
        one; scale out with instances. A CUDA engine's host side is launches and copies: its threads are left as they
        are."""
        import torch

        self.engine_thread = threading.get_ident()
        if self.engine.cuda:  # the current device and stream are per thread too: the instance's GPU and stream, set
            torch.cuda.set_device(self.engine.device)  # once here, not entered and left every run (5 us a run)
            torch.cuda.set_stream(self.stream)
            if self.direct is not None:
                self.direct.stream = self.stream.cuda_stream
        else:
            torch.set_num_threads(1)

    def copy_out(self, targets: list) -> None:
        """Copy answers into response buffers that involve GPU memory (the C++ half copies host to host, and the native
    route's answers into buffers on its GPU)."""
        import torch

        gpu = False
        for request, pointer, nbytes, memory_type, memory_id in targets:
            source = self.last[request]
            destination = wrap_buffer(pointer, nbytes, memory_type, memory_id)
            destination.copy_(source.reshape(-1).view(torch.uint8), non_blocking=False)
            gpu = gpu or memory_type == MEMORY_GPU or source.device.type == "cuda"
        if gpu:  # the copies ran on this thread's current stream; the response is sent once they are done
            torch.cuda.current_stream().synchronize()

    def finalize(self) -> None:
        """Triton unloads this instance: every request it held is answered. Leave the release marker."""
        self.last = {}
        leave_release_marker(self.released)
