"""`kkdeploy loadtest`: a load generator that is not the bottleneck, and that checks every answer bit for bit.

Why our own. Triton's ``perf_analyzer`` is the reference load generator, but it cannot be installed here: the
``perf-analyzer`` name on PyPI resolves on these machines to a 2 KB placeholder (0.1.0, a ``hello()`` function),
the tritonclient wheels stopped shipping the binary, and the real one comes only in NVIDIA's SDK container or
from a C++ build that fetches its dependencies from GitHub. ``perf_analyzer_command`` prints the equivalent
command for a machine that has it. And perf_analyzer does not check answers, which is half of this tool's job.

How. Clients run in ``processes`` spawned processes (gRPC and forks do not mix; one GIL per process), each with
threads, each thread with its own client (gRPC requests are serialized once per payload, ``LeanGrpc``, and sent by
grpcio or, ``client="native"``, by our HTTP/2 client in C++, ``native_client``, whose empty call costs a third of
grpcio's):

* closed loop: ``concurrency`` clients in all, each sending its next request when the last one is answered;
* open loop: ``rate`` requests per second in all, scheduled in advance (evenly or Poisson), sent by a pool of
  ``concurrency`` senders; latency counts from the scheduled time, so a server that falls behind cannot hide it.

Requests come from a pool of ``pool`` payloads made from ``seed`` (batch sizes from ``mix``, padding ratios
from ``padding``; ratio 0 sends no mask). Before the load, the direct engine (``kkdeploy.load`` on the same
artifacts, in this process) computes each payload's answer at every batch bucket that could hold it (the server
runs a request inside whichever bucket its gathered batch needed, and each bucket is its own validated engine);
every response's bytes are hashed (XXH3-128, ``fingerprint``) and must equal one of those answers exactly. Triton's
own queue and compute times, and kkdeploy's per-stage times (``triton_model``), are read from ``/metrics`` before and
after.
"""

from __future__ import annotations

import faulthandler
import hashlib
import importlib
import itertools
import math
import multiprocessing as mp
import queue
import random
import re
import threading
import time
import urllib.request
from dataclasses import asdict, dataclass, field

import numpy as np

from ..errors import KKError

NUMPY_DTYPES = {"float32": np.float32, "float16": np.float16}
TRITON_NAMES = {"float32": "FP32", "float16": "FP16"}
PROTOCOLS = ("grpc", "http")
SHARED_MEMORY = ("none", "system", "cuda")
CLIENTS = ("lean", "native", "tritonclient")
MODEL_INFER = "/inference.GRPCInferenceService/ModelInfer"  # Triton's gRPC inference method
SERVER_LIVE = "/inference.GRPCInferenceService/ServerLive"  # its cheapest call: no model, no payload


@dataclass
class LoadPlan:
    """One load: who is called, how hard, with what. ``requests`` or ``duration_s`` bounds it (both: first hit)."""

    model: str
    seq_len: int
    d_model: int
    dtype: str
    host: str = "127.0.0.1"
    http_port: int = 8000
    grpc_port: int = 8001
    metrics_port: int = 8002
    protocol: str = "grpc"
    processes: int = 2
    concurrency: int = 2
    rate: float | None = None  # open loop: requests per second in all
    arrival: str = "uniform"  # uniform | poisson (open loop)
    requests: int | None = 1000
    duration_s: float | None = None
    warmup: int = 5  # requests per client before the clock starts (not counted, still checked)
    mix: list = field(default_factory=lambda: [[1, 1.0]])  # [[batch size, weight], ...]
    padding: list = field(default_factory=lambda: [0.0])  # padding ratios, taken in turn through the pool
    pool: int = 64
    seed: int = 1234
    shared_memory: str = "none"
    #: with shared memory: the pool's payloads are written into each client's input region once, before the load, up
    #: to this many MB a client (beyond it, each request writes its payload, inside the clock)
    preload_mb: float = 1024.0
    timeout_s: float = 60.0
    client: str = "lean"  # gRPC: requests serialized once per payload (LeanGrpc); native: sent without grpcio

    def check(self) -> None:
        if self.protocol not in PROTOCOLS:
            raise KKError(f"--protocol must be one of {', '.join(PROTOCOLS)}, got {self.protocol!r}")
        if self.client not in CLIENTS:
            raise KKError(f"--client must be one of {', '.join(CLIENTS)}, got {self.client!r}")
        if self.client == "native" and self.protocol != "grpc":
            raise KKError("--client native speaks gRPC only: add --protocol grpc, or use --client lean over HTTP")
        if self.shared_memory not in SHARED_MEMORY:
            raise KKError(f"--shared-memory must be one of {', '.join(SHARED_MEMORY)}, got {self.shared_memory!r}")
        if self.processes < 1 or self.concurrency < self.processes:
            raise KKError(f"--concurrency ({self.concurrency}) must be at least --processes ({self.processes}), "
                          f"which must be at least 1")
        if self.rate is not None and self.rate <= 0:
            raise KKError(f"--rate must be positive, got {self.rate}")
        if self.requests is None and self.duration_s is None:
            raise KKError("give --requests N or --duration S (or both: the first reached ends the load)")
        if self.requests is not None and self.requests < self.concurrency:
            raise KKError(f"--requests ({self.requests}) must be at least --concurrency ({self.concurrency})")
        if self.pool < 1:
            raise KKError(f"--pool must be at least 1, got {self.pool}")
        if self.dtype not in NUMPY_DTYPES:
            raise KKError(f"dtype {self.dtype} cannot be sent; the artifacts must be float32 or float16")
        if not self.mix or any(int(n) < 1 or float(w) <= 0 for n, w in self.mix):
            raise KKError(f"--mix needs batch sizes >= 1 with positive weights, such as 1:0.7,2:0.2,4:0.1; "
                          f"got {self.mix}")
        if any(not 0 <= float(p) < 1 for p in self.padding):
            raise KKError(f"--padding ratios must be in [0, 1), got {self.padding}")
        if self.arrival not in ("uniform", "poisson"):
            raise KKError(f"--arrival must be uniform or poisson, got {self.arrival!r}")
        if self.preload_mb < 0:
            raise KKError(f"--shm-preload-mb must be 0 or more, got {self.preload_mb}")

    @property
    def loop(self) -> str:
        return "open" if self.rate else "closed"


def parse_mix(text: str) -> list:
    """``"1:0.7,2:0.2,4"`` -> ``[[1, 0.7], [2, 0.2], [4, 1.0]]``."""
    mix = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        size, _, weight = part.partition(":")
        try:
            mix.append([int(size), float(weight) if weight else 1.0])
        except ValueError:
            raise KKError(f"--mix takes batch:weight pairs such as 1:0.7,2:0.2,4:0.1; got {text!r}") from None
    if not mix:
        raise KKError(f"--mix takes batch:weight pairs such as 1:0.7,2:0.2,4:0.1; got {text!r}")
    return mix


def parse_ratios(text: str) -> list:
    try:
        return [float(v) for v in text.split(",") if v.strip()] or [0.0]
    except ValueError:
        raise KKError(f"--padding takes ratios separated by commas, such as 0,0.25; got {text!r}") from None


# -- the payloads -------------------------------------------------------------------------------------------------
def make_pool(plan: LoadPlan) -> list[tuple[np.ndarray, np.ndarray | None]]:
    """``plan.pool`` payloads ``(x [n,S,D], mask [n,S] or None)``, the same in every process for one seed."""
    rng = np.random.default_rng(plan.seed)
    sizes = [int(n) for n, _ in plan.mix]
    weights = np.array([float(w) for _, w in plan.mix])
    dtype = NUMPY_DTYPES[plan.dtype]
    pool = []
    for i in range(plan.pool):
        n = sizes[int(rng.choice(len(sizes), p=weights / weights.sum()))]
        ratio = float(plan.padding[i % len(plan.padding)])
        x = rng.standard_normal((n, plan.seq_len, plan.d_model), dtype=np.float32).astype(dtype)
        mask = None
        if ratio > 0:
            min_valid = max(1, round(plan.seq_len * (1 - ratio)))
            lengths = rng.integers(min_valid, plan.seq_len + 1, size=n)
            mask = np.arange(plan.seq_len)[None, :] < lengths[:, None]
            x[~mask] = 0
        pool.append((x, mask))
    return pool


def runner_device(runner):
    """(device, dtype) a loaded runner computes on: its fallback model's, which every engine shares."""
    first = next(iter(runner.buckets.values()))
    parameter = next(first.fallback.parameters())
    return parameter.device, parameter.dtype


def payload_hint(plan: LoadPlan) -> str:
    """For requests of megabytes sent inside gRPC or HTTP: that shared memory moves them instead, and what it gave.
    Triton's frontend parses each request's bytes and copies each answer into a new buffer; a batch-64
    shape-13 request is 16 MB each way."""
    if plan.shared_memory != "none":
        return ""
    rows = max(n for n, _ in plan.mix)
    itemsize = np.dtype(NUMPY_DTYPES.get(plan.dtype, np.float32)).itemsize
    nbytes = rows * plan.seq_len * (plan.d_model * itemsize + 1)
    if nbytes < 4 << 20:
        return ""
    return (f"hint: a {rows}-sequence request carries {nbytes / (1 << 20):.1f} MB each way inside {plan.protocol}; "
            f"--shared-memory system moves it through a shared region instead (shape 13 at batch 64: 2.1-2.7x the "
            f"seq/s, up to 99.5% of the engine with 4 instances; H100, docs/serving.md)")


def digest(data: bytes) -> str:
    """blake2b-128: the watchdog's canary answer, pinned by the server's model as ``triton_model.tensor_digest``."""
    return hashlib.blake2b(data, digest_size=16).hexdigest()


_xxh3_128 = None


def fingerprint(data) -> str:
    """XXH3-128 of an answer's bytes (any buffer): what the load generator compares, every response against the
    direct engine's answers. Two different answers share it by chance with probability 2^-128, as with blake2b-128,
    which it replaced because it runs 26 times faster (0.8 against 21 ms for a 16 MB shape-13 batch on this 2-core
    machine): at saturation the check was the clients' largest cost."""
    global _xxh3_128
    if _xxh3_128 is None:
        try:
            import xxhash
        except ImportError:
            raise KKError("kkdeploy loadtest needs xxhash to check answers: pip install 'kkdeploy[serve]' "
                          "(or xxhash)") from None
        _xxh3_128 = xxhash.xxh3_128_hexdigest
    return _xxh3_128(data)


def fingerprint_array(array: np.ndarray) -> str:
    """``fingerprint(array.tobytes())`` without the copy."""
    return fingerprint(memoryview(np.ascontiguousarray(array)).cast("B"))


def _varint(data: memoryview, at: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[at]
        at += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, at
        shift += 7


def raw_output_contents(response) -> list[memoryview]:
    """The ``raw_output_contents`` of a serialized ``ModelInferResponse`` (field 6), as views of ``response``: the
    answer's bytes without parsing the message, which copies them (3 ms for a 16 MB answer). Reads the top-level
    fields' wire format only; anything else there is skipped by its wire type."""
    data, found = memoryview(response).cast("B"), []
    try:
        _read_fields(data, found)
    except IndexError:
        raise RuntimeError("the response is not a ModelInferResponse: it ends inside a field") from None
    return found


def _read_fields(data: memoryview, found: list) -> None:
    """``raw_output_contents``' walk over the fields; IndexError where the bytes end inside one."""
    at, end = 0, len(data)
    while at < end:
        key, at = _varint(data, at)
        kind = key & 7
        if kind == 0:
            _, at = _varint(data, at)
        elif kind == 1:
            at += 8
        elif kind == 5:
            at += 4
        elif kind == 2:
            size, at = _varint(data, at)
            if key >> 3 == 6:
                found.append(data[at:at + size])
            at += size
        else:
            raise RuntimeError(f"the response is not a ModelInferResponse: wire type {kind} at byte {at}")
        if at > end:
            raise IndexError(at)


def expected_answers(runner, pool, device=None) -> list[dict[int, tuple[str, ...]]]:
    """For each payload, ``{bucket: digests}``: the direct engine's answers at every bucket that holds it, in each
    layout the server may give it. The payload's rows come first, then either padding rows (zero, fully masked), or,
    for a payload without padding, valid rows of other requests: a bucket filled with valid rows only takes the
    engine's all-valid route, which may run other kernels than the padded one (each route was validated on its own;
    the PyTorch fallback on the CPU answers the two in different bits). Match a response with ``answered_by``."""
    import torch

    from ..pipeline.runtime import bucketed

    runner = bucketed(runner)
    device, dtype = runner_device(runner)

    def answer(size: int, xb, mb, n: int) -> str:
        return fingerprint_array(runner.run_bucket(size, xb, mb)[:n].detach().cpu().numpy())

    answers = []
    with torch.inference_mode():
        for x, mask in pool:
            n = x.shape[0]
            xt = torch.from_numpy(x).to(device=device, dtype=dtype)
            found = {}
            for size in runner.sizes:
                if size < n:
                    continue
                xb = torch.zeros((size, *x.shape[1:]), dtype=dtype, device=device)
                xb[:n] = xt
                mb = torch.zeros((size, x.shape[1]), dtype=torch.bool, device=device)
                mb[:n] = True if mask is None else torch.from_numpy(mask).to(device)
                digests = [answer(size, xb, mb, n)]
                if size > n and bool(mb[:n].all()):  # gathered with other valid rows: the all-valid route
                    full = xt.repeat(-(-size // n), *([1] * (xt.dim() - 1)))[:size]
                    digests.append(answer(size, full, torch.ones_like(mb), n))
                found[size] = tuple(dict.fromkeys(digests))
            answers.append(found)
    return answers


def answered_by(found: dict[int, tuple[str, ...]], got: str | None) -> int | None:
    """The bucket whose answer ``got`` (a response's digest) is, from ``expected_answers``; None: a wrong answer."""
    return next((bucket for bucket, digests in found.items() if got in digests), None)


# -- one client thread --------------------------------------------------------------------------------------------
class LeanGrpc:
    """Triton's gRPC inference call with the protobuf work done ahead, as perf_analyzer prepares its requests once:
    each payload's ``ModelInferRequest`` is serialized once per process, and a call sends those bytes and returns
    the response's bytes (grpcio's C core both ways, no Python message objects). The answer is parsed, after the
    request's clock has stopped, only to be checked. tritonclient's ``infer()`` builds and parses the messages in
    Python on every call, which is the load generator's time on a small request, not the server's.

    With ``shm`` (a client's registered regions) the request names the regions instead of carrying the bytes, as
    tritonclient's ``set_shared_memory`` writes it, and sends a request of a few hundred bytes: the payload lies in the
    input region, written there before the load (``_SharedMemory``, as perf_analyzer writes its shared-memory inputs
    once) or, for a pool past ``preload_mb``, by the call itself (inside the clock: the client's own copy); the answer
    is read from the output region, after the clock, for the check. The request then depends on the client's
    regions, so it is cached per client, not per process.

    ``native``: the same bytes sent by our HTTP/2 client in C++ (``native_client``) instead of grpcio."""

    def __init__(self, plan: LoadPlan, pool, cache: dict, shm: "_SharedMemory | None" = None, native: bool = False):
        from tritonclient.grpc import service_pb2

        self.plan, self.pool, self.cache, self.pb, self.shm = plan, pool, cache, service_pb2, shm
        self.rpc, self.channel = unary_call(plan, MODEL_INFER, native)

    def request(self, index: int) -> bytes:
        key = ("lean", index) if self.shm is None else ("lean", self.shm.name, index)
        found = self.cache.get(key)
        if found is None:
            x, mask = self.pool[index]
            message = self.pb.ModelInferRequest(model_name=self.plan.model)
            tensors = [("x", TRITON_NAMES[self.plan.dtype], x)] + ([] if mask is None else
                                                                    [("valid_token_mask", "BOOL", mask)])
            offset = 0
            for name, datatype, array in tensors:
                tensor = message.inputs.add(name=name, datatype=datatype)
                tensor.shape.extend(array.shape)
                if self.shm is None:
                    message.raw_input_contents.append(np.ascontiguousarray(array).tobytes())
                else:
                    _shm_parameters(tensor, self.shm.input_region, array.nbytes, self.shm.input_offset(index) + offset)
                    offset += array.nbytes
            output = message.outputs.add(name="y")
            if self.shm is not None:
                _shm_parameters(output, self.shm.output_region, x.nbytes, 0)
            found = self.cache[key] = message.SerializeToString()
        return found

    def call(self, index: int):
        """The response's bytes; with shared memory ``(index, response bytes)``, the answer being in the region."""
        request = self.request(index)
        if self.shm is not None:
            self.shm.write(index)
        answer = self.rpc(request, self.plan.timeout_s)
        return answer if self.shm is None else (index, answer)

    def digest(self, answer) -> str:
        if self.shm is not None:
            index, answer = answer
            response = self.pb.ModelInferResponse.FromString(answer)
            # Triton may keep an empty raw entry for an output it wrote to the region
            sent = sum(len(raw) for raw in response.raw_output_contents)
            if sent or [o.name for o in response.outputs] != ["y"]:
                raise RuntimeError(f"the response carries {sent} bytes of raw output and outputs "
                                   f"{[o.name for o in response.outputs]}, expected only y, in the region")
            return fingerprint_array(self.shm.read(index))
        raws = raw_output_contents(answer)
        if len(raws) != 1:
            raise RuntimeError(f"the response carries {len(raws)} raw outputs, expected 1")
        return fingerprint(raws[0])

    def close(self) -> None:
        self.channel.close()


def unary_call(plan: LoadPlan, method: str, native: bool):
    """``(call, channel)``: ``call(request bytes, timeout) -> answer`` on one connection to the plan's gRPC port,
    through our HTTP/2 client (``native``; the answer a view valid until the next call) or grpcio (bytes); a failure
    is a RuntimeError worded as tritonclient words it, ``[StatusCode.X] details``. ``channel.close()`` ends it."""
    if native:
        from .native_client import GrpcH2c

        channel = GrpcH2c(plan.host, plan.grpc_port)
        path = method.encode()
        return (lambda request, timeout: channel.unary(path, request, timeout, copy=False)), channel
    import grpc

    channel = grpc.insecure_channel(f"{plan.host}:{plan.grpc_port}", options=[
        ("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)])
    unary = channel.unary_unary(method)  # no (de)serializers: bytes in, bytes out

    def call(request: bytes, timeout: float) -> bytes:
        try:
            return unary(request, timeout=timeout)
        except grpc.RpcError as exc:
            raise RuntimeError(f"[{exc.code()}] {exc.details()}") from None

    return call, channel


def pick_client(asked: str, protocol: str) -> tuple[str, str]:
    """``(client, note)`` for a plan: ``auto`` is the native client over gRPC where it can run here, else grpcio's
    lean one (the note says why), and tritonclient's over HTTP either way; any other choice stands (``check`` judges
    it)."""
    if asked != "auto":
        return asked, ""
    if protocol != "grpc":
        return "lean", ""
    from .native_client import unavailable

    why = unavailable()
    return ("lean", f"gRPC client: lean (the native client cannot run here: {why})") if why else \
        ("native", "gRPC client: native (kkdeploy's HTTP/2 client in C++)")


def _shm_parameters(tensor, region: str, nbytes: int, offset: int) -> None:
    """A request tensor's shared-memory parameters, as tritonclient's ``set_shared_memory`` writes them."""
    tensor.parameters["shared_memory_region"].string_param = region
    tensor.parameters["shared_memory_byte_size"].int64_param = nbytes
    if offset:
        tensor.parameters["shared_memory_offset"].int64_param = offset


class Client:
    """One connection and, with shared memory, its own regions; ``send(payload_index) -> digest``."""

    def __init__(self, plan: LoadPlan, pool, inputs_cache: dict, tag: str):
        self.plan, self.pool, self.cache, self.tag = plan, pool, inputs_cache, tag
        self.lean = None
        self.shm = None
        lean = plan.protocol == "grpc" and plan.client in ("lean", "native")
        native = plan.client == "native"
        if lean and plan.shared_memory == "none":
            self.lean = LeanGrpc(plan, pool, inputs_cache, native=native)
            return
        # tritonclient sends the requests, or (lean with shared memory) registers the regions only
        self.lib = importlib.import_module(f"tritonclient.{plan.protocol}")
        if plan.protocol == "http":
            self.client = self.lib.InferenceServerClient(f"{plan.host}:{plan.http_port}", connection_timeout=10.0,
                                                         network_timeout=plan.timeout_s)
        else:
            self.client = self.lib.InferenceServerClient(f"{plan.host}:{plan.grpc_port}")
        # gRPC takes a per-call deadline; the HTTP client's is its network_timeout
        self.timeout = {"client_timeout": plan.timeout_s} if plan.protocol == "grpc" else {}
        if plan.shared_memory != "none":
            self.shm = _SharedMemory(self, plan, pool, tag)
        if lean:
            self.lean = LeanGrpc(plan, pool, inputs_cache, shm=self.shm, native=native)

    def inputs(self, index: int):
        """The request's inputs, built once per payload and process (they are only read while sending)."""
        found = self.cache.get(index)
        if found is None:
            x, mask = self.pool[index]
            found = [self.lib.InferInput("x", list(x.shape), TRITON_NAMES[self.plan.dtype])]
            found[0].set_data_from_numpy(x)
            if mask is not None:
                found.append(self.lib.InferInput("valid_token_mask", list(mask.shape), "BOOL"))
                found[1].set_data_from_numpy(mask)
            self.cache[index] = found
        return found

    def call(self, index: int):
        """One request; the answer (an array, in a shared-memory region valid until the next call; or, lean, the
        response's bytes), for ``digest`` once the clock has stopped."""
        if self.lean is not None:
            return self.lean.call(index)
        if self.shm is not None:
            return self.shm.call(index)
        return self.client.infer(self.plan.model, self.inputs(index), **self.timeout).as_numpy("y")

    def digest(self, answer) -> str:
        return self.lean.digest(answer) if self.lean is not None else fingerprint_array(answer)

    def send(self, index: int) -> str:
        """One request; the digest of its answer."""
        return self.digest(self.call(index))

    def close(self) -> None:
        if self.lean is not None:
            self.lean.close()
            if self.shm is None:
                return
        if self.shm is not None:
            self.shm.close()
        self.client.close()


def payload_arrays(payload) -> list:
    """A payload's arrays in the order a request's inputs lie in a shared-memory region: x, then its mask if any."""
    x, mask = payload
    return [x] if mask is None else [x, mask]


class PinnedReadback:
    """A CUDA answer read into one page-locked host buffer of the client's, reused from call to call.

    Why: tritonclient's ``get_contents_as_numpy`` allocates and zeroes a host buffer of the whole region on every
    call, copies into it from the device through pageable memory, and copies it once more into a fresh array: for
    a shape-13 batch of 64, three passes over 16 MB per request, on the client's threads. Here one copy lands in
    pinned memory and the answer is a view of it (valid until the client's next call, as the region's is). Opened
    only where cuda-python's runtime and the region's device address are there; else tritonclient reads it."""

    def __init__(self, cudart, pointer: int, nbytes: int, device: int):
        import ctypes

        self.cudart, self.pointer, self.device = cudart, pointer, device
        self.buffer = np.frombuffer((ctypes.c_char * nbytes).from_address(pointer), np.uint8)  # made once

    @staticmethod
    def _checked(result):
        """cuda-python's ``(error, value...)``: the value, or a one-line error."""
        err, *rest = result
        if int(err) != 0:
            raise KKError(f"CUDA error {int(err)} reading an answer from CUDA shared memory")
        return rest[0] if rest else None

    @classmethod
    def open(cls, region, nbytes: int) -> "PinnedReadback | None":
        """For tritonclient's CUDA ``region`` (its device address, ``_base_addr``), or None where it cannot be."""
        device = getattr(region, "_base_addr", None)
        if not isinstance(device, int):
            return None
        try:
            from cuda.bindings import runtime as cudart
        except ImportError:
            return None
        try:
            pointer = cls._checked(cudart.cudaMallocHost(max(1, nbytes)))
        except KKError:  # no pinned memory here: tritonclient's path still reads the answer
            return None
        return cls(cudart, int(pointer), max(1, nbytes), device)

    def read(self, nbytes: int, dtype, shape) -> np.ndarray:
        if nbytes > self.buffer.nbytes:
            raise KKError(f"an answer of {nbytes} bytes does not fit the client's {self.buffer.nbytes}-byte region")
        self._checked(self.cudart.cudaMemcpy(self.pointer, self.device, nbytes,
                                             self.cudart.cudaMemcpyKind.cudaMemcpyDeviceToHost))
        return self.buffer[:nbytes].view(dtype).reshape(shape)

    def close(self) -> None:
        self.buffer = None  # no view of freed memory stays reachable from here
        self._checked(self.cudart.cudaFreeHost(self.pointer))


CUDA_SETUP_LOCK = threading.Lock()  # a client process's threads create and fill their CUDA regions one at a time


class _SharedMemory:
    """Inputs and output through a system (POSIX) or CUDA shared-memory region registered with the server.

    The pool's payloads lie one after another in the input region, written once before the load
    (``preloaded``), as perf_analyzer writes its shared-memory inputs once: a request then only names its payload's
    offset, and the clock holds no copy of the client's. A pool of more than ``plan.preload_mb`` MB shares one slot
    instead, which each request writes before it is sent (``write``, inside the clock)."""

    def __init__(self, client: Client, plan: LoadPlan, pool, tag: str):
        self.client, self.plan, self.pool = client, plan, pool
        largest = max(x.shape[0] for x, _ in pool)
        item = np.dtype(NUMPY_DTYPES[plan.dtype]).itemsize
        self.x_bytes = largest * plan.seq_len * plan.d_model * item
        self.m_bytes = largest * plan.seq_len
        sizes = [sum(a.nbytes for a in payload_arrays(payload)) for payload in pool]
        self.preloaded = sum(sizes) <= plan.preload_mb * (1 << 20)
        self.offsets = [0, *itertools.accumulate(sizes)][:-1] if self.preloaded else [0] * len(pool)
        in_bytes = sum(sizes) if self.preloaded else self.x_bytes + self.m_bytes
        self.name = f"kkdeploy_lt_{tag}"
        if plan.shared_memory == "system":
            import tritonclient.utils.shared_memory as shm

            self.mod = shm
            self.inp = shm.create_shared_memory_region(f"{self.name}_in", f"/{self.name}_in", in_bytes)
            self.out = shm.create_shared_memory_region(f"{self.name}_out", f"/{self.name}_out", self.x_bytes)
            c = client.client
            c.register_system_shared_memory(f"{self.name}_in", f"/{self.name}_in", in_bytes)
            c.register_system_shared_memory(f"{self.name}_out", f"/{self.name}_out", self.x_bytes)
            if self.preloaded:  # every payload at its offset, in one write from the region's start
                shm.set_shared_memory_region(self.inp, self._payloads())
        else:
            try:
                import tritonclient.utils.cuda_shared_memory as shm
            except (ImportError, RuntimeError) as exc:
                raise KKError(f"--shared-memory cuda needs tritonclient's CUDA support (pip install "
                              f"'tritonclient[cuda]', which brings cuda-python): {exc}") from None
            self.mod = shm
            # tritonclient makes its one CUDA stream per device on its first copy, unguarded: a thread that loses the
            # race can be handed a stream the winner's replacement destroys. The first copy (the preload, or one
            # byte) is made under the lock, so the stream exists before any other copy of the process's threads.
            with CUDA_SETUP_LOCK:
                self.inp = shm.create_shared_memory_region(f"{self.name}_in", in_bytes, 0)
                self.out = shm.create_shared_memory_region(f"{self.name}_out", self.x_bytes, 0)
                if self.preloaded:
                    shm.set_shared_memory_region(self.inp, self._payloads())
                else:
                    shm.set_shared_memory_region(self.out, [np.zeros(1, np.uint8)])
            c = client.client
            c.register_cuda_shared_memory(f"{self.name}_in", shm.get_raw_handle(self.inp), 0, in_bytes)
            c.register_cuda_shared_memory(f"{self.name}_out", shm.get_raw_handle(self.out), 0, self.x_bytes)
        self.pinned = PinnedReadback.open(self.out, self.x_bytes) if plan.shared_memory == "cuda" else None

    def _payloads(self) -> list:
        """The pool's arrays in the order they lie in the input region (``offsets``)."""
        return [a for payload in self.pool for a in payload_arrays(payload)]

    @property
    def input_region(self) -> str:
        return f"{self.name}_in"

    @property
    def output_region(self) -> str:
        return f"{self.name}_out"

    def input_offset(self, index: int) -> int:
        """Where payload ``index``'s x starts in the input region (its mask follows it)."""
        return self.offsets[index]

    def write(self, index: int) -> None:
        """The payload's x, then its mask (if any), into the input region's one slot (nothing when preloaded)."""
        if not self.preloaded:
            self.mod.set_shared_memory_region(self.inp, payload_arrays(self.pool[index]))

    def read(self, index: int) -> np.ndarray:
        """The answer in the output region (valid until the next call)."""
        x, _ = self.pool[index]
        if self.pinned is not None:
            return self.pinned.read(x.nbytes, NUMPY_DTYPES[self.plan.dtype], x.shape)
        return self.mod.get_contents_as_numpy(self.out, NUMPY_DTYPES[self.plan.dtype], list(x.shape))

    def call(self, index: int) -> np.ndarray:
        x, mask = self.pool[index]
        lib = self.client.lib
        self.write(index)
        base = self.input_offset(index)
        inputs = [lib.InferInput("x", list(x.shape), TRITON_NAMES[self.plan.dtype])]
        inputs[0].set_shared_memory(self.input_region, x.nbytes, base)
        if mask is not None:
            inputs.append(lib.InferInput("valid_token_mask", list(mask.shape), "BOOL"))
            inputs[1].set_shared_memory(self.input_region, mask.nbytes, base + x.nbytes)
        output = lib.InferRequestedOutput("y")
        output.set_shared_memory(self.output_region, x.nbytes)
        self.client.client.infer(self.plan.model, inputs, outputs=[output], **self.client.timeout)
        return self.read(index)

    def close(self) -> None:
        c = self.client.client
        for region in (f"{self.name}_in", f"{self.name}_out"):
            try:
                (c.unregister_system_shared_memory if self.plan.shared_memory == "system"
                 else c.unregister_cuda_shared_memory)(region)
            except Exception:  # noqa: BLE001 - a stopped server forgot them anyway
                pass
        for handle in (self.inp, self.out):
            self.mod.destroy_shared_memory_region(handle)
        if self.pinned is not None:
            self.pinned.close()
            self.pinned = None


# -- one worker process -------------------------------------------------------------------------------------------
def _share(total: int, parts: int, index: int) -> int:
    return total // parts + (1 if index < total % parts else 0)


def worker_main(plan_dict: dict, index: int, ready, go, start_at, results) -> None:
    """A client process: each thread makes its own client (the HTTP client is gevent-based and must stay on the
    thread that made it) and warms up; the process reports ready, waits for ``go``, loads, and sends back its
    records ``(payload, sent_s, latency_s, digest or None, error or None)``."""
    plan = LoadPlan(**plan_dict)
    # A crash in a native library (gRPC, CUDA) prints this process's stacks; so does a start that outlasts the
    # parent's wait (``await_clients``), a little before the parent gives up on it.
    faulthandler.enable()
    faulthandler.dump_traceback_later(max(1.0, start_timeout_s(plan) - 5), exit=False)
    try:
        pool = make_pool(plan)
    except Exception as exc:  # noqa: BLE001 - reported as one line by the parent
        ready.put((index, _one_line(exc), []))
        return
    threads = _share(plan.concurrency, plan.processes, index)
    budget = None if plan.requests is None else _share(plan.requests, plan.processes, index)
    cache: dict = {}
    lock = threading.Lock()
    warm: list = []
    failures: list = []
    records: list = []
    warmed = threading.Barrier(threads + 1)
    tickets: queue.Queue = queue.Queue()

    def thread_main(i: int):
        client = None
        try:
            client = Client(plan, pool, cache, f"{index}_{i}_{random.getrandbits(32):08x}")
            pick = random.Random(plan.seed * 1_000_003 + index * 1000 + i)
            mine = [(k, client.send(k)) for k in (pick.randrange(len(pool)) for _ in range(plan.warmup))]
            with lock:
                warm.extend(mine)
        except Exception as exc:  # noqa: BLE001
            with lock:
                failures.append(_one_line(exc))
        warmed.wait()
        go.wait()
        if client is None or failures:
            return
        t0 = start_at.value  # set by the parent before ``go``
        deadline = None if plan.duration_s is None else t0 + plan.duration_s
        mine = []
        if plan.rate is None:
            count = None if budget is None else _share(budget, threads, i)
            while (count is None or len(mine) < count) and (deadline is None or time.time() < deadline):
                k = pick.randrange(len(pool))
                mine.append(_timed(client, k, time.time() - t0, time.perf_counter()))
        else:
            while True:
                ticket = tickets.get()
                if ticket is None:
                    break
                k, scheduled_s, scheduled_perf = ticket
                mine.append(_timed(client, k, scheduled_s, scheduled_perf))
        with lock:
            records.extend(mine)
        try:
            client.close()
        except Exception:  # noqa: BLE001
            pass

    workers = [threading.Thread(target=thread_main, args=(i,), daemon=True) for i in range(threads)]
    for w in workers:
        w.start()
    warmed.wait()
    faulthandler.cancel_dump_traceback_later()
    ready.put((index, failures[0] if failures else None, warm))
    go.wait()
    t0 = start_at.value
    deadline = None if plan.duration_s is None else t0 + plan.duration_s
    if plan.rate is not None and not failures:
        rate = plan.rate / plan.processes
        pick = random.Random(plan.seed * 31 + index)
        count = budget if budget is not None else math.inf
        base_perf = time.perf_counter() - (time.time() - t0)  # perf_counter at t0
        offset, i = 0.0, 0
        while i < count:
            offset += pick.expovariate(rate) if plan.arrival == "poisson" else (1.0 / rate if i else 0.0)
            if deadline is not None and t0 + offset >= deadline:
                break
            delay = base_perf + offset - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            tickets.put((pick.randrange(len(pool)), offset, base_perf + offset))
            i += 1
    for _ in workers:
        tickets.put(None)
    for w in workers:
        w.join()
    results.put((index, records))


def _timed(client: Client, k: int, sent_s: float, began_perf: float) -> tuple:
    """One request: its latency counts from ``began_perf`` (the send, or the scheduled time in an open loop) to
    the answer's arrival; hashing the answer for the check comes after the clock (75 us for a 64 KB answer on
    our CPU, which is the load generator's cost, not the server's)."""
    try:
        answer = client.call(k)
        latency = time.perf_counter() - began_perf
        return (k, sent_s, latency, client.digest(answer), None)
    except Exception as exc:  # noqa: BLE001 - counted, reported
        return (k, sent_s, time.perf_counter() - began_perf, None, _one_line(exc))


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


# -- metrics ------------------------------------------------------------------------------------------------------
_METRIC_LINE = re.compile(r"^(\w+)\{([^}]*)\} (\S+)$", re.M)


def read_metrics(url: str, model: str) -> dict[str, float]:
    """Triton's counters for ``model`` and kkdeploy's stage counters, keyed ``name`` or ``name{label}``."""
    try:
        with urllib.request.urlopen(url, timeout=10) as reply:
            text = reply.read().decode()
    except OSError as exc:
        raise KKError(f"cannot read {url}: {exc}; is the server running with metrics on that port?") from None
    found: dict[str, float] = {}
    for name, labels, value in _METRIC_LINE.findall(text):
        pairs = dict(re.findall(r'(\w+)="([^"]*)"', labels))
        if pairs.get("model") != model:
            continue
        extra = [f"{k}={v}" for k, v in sorted(pairs.items()) if k not in ("model", "version")]
        key = name + (f"{{{','.join(extra)}}}" if extra else "")
        try:
            found[key] = found.get(key, 0.0) + float(value)
        except ValueError:
            continue
    return found


def metrics_delta(before: dict, after: dict) -> dict:
    return {k: after[k] - before.get(k, 0.0) for k in after}


# -- the whole run ------------------------------------------------------------------------------------------------
def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


def reachable(plan: LoadPlan) -> None:
    """A one-line error at once when nothing listens where the clients would connect (gRPC would retry for a
    minute before saying so)."""
    import socket

    port = plan.grpc_port if plan.protocol == "grpc" else plan.http_port
    for name, number in ((plan.protocol, port), ("metrics", plan.metrics_port)):
        try:
            socket.create_connection((plan.host, number), timeout=3).close()
        except OSError as exc:
            raise KKError(f"nothing answers on {plan.host}:{number} ({name}: {exc.strerror or exc}); start "
                          f"`kkdeploy serve` there, pass its ports, or add --serve") from None


def rpc_floor_ms(plan: LoadPlan, calls: int = 300) -> float | None:
    """The median round trip of Triton's empty gRPC call (``ServerLive``) from this process over one connection,
    sent as the plan's client sends its bytes (grpcio, or ``--client native`` our own): what every gRPC request pays
    the client, its transport and Triton's frontend before any model work. The breakdown's "net" (client less
    server) minus this is what the payload itself costs in transit. None over HTTP (its client is another library,
    so its floor would not be this one)."""
    if plan.protocol != "grpc":
        return None
    from tritonclient.grpc import service_pb2

    payload = service_pb2.ServerLiveRequest().SerializeToString()
    rpc, channel = unary_call(plan, SERVER_LIVE, plan.client == "native")
    try:
        times = []
        for i in range(20 + calls):  # 20 warm-up calls: the channel's connection is made by the first
            began = time.perf_counter()
            rpc(payload, plan.timeout_s)
            if i >= 20:
                times.append((time.perf_counter() - began) * 1000)
        return _r(percentile(times, 50))
    finally:
        channel.close()


def start_timeout_s(plan: LoadPlan) -> float:
    """How long a client process may take to make its payloads, connect, set up its regions and warm up."""
    return plan.timeout_s + 120


def await_clients(procs, ready, timeout_s: float, poll_s: float = 1.0):
    """Yield ``(index, warm)`` as each client process reports ready. A process found dead at two polls in a row,
    with nothing in the pipe between them (a crash in a native library, the OOM killer), is named with what ended
    it, rather than waited for until ``timeout_s``; one still starting at ``timeout_s`` has printed its threads'
    stacks to stderr (``worker_main``)."""
    waiting = set(range(len(procs)))
    deadline = time.monotonic() + timeout_s
    dead_before: list[int] = []
    while waiting:
        try:
            index, error, warm = ready.get(timeout=poll_s)
        except queue.Empty:
            dead = sorted(i for i in waiting if procs[i].exitcode is not None)
            gone = [i for i in dead if i in dead_before]  # dead a whole poll ago, and still no report
            if gone:
                raise KKError(f"client process {gone[0]} died before the load "
                              f"({exit_reason(procs[gone[0]].exitcode)}); its output above says where")
            dead_before = dead
            if time.monotonic() > deadline:
                raise KKError(f"client process {min(waiting)} did not start within {timeout_s:.0f} s (its threads' "
                              f"stacks are printed above); raise --timeout, or lower --concurrency or "
                              f"--shm-preload-mb")
            continue
        if error:
            raise KKError(f"client process {index} failed before the load: {error}")
        waiting.discard(index)
        yield index, warm


def exit_reason(code: int | None) -> str:
    """``exit code 3``, or ``killed by SIGSEGV`` for a process ended by a signal (multiprocessing's negative code)."""
    if code is not None and code < 0:
        import signal

        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def run_load(plan: LoadPlan, answers: list[dict] | None, progress=None) -> dict:
    """Run ``plan`` against a running server; ``answers`` from ``expected_answers`` (None: not checked)."""
    plan.check()
    reachable(plan)
    floor = rpc_floor_ms(plan)  # before the load, with the server idle (and the native client compiled, once)
    metrics_url = f"http://{plan.host}:{plan.metrics_port}/metrics"
    ctx = mp.get_context("spawn")
    ready, results, go = ctx.Queue(), ctx.Queue(), ctx.Event()
    start_at = ctx.Value("d", 0.0)
    procs = [ctx.Process(target=worker_main, args=(asdict(plan), i, ready, go, start_at, results), daemon=True)
             for i in range(plan.processes)]
    for p in procs:
        p.start()
    pool_answers = answers
    warm_bad = 0
    try:
        for index, warm in await_clients(procs, ready, start_timeout_s(plan)):
            if pool_answers is not None:
                warm_bad += sum(1 for k, d in warm if answered_by(pool_answers[k], d) is None)
        time.sleep(0.6)  # the warm-up's stage counters are pushed (at most every 0.5 s) before the snapshot
        before = read_metrics(metrics_url, plan.model)
        start_at.value = time.time()
        go.set()
        records: list = []
        reported: set[int] = set()
        while len(reported) < len(procs):
            try:
                index, mine = results.get(timeout=1.0)
            except queue.Empty:  # still loading, unless a client process died without its records
                dead = [i for i, p in enumerate(procs) if i not in reported and p.exitcode is not None]
                if dead:
                    time.sleep(1.0)  # a last report may still be in the pipe
                    while not results.empty():
                        index, mine = results.get()
                        reported.add(index)
                        records.extend(mine)
                    lost = [i for i in dead if i not in reported]
                    if lost:
                        raise KKError(f"client process {lost[0]} died ({exit_reason(procs[lost[0]].exitcode)}) "
                                      f"before reporting its requests") from None
                continue
            reported.add(index)
            records.extend(mine)
            if progress:
                progress(len(records))
        ended = time.time()
        time.sleep(0.6)  # kkdeploy's stage counters are pushed at most every 0.5 s
        after = read_metrics(metrics_url, plan.model)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
    summary = summarize(plan, records, pool_answers, metrics_delta(before, after), ended - start_at.value, warm_bad)
    summary["rpc_floor_ms"] = floor
    return summary


def summarize(plan: LoadPlan, records: list, answers: list[dict] | None, delta: dict, wall_s: float,
              warm_bad: int = 0) -> dict:
    pool = make_pool(plan) if answers is not None else None
    ok = [r for r in records if r[4] is None]
    errors = [r for r in records if r[4] is not None]
    latencies = [r[2] * 1000 for r in ok]
    sizes = {}
    if pool is not None:
        for r in ok:
            sizes.setdefault(pool[r[0]][0].shape[0], []).append(r[2] * 1000)
    wrong, buckets_matched = [], {}
    if answers is not None:
        for r in ok:
            bucket = answered_by(answers[r[0]], r[3])
            if bucket is None:
                wrong.append(r)
            else:
                buckets_matched[bucket] = buckets_matched.get(bucket, 0) + 1
    sequences = sum(pool[r[0]][0].shape[0] for r in ok) if pool is not None else None
    span = max((r[1] + r[2] for r in ok), default=0.0) if ok else wall_s
    summary = {
        "plan": asdict(plan), "loop": plan.loop,
        "requests": len(records), "answered": len(ok), "errors": len(errors),
        "first_errors": sorted({r[4] for r in errors})[:5],
        "checked": answers is not None, "bitwise_equal": len(ok) - len(wrong) if answers is not None else None,
        "wrong": len(wrong), "warmup_wrong": warm_bad,
        "matched_buckets": {str(k): v for k, v in sorted(buckets_matched.items())},
        "wall_s": round(span, 3),
        "req_per_s": round(len(ok) / span, 1) if span else None,
        "seq_per_s": round(sequences / span, 1) if span and sequences is not None else None,
        "latency_ms": {f"p{q}": _r(percentile(latencies, q)) for q in (50, 90, 99)}
                      | {"mean": _r(sum(latencies) / len(latencies)) if latencies else None,
                         "max": _r(max(latencies, default=None))},
        "latency_ms_by_batch": {str(n): {f"p{q}": _r(percentile(v, q)) for q in (50, 90, 99)} | {"count": len(v)}
                                for n, v in sorted(sizes.items())},
        # the whole distribution in 101 points (percentiles 0..100), for the chart (loadtest_chart)
        "latency_cdf_ms": [round(float(v), 4) for v in np.percentile(latencies, np.arange(101))] if latencies else [],
        "server": server_breakdown(delta),
    }
    return summary


def _r(v, digits: int = 3):
    return None if v is None else round(v, digits)


def server_breakdown(delta: dict) -> dict:
    """Per request (Triton's counters) and per engine run (kkdeploy's), in microseconds."""
    requests = delta.get("nv_inference_request_success", 0.0)
    execs = delta.get("nv_inference_exec_count", 0.0)
    out = {"requests": requests, "executions": execs, "sequences": delta.get("nv_inference_count"),
           "avg_batch_sequences": _r(delta.get("nv_inference_count", 0) / execs, 2) if execs else None}
    for name in ("request_duration", "queue_duration", "compute_input_duration", "compute_infer_duration",
                 "compute_output_duration"):
        value = delta.get(f"nv_inference_{name}_us")
        out[f"{name}_us_per_request"] = _r(value / requests, 1) if value is not None and requests else None
    runs = sum(v for k, v in delta.items() if k.startswith("kkdeploy_bucket_executions_total"))
    out["engine_runs"] = runs
    for stage in ("gather", "engine", "respond"):
        value = delta.get(f"kkdeploy_stage_us_total{{stage={stage}}}")
        out[f"{stage}_us_per_run"] = _r(value / runs, 1) if value is not None and runs else None
    real, padding = delta.get("kkdeploy_rows_total{kind=real}"), delta.get("kkdeploy_rows_total{kind=padding}")
    out["padding_rows_fraction"] = _r(padding / (real + padding), 4) if real and padding is not None else None
    out["runs_by_bucket"] = {k.split("bucket=")[1].rstrip("}"): v for k, v in delta.items()
                             if k.startswith("kkdeploy_bucket_executions_total") and v}
    # the in-process backend's executions by route (native: its C++ half alone; python: the rest)
    out["executions_by_route"] = {k.split("route=")[1].rstrip("}"): v for k, v in delta.items()
                                  if k.startswith("kkdeploy_route_executions_total") and v}
    return out


def against_engine(summary: dict, direct: dict) -> dict:
    """The served load set against the engine alone (``direct_engine``): the fraction of the engine's sequences per
    second at its largest bucket, and, for a load of one batch size, the median latency above the engine's own at the
    smallest bucket that holds that batch (what the server and the client add)."""
    sizes = sorted(int(b) for b in direct)
    largest = str(sizes[-1])
    out = {"largest_bucket": sizes[-1], "engine_seq_per_s": direct[largest]["seq_per_s"],
           "fraction_of_engine": _r(summary["seq_per_s"] / direct[largest]["seq_per_s"], 4)
           if summary.get("seq_per_s") and direct[largest].get("seq_per_s") else None}
    batches = sorted({int(n) for n, _ in summary["plan"]["mix"]})
    p50 = (summary.get("latency_ms") or {}).get("p50")
    if len(batches) == 1 and p50 is not None:
        bucket = next((b for b in sizes if b >= batches[0]), sizes[-1])
        out.update(bucket=bucket, engine_ms=direct[str(bucket)]["median_ms"],
                   p50_over_engine_ms=_r(p50 - direct[str(bucket)]["median_ms"]))
    return out


def perf_analyzer_command(plan: LoadPlan) -> str:
    """The perf_analyzer call closest to ``plan`` (for a machine with NVIDIA's SDK container)."""
    port = plan.grpc_port if plan.protocol == "grpc" else plan.http_port
    load = (f"--request-rate-range={plan.rate}" if plan.rate else f"--concurrency-range={plan.concurrency}")
    sizes = sorted({int(n) for n, _ in plan.mix})
    return (f"perf_analyzer -m {plan.model} -i {plan.protocol} -u {plan.host}:{port} {load} -b {sizes[0]} "
            f"--shape x:{plan.seq_len},{plan.d_model} --measurement-mode=count_windows "
            f"--measurement-request-count={plan.requests or 1000}"
            + (f" --shared-memory={plan.shared_memory}" if plan.shared_memory != "none" else ""))


def direct_engine(runner, sizes=None, warmups: int = 20, repeats: int = 200) -> dict:
    """The engine alone, in this process: median latency per bucket (one full bucket per call) and the
    throughput it implies (sequences per second at that bucket)."""
    import torch

    from ..pipeline.runtime import bucketed

    runner = bucketed(runner)
    device, dtype = runner_device(runner)
    config = runner.config
    out = {}
    for size in sizes or runner.sizes:
        x = torch.randn((size, config.seq_len, config.d_model), dtype=dtype, device=device)
        mask = torch.ones((size, config.seq_len), dtype=torch.bool, device=device)
        times = []
        with torch.inference_mode():
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t = time.perf_counter()
            runner.run_bucket(size, x, mask)  # one call to size the run: about 2 s per bucket at most
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            once = max(time.perf_counter() - t, 1e-6)
            count = max(10, min(repeats, int(2.0 / once)))
            for i in range(min(warmups, count) + count):
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                t = time.perf_counter()
                runner.run_bucket(size, x, mask)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                if i >= min(warmups, count):
                    times.append(time.perf_counter() - t)
        median = percentile([t * 1000 for t in times], 50)
        out[str(size)] = {"median_ms": _r(median, 4), "seq_per_s": _r(size / (median / 1000), 1)}
    return out
