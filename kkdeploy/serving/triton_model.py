"""The Python-backend model of a kkdeploy Triton repository; ``triton_repo`` copies this file as ``1/model.py``.

One file, three roles, chosen by the ``kkdeploy_role`` parameter of the model's ``config.pbtxt``:

``batched`` (one hop, the default repository). Triton's dynamic batcher gathers requests of 1..N
sequences (``max_batch_size`` = the largest validated batch bucket, so Triton itself rejects more, a wrong width,
dtype or mask shape with a 400) and hands them to this model, which runs the engine in-process:
``kkdeploy.load(<version>/artifacts)`` (every check it makes: hashes, environment, versions, its fallback). The
gathered rows are copied straight into a buffer of the smallest bucket that holds them, on the engine's device
(padding rows zero with an all-False mask), that bucket runs once, and each request gets a DLPack view of its own
rows. On a CUDA artifact the output stays on the GPU until Triton copies it into the response, and inputs a
client sent through CUDA shared memory arrive on the GPU (``FORCE_CPU_ONLY_INPUT_TENSORS: no``). Where the time
goes (gather, engine, respond; real and padding rows; runs per bucket) is exported as custom metrics on Triton's
``/metrics``, flushed at most every half second so that no request pays for a metrics round trip.

``front`` and ``engine`` (the two-hop layout, for native engine models). The front gathers, pads to the engine's
fixed batch B with fully masked rows, calls ``<name>_engine`` once through BLS and splits the result back; the
engine role serves ``kkdeploy.load`` at B. Padding rows are never returned. A missing ``valid_token_mask`` means
every token is valid, as in the model.

Every tensor crosses the stub boundary as DLPack (``to_dlpack``/``from_dlpack``), never through ``as_numpy()``
or ``Tensor(name, ndarray)``: the stub's numpy bridge is compiled against numpy 1.x and, under numpy 2, silently
misreads arrays (an FP32 ``[1, 2, 3]`` arrived as ``[1, 1, 1]`` on our machine). DLPack does not involve numpy.

This module must stay importable without Triton (``triton_python_backend_utils`` exists only inside the stub): the
pure helpers below are unit-tested directly.
"""

from __future__ import annotations

import json
import os
import site
import time

# A kkdeploy environment that is a virtualenv (or has user site-packages) is not the stub's default sys.path:
# ``kkdeploy serve`` names its site dirs here; addsitedir also runs their .pth files (editable installs).
for _dir in filter(None, os.environ.get("KKDEPLOY_SITE_DIRS", "").split(os.pathsep)):
    site.addsitedir(_dir)

# config.pbtxt parameters written by triton_repo
ROLE = "kkdeploy_role"
ENGINE_MODEL = "kkdeploy_engine_model"
ARTIFACTS = "kkdeploy_artifacts"
DEVICE_TYPE = "kkdeploy_device_type"
OUTPUT_DEVICE = "kkdeploy_output_device"  # cpu (default) | gpu
CANARY_FILE = "kkdeploy_canary_file"  # written by `kkdeploy serve`: where the model records its canary answers
RELEASE_DIR = "kkdeploy_release_dir"  # written by `kkdeploy serve`: finalize() leaves "<model>.<pid>" there
CANARY_SEED = 4242
#: "0" turns off writing straight into captured graphs' buffers (``BucketEngine.static``), on by default since a
#: serving run on a GPU checked every answer bit for bit and timed it against the copying path in one session
#: (``scripts/serving_h200.py --static-inputs both``, docs/serving.md); the server's processes inherit it from
#: ``kkdeploy serve``
STATIC_INPUTS_ENV = "KKDEPLOY_STATIC_GRAPH_INPUTS"
INPUT_X, INPUT_MASK, OUTPUT_Y = "x", "valid_token_mask", "y"


def parameter(model_config: dict, key: str, default: str | None = None) -> str | None:
    value = (model_config.get("parameters") or {}).get(key)
    return value.get("string_value", default) if isinstance(value, dict) else default


def chunks(sizes: list[int], batch: int) -> list[list[int]]:
    """Indices of requests grouped in order so that each group holds at most ``batch`` sequences.

    Triton's batcher never hands over more than ``max_batch_size`` sequences; this keeps the front correct even
    if a future scheduler did (a request is never split: each one holds at most ``batch``)."""
    groups, current, used = [], [], 0
    for i, n in enumerate(sizes):
        if current and used + n > batch:
            groups.append(current)
            current, used = [], 0
        current.append(i)
        used += n
    if current:
        groups.append(current)
    return groups


def canary_case(seq_len: int, d_model: int, dtype):
    """The watchdog's tiny request: one sequence, a quarter of it padding, from a fixed seed (torch on the CPU,
    so ``kkdeploy serve`` makes the same bytes)."""
    import torch

    generator = torch.Generator().manual_seed(CANARY_SEED)
    x = torch.randn((1, seq_len, d_model), generator=generator).to(dtype)
    mask = (torch.arange(seq_len) < seq_len - seq_len // 4)[None, :]
    x[~mask] = 0
    return x, mask


def gpu_outputs_wanted(model_config: dict) -> bool:
    """Whether a CUDA model hands Triton its answers as GPU tensors: only where the repository asks for it
    (``kkdeploy_output_device: gpu``). By default they are copied to host memory here. Triton's Python backend
    fills a GPU output in a second round trip to the stub, in which the stub copies the tensor into the server's
    buffer (host memory for an HTTP/gRPC response). A stub that dies in that round trip is not reported for the
    batch's requests (``python_be.cc`` passes a request count of 0 to its error path), so their unfilled buffers go
    out as successful answers: one wrong answer on the H200 under kill -9 (docs/serving.md). A host output is
    written before the stub's answer to the execute call, so a stub that dies earlier fails every request."""
    return parameter(model_config, OUTPUT_DEVICE, "cpu") == "gpu"


def release_marker(directory: str | None, model: str, pid: int) -> str | None:
    """The file a stub's ``finalize()`` creates: ``<directory>/<model>.<pid>`` (None without a directory)."""
    return os.path.join(directory, f"{model}.{pid}") if directory else None


def leave_release_marker(path: str | None) -> None:
    """Create the release marker (``release_marker``), if there is one to leave."""
    if path:
        try:
            with open(path, "w"):
                pass
        except OSError:  # serve's directory is gone: nobody waits for this
            pass


def _exit_now() -> None:
    """The stub's last ``atexit`` handler (registered in ``finalize``, so it runs first): the process ends here
    instead of tearing the interpreter down (torch's and ONNX Runtime's exit handlers, module teardown: about
    0.5 s of a CPU stub's 0.7 s exit, and the model's unload waits for the stub to exit). By then the stub has
    answered every request, sent Triton its finalize response and released its shared memory; nothing in this
    process has anything left to write but the standard streams, flushed here."""
    import sys

    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed stream: nothing to flush
            pass
    os._exit(0)


def tensor_digest(t) -> str:
    """blake2b-128 of a tensor's bytes (as ``loadtest.digest`` of the same array's ``tobytes()``); no numpy."""
    import hashlib

    data = bytes(t.detach().cpu().contiguous().clone().untyped_storage())
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def write_canary(path: str, model: str, answers: dict) -> None:
    """``{bucket: digest}`` of the canary's answer at each bucket, written atomically for the watchdog."""
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump({"model": model, "pid": os.getpid(), "buckets": {str(k): v for k, v in answers.items()}}, f)
    os.replace(tmp, path)


def canary_answers(run_bucket, sizes, seq_len: int, d_model: int, dtype, device) -> dict:
    """The canary in row 0 of each bucket, the other rows zero and fully masked, as a gathered batch holds it."""
    import torch

    x1, m1 = canary_case(seq_len, d_model, dtype)
    answers = {}
    for size in sizes:
        x = torch.zeros((size, seq_len, d_model), dtype=dtype, device=device)
        mask = torch.zeros((size, seq_len), dtype=torch.bool, device=device)
        x[:1], mask[:1] = x1.to(device), m1.to(device)
        answers[size] = tensor_digest(run_bucket(size, x, mask)[:1])
    return answers


def gather_host(xs: list, masks: list, x_out, mask_out):
    """``(x, mask)``: several requests' host rows written into the first rows of ``x_out`` and ``mask_out`` (a
    missing mask: every token valid) and returned as those rows, so that each crosses to the device in one copy.
    The buffers are the bucket's own, pinned and reused (``BucketEngine.staging``): nothing is allocated per run."""
    import torch

    n = sum(int(xi.shape[0]) for xi in xs)
    x, mask = x_out[:n], mask_out[:n]
    torch.cat(xs, out=x)
    row = 0
    for xi, mi in zip(xs, masks):
        k = int(xi.shape[0])
        if mi is None:
            mask[row:row + k].fill_(True)
        else:
            mask[row:row + k].copy_(mi)
        row += k
    return x, mask


def pad_batch(xs: list, masks: list, batch: int):
    """``(x, mask, bounds)``: the inputs stacked and padded to ``batch`` rows with zeros and all-False masks;
    ``bounds[i]`` is the row range of input ``i``."""
    import torch

    n = sum(int(x.shape[0]) for x in xs)
    if n > batch:
        raise ValueError(f"{n} sequences do not fit the engine's fixed batch of {batch}")
    x0 = xs[0]
    x = torch.zeros((batch, *x0.shape[1:]), dtype=x0.dtype)
    mask = torch.zeros((batch, x0.shape[1]), dtype=torch.bool)
    bounds, row = [], 0
    for xi, mi in zip(xs, masks):
        k = int(xi.shape[0])
        x[row:row + k] = xi
        mask[row:row + k] = True if mi is None else mi
        bounds.append((row, row + k))
        row += k
    return x, mask, bounds


class TritonPythonModel:
    """Triton's entry point; delegates to the role named in config.pbtxt."""

    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.released = release_marker(parameter(config, RELEASE_DIR), config["name"], os.getpid())
        role = parameter(config, ROLE)
        if role == "batched":
            self.impl = _Batched(config, args)
        elif role == "front":
            self.impl = _Front(config)
        elif role == "engine":
            self.impl = _Engine(config, args)
        else:
            raise ValueError(f"config.pbtxt parameter {ROLE} must be 'batched', 'front' or 'engine', got {role!r}")

    def execute(self, requests):
        return self.impl.execute(requests)

    def finalize(self):
        """Triton calls this once no request holds the model any more (all answered), after the Python backend's
        1 s stub health check. First, the release marker: `kkdeploy serve`'s stop counts the model drained when
        every instance has left one (exact, where Triton's pending-request gauge stops counting a request before
        it reaches this process). Last, the stub is set to exit without the interpreter's teardown."""
        import atexit

        leave_release_marker(self.released)
        clock = getattr(self.impl, "clock", None)
        if clock is not None:
            try:
                clock.close()
            except Exception:  # noqa: BLE001 - the server is unloading the model: the last half second is lost
                pass
        self.impl = None
        atexit.register(_exit_now)


def _to_torch(tensor):
    from torch.utils.dlpack import from_dlpack

    return from_dlpack(tensor.to_dlpack())


def _to_triton(name: str, value, keep_device: bool = False):
    """A Triton tensor sharing ``value``'s memory (DLPack). ``keep_device``: a GPU tensor stays on the GPU (Triton
    copies it into the response itself); otherwise it is brought to the CPU first."""
    import triton_python_backend_utils as pb_utils
    from torch.utils.dlpack import to_dlpack

    value = value.detach()
    if not keep_device:
        value = value.cpu()
    return pb_utils.Tensor.from_dlpack(name, to_dlpack(value.contiguous()))


def _code(exc: BaseException):
    """A caller's mistake (a batch past the largest bucket, a shape the engine refuses) is INVALID_ARGUMENT (HTTP
    400); anything else is the server's (INTERNAL, 500)."""
    import triton_python_backend_utils as pb_utils

    from kkdeploy.errors import KKError

    return pb_utils.TritonError.INVALID_ARGUMENT if isinstance(exc, (KKError, ValueError)) else None


def _error(message: str, code=None):
    import triton_python_backend_utils as pb_utils

    return pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(
        message, pb_utils.TritonError.INTERNAL if code is None else code))


def _stage_clock(name: str, buckets: list[int]) -> StageClock:
    try:
        sink = _TritonMetrics(name, buckets)
    except Exception as exc:  # noqa: BLE001 - an older backend without custom metrics still serves
        import triton_python_backend_utils as pb_utils

        pb_utils.Logger.log_warn(f"{name}: no stage metrics ({type(exc).__name__}: {exc})")
        sink = None
    return StageClock(sink, background=True)


class _Front:
    """Two hops: its stage metrics call the BLS round trip to the engine model "engine", so that a before/after
    comparison with the one-hop model shows what the second hop costs."""

    def __init__(self, config: dict):
        import torch

        # The front only copies rows; torch's default thread pool would spin beside the engine's on the same cores.
        torch.set_num_threads(1)
        self.name = config["name"]
        self.batch = int(config["max_batch_size"])
        self.engine_model = parameter(config, ENGINE_MODEL)
        if not self.engine_model:
            raise ValueError(f"{self.name}: config.pbtxt lacks the {ENGINE_MODEL} parameter")
        self.clock = _stage_clock(self.name, [self.batch])

    def execute(self, requests):
        import triton_python_backend_utils as pb_utils

        start = time.perf_counter_ns()
        responses = [None] * len(requests)
        xs, masks = [], []
        for request in requests:
            x = _to_torch(pb_utils.get_input_tensor_by_name(request, INPUT_X))
            mask = pb_utils.get_input_tensor_by_name(request, INPUT_MASK)
            xs.append(x)
            masks.append(None if mask is None else _to_torch(mask))
        for group in chunks([int(x.shape[0]) for x in xs], self.batch):
            try:
                outputs, gathered, ran = self._run([xs[i] for i in group], [masks[i] for i in group])
            except Exception as exc:  # noqa: BLE001 - the engine's error goes back to each caller
                for i in group:
                    responses[i] = _error(f"{self.name}: {exc}")
                start = time.perf_counter_ns()
                continue
            for i, y in zip(group, outputs):
                responses[i] = pb_utils.InferenceResponse(output_tensors=[_to_triton(OUTPUT_Y, y)])
            self.clock.record(gathered - start, ran - gathered, time.perf_counter_ns() - ran, self.batch,
                              sum(int(xs[i].shape[0]) for i in group))
            start = time.perf_counter_ns()
        return responses

    def _run(self, xs, masks):
        import triton_python_backend_utils as pb_utils

        x, mask, bounds = pad_batch(xs, masks, self.batch)
        gathered = time.perf_counter_ns()
        request = pb_utils.InferenceRequest(
            model_name=self.engine_model, requested_output_names=[OUTPUT_Y],
            inputs=[_to_triton(INPUT_X, x), _to_triton(INPUT_MASK, mask)])
        response = request.exec()
        if response.has_error():
            raise RuntimeError(f"engine model {self.engine_model}: {response.error().message()}")
        y = _to_torch(pb_utils.get_output_tensor_by_name(response, OUTPUT_Y))
        ran = time.perf_counter_ns()
        return [y[a:b].clone() for a, b in bounds], gathered, ran


class _Engine:
    def __init__(self, config: dict, args: dict):
        import triton_python_backend_utils as pb_utils

        import torch

        import kkdeploy

        version_dir = os.path.join(args["model_repository"], args["model_version"])
        artifacts = os.path.join(version_dir, parameter(config, ARTIFACTS, "artifacts"))
        device = "cpu"
        if parameter(config, DEVICE_TYPE, "cpu") == "cuda":
            device = f"cuda:{int(args.get('model_instance_device_id') or 0)}"
        self.runner = kkdeploy.load(artifacts, device=device)
        self.device = torch.device(device)
        self.shape = [int(d) for d in next(i["dims"] for i in config["input"] if i["name"] == INPUT_X)]
        pb_utils.Logger.log_info(f"{config['name']}: serving {self.runner.backend} on {device}: {self.runner.reason}")
        with torch.inference_mode():  # first call outside the clock: lazy session/graph set-up
            x = torch.zeros(self.shape, dtype=_dtype(config), device=self.device)
            self.runner(x, torch.ones(self.shape[:2], dtype=torch.bool, device=self.device))
            canary = parameter(config, CANARY_FILE)
            if canary:
                write_canary(canary, config["name"], canary_answers(
                    lambda size, x_, m_: self.runner(x_, m_), [self.shape[0]], self.shape[1], self.shape[2],
                    _dtype(config), self.device))

    def execute(self, requests):
        import triton_python_backend_utils as pb_utils

        import torch

        responses = []
        for request in requests:
            try:
                x = _to_torch(pb_utils.get_input_tensor_by_name(request, INPUT_X)).to(self.device)
                mask = _to_torch(pb_utils.get_input_tensor_by_name(request, INPUT_MASK)).to(self.device)
                with torch.inference_mode():
                    y = self.runner(x, mask)
                responses.append(pb_utils.InferenceResponse(output_tensors=[_to_triton(OUTPUT_Y, y)]))
            except Exception as exc:  # noqa: BLE001 - one bad call must not take the model down
                responses.append(_error(f"engine: {type(exc).__name__}: {exc}"))
        return responses


STAGES = ("gather", "engine", "respond")


class StageClock:
    """Per-stage time, rows and bucket runs, summed locally and pushed to Triton's custom metrics at most every
    ``interval_s`` (each push is a message to the server: a push per request would cost more than it measures),
    by the request that finds the interval over or, when traffic stops, by a background thread, so /metrics
    lags by at most about ``interval_s``. ``sink(totals)`` does the push; the counters are cumulative."""

    def __init__(self, sink=None, interval_s: float = 0.5, background: bool = False):
        import threading

        self.sink, self.interval_s = sink, interval_s
        self.pending: dict[tuple, float] = {}
        self.last = time.monotonic()
        self.lock = threading.Lock()
        self.stopped = threading.Event()
        if background and sink is not None:
            threading.Thread(target=self._loop, name="kkdeploy-stage-metrics", daemon=True).start()

    def _loop(self) -> None:
        while not self.stopped.wait(self.interval_s):
            try:
                self.maybe_flush()
            except Exception:  # noqa: BLE001 - metrics must never take the model down
                pass

    def add(self, key: tuple, value: float) -> None:
        self.pending[key] = self.pending.get(key, 0.0) + value

    def record(self, gather_ns: int, engine_ns: int, respond_ns: int, bucket: int, real: int) -> None:
        with self.lock:
            for stage, ns in zip(STAGES, (gather_ns, engine_ns, respond_ns)):
                self.add(("stage_us", stage), ns / 1000.0)
            self.add(("executions", str(bucket)), 1)
            self.add(("rows", "real"), real)
            self.add(("rows", "padding"), bucket - real)
        self.maybe_flush()

    def maybe_flush(self) -> None:
        """Push what was counted if the interval is over. The lock only guards the counters: the push itself (a
        message to the server and its answer) runs outside it, so no caller ever waits on another's round trip."""
        with self.lock:
            now = time.monotonic()
            if self.sink is None or not self.pending or self.stopped.is_set() or now - self.last < self.interval_s:
                return
            pending, self.pending, self.last = self.pending, {}, now
        self.sink(pending)

    def close(self) -> None:
        """Stop pushing. What was counted since the last push (at most ``interval_s`` of it) is dropped: ``close``
        runs in ``finalize()``, while the server unloads the model, and a push then is a round trip that the
        server need not answer; a stub waiting on it never finishes unloading."""
        with self.lock:
            self.stopped.set()
            self.pending = {}


class _TritonMetrics:
    """Custom metric families (``pb_utils.MetricFamily``, Triton >= 23.05): kkdeploy_stage_us_total{stage},
    kkdeploy_rows_total{kind=real|padding}, kkdeploy_bucket_executions_total{bucket}."""

    def __init__(self, model: str, buckets: list[int]):
        import triton_python_backend_utils as pb_utils

        counter = pb_utils.MetricFamily.COUNTER
        self.families = {
            "stage_us": pb_utils.MetricFamily(name="kkdeploy_stage_us_total", kind=counter,
                                              description="microseconds inside model.py by stage"),
            "rows": pb_utils.MetricFamily(name="kkdeploy_rows_total", kind=counter,
                                          description="rows run by the engine: real (requested) and padding"),
            "executions": pb_utils.MetricFamily(name="kkdeploy_bucket_executions_total", kind=counter,
                                                description="engine runs per batch bucket"),
        }
        label = {"stage_us": "stage", "rows": "kind", "executions": "bucket"}
        values = {"stage_us": STAGES, "rows": ("real", "padding"), "executions": [str(b) for b in buckets]}
        self.metrics = {(family, value): self.families[family].Metric(labels={"model": model, label[family]: value})
                        for family in self.families for value in values[family]}

    def __call__(self, totals: dict) -> None:
        for key, value in totals.items():
            metric = self.metrics.get(key)
            if metric is not None:
                metric.increment(value)


def static_calls(buckets: dict, cuda: bool) -> dict:
    """bucket -> ``StaticCall`` of the buckets whose engine has one, where the GPU serves and ``STATIC_INPUTS_ENV``
    does not turn them off ("0"); else none."""
    if not cuda or os.environ.get(STATIC_INPUTS_ENV, "1") == "0":
        return {}
    calls = {size: runner.static_call() for size, runner in buckets.items()}  # ServedRunner.static_call
    return {size: call for size, call in calls.items() if call is not None}


class BucketEngine:
    """The one-hop engine without Triton: the gathered requests' rows run on the smallest validated bucket that
    holds them. The Python backend's batched role (``_Batched``) and kkdeploy's in-process backend
    (``kkdeploy.serving.inprocess``) both serve through it, so the two cannot batch, pad or answer differently."""

    def __init__(self, name: str, artifacts: str, device: str, row_shape: list[int], dtype, max_batch: int,
                 gpu_outputs: bool = False, canary_file: str | None = None):
        import torch

        import kkdeploy
        from kkdeploy.pipeline.runtime import bucketed

        self.name = name
        if device.startswith("cuda"):
            torch.cuda.set_device(torch.device(device))
        self.device = torch.device(device)
        self.runner = bucketed(kkdeploy.load(artifacts, device=device))
        if self.device.type == "cpu" and all(getattr(r, "engine", None) is not None and r.backend.startswith("ort")
                                             for r in self.runner.buckets.values()):
            # torch only copies rows here; its idle pool spinning beside ONNX Runtime's on the same cores made
            # every engine run slower (docs/serving.md, CPU benchmark).
            torch.set_num_threads(1)
        self.max_batch = int(max_batch)
        if self.max_batch > self.runner.max_batch:
            raise ValueError(f"{self.name}: max_batch_size {self.max_batch} exceeds the largest validated bucket "
                             f"{self.runner.max_batch}; rewrite the repository")
        self.row_shape = [int(d) for d in row_shape]
        self.dtype = dtype
        self.cuda = self.device.type == "cuda"
        self.gpu_outputs = self.cuda and gpu_outputs
        self.described = ", ".join(f"{b}: {r.backend}" for b, r in self.runner.buckets.items())
        with torch.inference_mode():  # every bucket's first call outside the clock, on both mask routes
            for size in self.runner.sizes:
                x = torch.zeros([size, *self.row_shape], dtype=self.dtype, device=self.device)
                mask = torch.ones([size, self.row_shape[0]], dtype=torch.bool, device=self.device)
                self.runner.run_bucket(size, x, mask)
                mask[:, -1] = False
                self.runner.run_bucket(size, x, mask)
            if canary_file:
                write_canary(canary_file, self.name, canary_answers(self.runner.run_bucket, self.runner.sizes,
                                                                    self.row_shape[0], self.row_shape[1], self.dtype,
                                                                    self.device))
            if self.cuda:
                torch.cuda.synchronize(self.device)
        self.inference_mode = torch.inference_mode
        # A bucket whose engine is a CUDA graph that serves every mask: the gather writes straight into the graph's
        # own input buffers and the run is its replay (no copies in, no clone out, no checks of what the gather built).
        self.static = static_calls(self.runner.buckets, self.cuda)
        self.static_all_true: dict[int, bool] = {}  # bucket -> its static mask holds all True from the last run
        self.static_mask_shared = False  # the in-process backend's native route (C++) writes the captures' masks too
        self.buffers: dict[int, tuple] = {}
        self.host_outputs: dict[int, object] = {}  # bucket -> pinned host buffer for its answers (_to_host)
        self.host_inputs: dict[int, tuple] = {}  # bucket -> pinned host (x, mask) that gathers requests (staging)
        # Made outside inference mode (so they have version counters) and never written.
        self.all_valid = {size: torch.ones([size, self.row_shape[0]], dtype=torch.bool, device=self.device)
                          for size in self.runner.sizes}

    @property
    def sizes(self) -> list[int]:
        return self.runner.sizes

    def groups(self, rows: list[int]):
        """The requests' indices in runs of at most ``max_batch`` sequences (one run unless they hold more)."""
        return [range(len(rows))] if sum(rows) <= self.max_batch else chunks(rows, self.max_batch)

    def _buffers(self, size: int):
        """The bucket's input and mask buffers on the engine's device, made on first use (a bucket that never
        runs, such as a shape-6 bucket of 10,000, costs nothing) and rewritten in full by every run."""
        found = self.buffers.get(size)
        if found is None:
            import torch

            static = self.static.get(size)
            if static is not None:  # the captured graph's own inputs
                found = (static.x, static.mask)
            else:
                found = (torch.empty([size, *self.row_shape], dtype=self.dtype, device=self.device),
                         torch.empty([size, self.row_shape[0]], dtype=torch.bool, device=self.device))
            self.buffers[size] = found
        return found

    def static_mask_stale(self, size: int, all_true: bool) -> bool:
        """Whether this run must write the mask buffer of ``size``'s capture, and a record of what it holds after the
        run. A run whose mask is all True (a full bucket of mask-less requests) writes it only when the last run left
        something else there; any other run writes its rows. Both routes into a capture (``run`` and the in-process
        backend's direct route) ask here, so neither can trust a buffer the other changed."""
        if self.static_mask_shared:  # the native route writes these buffers too, unseen here
            return True
        if all_true:
            stale = not self.static_all_true.get(size)
            self.static_all_true[size] = True
            return stale
        self.static_all_true[size] = False
        return True

    def staging(self, size: int):
        """The bucket's pinned host buffers in which several requests' rows are gathered before one copy each to
        the device (made on first use, reused: the copy is complete when the run's sync returns, before the next
        run writes them)."""
        found = self.host_inputs.get(size)
        if found is None:
            import torch

            found = (torch.empty([size, *self.row_shape], dtype=self.dtype, pin_memory=self.cuda),
                     torch.empty([size, self.row_shape[0]], dtype=torch.bool, pin_memory=self.cuda))
            self.host_inputs[size] = found
        return found

    def _to_host(self, size: int, y):
        """``y`` (``n`` rows of a ``size`` bucket's answer) in the bucket's pinned host buffer, made on first use and
        reused: ``y.cpu()`` allocated fresh pageable memory per run, whose page faults and staged copy took 12.9 ms
        of a 16 MB shape-13 answer (H200, docs/results.md). The stub (or the in-process backend) copies each
        response out before the next run, so the buffer is free by then."""
        import torch

        out = self.host_output(size, y)[:y.shape[0]]
        out.copy_(y, non_blocking=True)
        torch.cuda.current_stream(self.device).synchronize()
        return out

    def host_output(self, size: int, y):
        """The ``size`` bucket's host buffer for answers shaped like ``y``'s rows (pinned where the GPU serves)."""
        host = self.host_outputs.get(size)
        if host is None or host.dtype != y.dtype or host.shape[1:] != y.shape[1:]:
            import torch

            host = torch.empty([size, *y.shape[1:]], dtype=y.dtype, pin_memory=self.cuda)
            self.host_outputs[size] = host
        return host

    def run(self, xs, masks):
        """``(outputs, bucket, rows, gathered_ns, ran_ns)``: one run of these requests' rows; each output is a
        request's rows (host memory unless ``gpu_outputs``), valid until the next run."""
        import torch

        n = 0
        for xi in xs:
            n += xi.shape[0]
        size = self.runner.bucket_for(n)
        x, mask = self._buffers(size)
        bounds, row = [], 0
        for xi in xs:
            k = xi.shape[0]
            bounds.append((row, row + k))
            row += k
        # Host inputs of several requests bound for the GPU are gathered on the host first, so that each of x and
        # the mask crosses to the device in one copy per run, not one per request. A lone request is copied straight
        # from Triton's memory: staging it too was slower on an H100 (gather 84.7 against 65.9 us; docs/serving.md).
        staged = self.cuda and len(xs) > 1 and xs[0].device.type == "cpu"
        if len(xs) == 1:
            (x if n == size else x[:n]).copy_(xs[0], non_blocking=True)
        elif staged:
            host_x, host_mask = gather_host(xs, masks, *self.staging(size))
            x[:n].copy_(host_x, non_blocking=True)
        else:
            for (a, b), xi in zip(bounds, xs):
                x[a:b].copy_(xi, non_blocking=True)
        if n < size:  # padding rows: zeros, fully masked, never returned
            x[n:].zero_()
        static = self.static.get(size)
        if n == size and all(m is None for m in masks):
            if static is not None:  # the graph reads its own mask buffer: all True, written only when it was not
                if self.static_mask_stale(size, all_true=True):
                    mask.fill_(True)
            else:
                # every token valid: the bucket's all-True mask, never written, so an engine that caches "all valid"
                # by tensor identity and version (an all-valid-only CUDA graph) answers without a device sync
                mask = self.all_valid[size]
        else:
            self.static_mask_stale(size, all_true=False)  # this run writes every row of the mask
            if staged:
                mask[:n].copy_(host_mask, non_blocking=True)
            else:
                for (a, b), mi in zip(bounds, masks):
                    if mi is None:
                        mask[a:b].fill_(True)
                    else:
                        mask[a:b].copy_(mi, non_blocking=True)
            if n < size:
                mask[n:].fill_(False)
        gathered = time.perf_counter_ns()
        with self.inference_mode():
            y = static.run() if static is not None else self.runner.run_bucket(size, x, mask)
        if self.cuda:  # the responses read y: it must be complete (and the clock honest)
            torch.cuda.current_stream(self.device).synchronize()
        ran = time.perf_counter_ns()
        if self.cuda and not self.gpu_outputs:  # the answers cross to the host in one copy per run
            y = self._to_host(size, y[:n])
        elif static is not None and self.gpu_outputs:
            # a GPU answer may be read after this returns (the Python backend's second round trip): a copy, not the
            # graph's output buffer, which the next replay overwrites
            y = y.clone()
        if len(xs) == 1 and n == y.shape[0]:
            return [y], size, n, gathered, ran
        return [y[a:b] for a, b in bounds], size, n, gathered, ran


class _Batched:
    """One hop in the Python backend: Triton tensors in and out (DLPack) around a ``BucketEngine``."""

    def __init__(self, config: dict, args: dict):
        import triton_python_backend_utils as pb_utils

        self.name = config["name"]
        version_dir = os.path.join(args["model_repository"], args["model_version"])
        device = "cpu"
        if parameter(config, DEVICE_TYPE, "cpu") == "cuda":
            device = f"cuda:{int(args.get('model_instance_device_id') or 0)}"
        self.engine = BucketEngine(
            self.name, os.path.join(version_dir, parameter(config, ARTIFACTS, "artifacts")), device,
            next(i["dims"] for i in config["input"] if i["name"] == INPUT_X), _dtype(config),
            int(config["max_batch_size"]), gpu_outputs=gpu_outputs_wanted(config),
            canary_file=parameter(config, CANARY_FILE))
        self.clock = _stage_clock(self.name, self.engine.sizes)
        pb_utils.Logger.log_info(f"{self.name}: one hop on {device}, buckets {self.engine.described}; "
                                 f"{self.engine.runner.reason}")
        # The request path's callables, looked up once (an import or attribute chain per request adds up).
        from torch.utils.dlpack import from_dlpack, to_dlpack

        self.pb_utils, self.from_dlpack, self.to_dlpack = pb_utils, from_dlpack, to_dlpack

    def execute(self, requests):
        """The request path (it is most of a small request's time): one pass over each request's
        inputs, the rows copied once into the bucket's own buffers, the engine, a DLPack view per response."""
        pb_utils = self.pb_utils
        start = time.perf_counter_ns()
        responses = [None] * len(requests)
        xs, masks = [], []
        for request in requests:
            x = mask = None
            for tensor in request.inputs():  # one pass: get_input_tensor_by_name walks this list once per name
                name = tensor.name()
                if name == INPUT_X:
                    x = self.from_dlpack(tensor.to_dlpack())
                elif name == INPUT_MASK:
                    mask = self.from_dlpack(tensor.to_dlpack())
            xs.append(x)
            masks.append(mask)
        for group in self.engine.groups([x.shape[0] for x in xs]):
            try:
                outputs, size, n, gathered, ran = self.engine.run([xs[i] for i in group], [masks[i] for i in group])
                for i, y in zip(group, outputs):
                    responses[i] = pb_utils.InferenceResponse(output_tensors=[self._output(y)])
                self.clock.record(gathered - start, ran - gathered, time.perf_counter_ns() - ran, size, n)
            except Exception as exc:  # noqa: BLE001 - the engine's error goes back to each caller
                for i in group:
                    responses[i] = _error(f"{self.name}: {type(exc).__name__}: {exc}", _code(exc))
            start = time.perf_counter_ns()
        return responses

    def _output(self, y):
        if self.engine.gpu_outputs:
            try:
                return _to_triton(OUTPUT_Y, y, keep_device=True)
            except Exception as exc:  # noqa: BLE001 - a backend built without GPU tensor support
                self.engine.gpu_outputs = False
                self.pb_utils.Logger.log_warn(f"{self.name}: GPU outputs refused ({type(exc).__name__}: {exc}); "
                                              f"copying outputs to the CPU in model.py from now on")
        if self.engine.cuda:
            return _to_triton(OUTPUT_Y, y)
        # on the CPU, y (a fresh tensor from the engine, or a row range of one) is already contiguous host memory
        return self.pb_utils.Tensor.from_dlpack(OUTPUT_Y, self.to_dlpack(y if y.is_contiguous() else y.contiguous()))


def torch_dtype(triton_type: str):
    """The torch dtype of a config.pbtxt data type (``TYPE_FP16``, ...); a KeyError for one kkdeploy does not serve."""
    import torch

    return {"TYPE_FP32": torch.float32, "TYPE_FP16": torch.float16, "TYPE_BF16": torch.bfloat16,
            "TYPE_BOOL": torch.bool}[triton_type]


def _dtype(config: dict):
    return torch_dtype(next(i["data_type"] for i in config["input"] if i["name"] == INPUT_X))
