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
  side): ``(request index, pointer, bytes, memory type, memory type id)``;
* ``instance.finalize()`` when Triton unloads the instance (the release marker ``kkdeploy serve`` waits for).

The batching, padding and answers are the Python backend's one-hop model's (``triton_model.BucketEngine``), so the
two backends cannot differ in what they compute; the serving tests check both bit for bit.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
import threading
import time

from .triton_model import (ARTIFACTS, CANARY_FILE, DEVICE_TYPE, INPUT_X, OUTPUT_Y, RELEASE_DIR, BucketEngine,
                           gpu_outputs_wanted, leave_release_marker, parameter, release_marker, torch_dtype)

# TRITONSERVER_Error_Code and TRITONSERVER_MemoryType (triton/core/tritonserver.h)
ERROR_INTERNAL, ERROR_INVALID_ARG = 1, 3
MEMORY_CPU, MEMORY_CPU_PINNED, MEMORY_GPU = 0, 1, 2


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
        self.on_stream = torch.cuda.stream(torch.cuda.Stream(self.engine.device)) if self.engine.cuda else None
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
        print(f"{model.name} ({name}): in-process on {device} (Python {sys.version.split()[0]}, {sys.executable}"
              f"{waits}), buckets {self.engine.described}; {self.engine.runner.reason}", file=sys.stderr, flush=True)

    def execute(self, requests: list) -> tuple[list, list]:
        """``(outcomes, runs)`` for one execution (see the module docstring)."""
        start = time.perf_counter_ns()
        if self.engine_thread != threading.get_ident():
            self._enter_thread()
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
                outputs, size, n, gathered, ran = self._run([xs[k] for k in group], [masks[k] for k in group])
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

    def _run(self, xs, masks):
        if self.on_stream is None:
            return self.engine.run(xs, masks)
        with self.on_stream:  # the instance's stream context, made once (re-entered every run)
            return self.engine.run(xs, masks)

    def _enter_thread(self) -> None:
        """Triton runs an instance's executions on a thread of its own. There, torch's CPU ops with an OpenMP pool
        of more than one thread are several times slower than on a main thread (measured on this project's 2-core
        CPU machine, the same CPU artifact: 0.32 ms a call on the main thread, 1.67 ms on another thread, 0.29 ms
        there with one thread). The thread count is per calling thread in OpenMP, so a CPU engine's thread runs
        one; scale out with instances. A CUDA engine's host side is launches and copies: its threads are left as they
        are."""
        import torch

        self.engine_thread = threading.get_ident()
        if self.engine.cuda:  # the current device is per thread too: the instance's GPU, not device 0
            torch.cuda.set_device(self.engine.device)
        else:
            torch.set_num_threads(1)

    def copy_out(self, targets: list) -> None:
        """Copy answers into response buffers that involve GPU memory (the C++ half copies host to host)."""
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
