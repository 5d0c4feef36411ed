"""`kkdeploy env`: what this machine can build, prove and serve, and for each thing it cannot, why.

Why a command: otherwise the answers are spread over a build's summary table (a candidate `unavailable` or
`skipped`), a proof record and the server's first error. A deployment engineer asks them before the first build.
A GPU campaign records them first, so every figure after it comes with its machine. Nothing here builds an engine,
compiles a kernel or starts a server: each line is the same check the build, the proof step or `kkdeploy serve`
makes before its own work, asked without doing that work.
"""

from __future__ import annotations

import os
import platform
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ..artifacts import device_info, library_versions, write_json
from ..config import default_dtype, parse_dtype, resolve_device
from ..console import console, table
from ..errors import KKError

ENV_FORMAT = "kkdeploy-env/1"
OK, OFF, ERROR = "ok", "off", "error"  # an "error" is a check that itself failed: a bug to report, named in detail


@dataclass
class Check:
    area: str  # "validation", "backend", "kernel", "proofs", "serving"
    name: str
    status: str  # OK, OFF or ERROR
    detail: str  # what it is or will use when OK; why not when OFF


def _asked(area: str, name: str, ask) -> Check:
    """``ask()`` returns ``(None, what)`` when the thing is there, ``(reason, "")`` when not. A KKError is a reason
    (a one-line answer by design); anything else is a failing check, kept as one line so the report still prints."""
    try:
        reason, what = ask()
    except KKError as exc:
        reason, what = str(exc), ""
    except Exception as exc:  # noqa: BLE001 - one broken check must not hide the others
        return Check(area, name, ERROR, f"{type(exc).__name__}: {exc}".splitlines()[0])
    if reason:
        return Check(area, name, OFF, reason.removeprefix("unavailable: "))
    return Check(area, name, OK, what)


def validation_checks() -> list[Check]:
    """What every build validates its candidates with: Polygraphy's comparator (``validation.polygraphy_glue``).
    Loading an artifact and serving it do not need it."""
    def comparator():
        try:
            import validation.polygraphy_glue  # noqa: F401 - the build's own import
        except ModuleNotFoundError as exc:
            package = (exc.name or "polygraphy").split(".")[0]
            return (f"{package} is not importable: pip install {package} (every build validates with it; "
                    "kkdeploy.load and serving do not need it)"), ""
        from importlib.metadata import version

        return None, f"polygraphy {version('polygraphy')}: every candidate's trials, element by element"

    return [_asked("validation", "Polygraphy comparator", comparator)]


def backend_checks(device: torch.device, dtype: torch.dtype) -> list[Check]:
    """Every registered backend: available here (and the candidates a build would make of it), or the reason the
    build would record it ``unavailable``."""
    from engines import get_backend, registry

    defaults = set(registry.default_choices(device.type))
    checks = []
    for desc in registry.DESCRIPTORS.values():
        def ask(desc=desc):
            reason = get_backend(desc.key).unavailable_reason(device, dtype)
            if reason:
                return reason, ""
            by_default = any(choice.name in defaults for choice in desc.choices)
            names = ", ".join(desc.variants(device, dtype))
            return None, f"{names}{'' if by_default else ' (on request: --backends)'}"
        checks.append(_asked("backend", desc.recipe_name or desc.choices[0].name, ask))
    return checks


def kernel_checks(device: torch.device, dtype: torch.dtype) -> list[Check]:
    """Our kernels, shape limits aside: whether each can run here at all (each build then proves it per op shape).
    The rows LayerNorm is C++ compiled on first use, so on a GPU this asks for its compiler, not for a compile."""
    from ..kernels import cuda_build, dependent_launch, faithful_attention, fused_linear, layer_norm
    from ..kernels.libdevice import gelu_libdevice

    def attention():  # asked for a shape inside its limits: only the device, dtype and Triton decide
        return faithful_attention.kernel_refusal(128, 64, dtype, device), \
            (f"Triton; rows up to {faithful_attention.MAX_FUSED_SEQ_LEN} keys, head dims up to "
             f"{faithful_attention.MAX_FUSED_HEAD_DIM}")

    def gemms():
        return fused_linear.kernel_refusal(dtype, device), "Triton tl.dot tiles, bias and epilogues in FP32"

    def rows_layer_norm():
        if device.type != "cuda" or dtype != torch.float16:
            return (layer_norm.kernel_refusal(device) or f"dtype {dtype}: the rows kernel is float16 only"), ""
        compiler = cuda_build.nvcc()
        return None, f"CUDA C++, compiled on first use by {cuda_build.compiler_version(compiler)}"

    def libdevice():
        if device.type != "cuda":
            return f"{device.type} device: no GEMM launch links it", ""
        found = gelu_libdevice()
        if found is None:
            return ("CUDA's libdevice.10.bc not found ($KKDEPLOY_CUDA_LIBDEVICE, $CUDA_HOME, /usr/local/cuda*): GEMM "
                    "launches with a GELU part link Triton's copy, and their proofs say whether that is bit-identical"), ""
        return None, f"{found} (ATen's erff, for the GEMM launches with a GELU part)"

    def ort_custom_ops():
        """The ONNX Runtime custom-op library (exports with --linear/--layer-norm/--gelu custom), compiled on first use
        against ONNX Runtime's C API headers: a build fetches them once when neither the cache nor the variable has them."""
        from engines import custom_op_library

        compiler = custom_op_library.compiler()
        if os.environ.get("KKDEPLOY_ORT_INCLUDE"):
            include, label = custom_op_library.ort_headers()  # checks the directory, fetches nothing
        else:
            cached = custom_op_library.cached_ort_headers()
            if cached is None:
                return ("ONNX Runtime's C API headers are not cached: the first build exporting custom ops fetches "
                        "them (apt-get download libonnxruntime-dev), or set KKDEPLOY_ORT_INCLUDE"), ""
            include, label = cached
        cuda = f", CUDA kernels by {cuda_build.compiler_version(cuda_build.nvcc())}" if device.type == "cuda" else ""
        return None, f"compiled on first use by {cuda_build.compiler_version(compiler)} against {label} ({include}){cuda}"

    return [_asked("kernel", "attention", attention), _asked("kernel", "GEMMs", gemms),
            _asked("kernel", "rows LayerNorm", rows_layer_norm), _asked("kernel", "CUDA libdevice", libdevice),
            _asked("kernel", "dependent launches (-pdl)",
                   lambda: (dependent_launch.refusal(device), "Hopper programmatic dependent launch, off by default")),
            _asked("kernel", "ONNX Runtime custom ops", ort_custom_ops)]


def proof_checks(device: torch.device) -> list[Check]:
    """Where the proofs of this environment are kept, and how many records the cache holds."""
    from ..kernels.proof import cache_root, environment_key

    def cache():
        key = environment_key(device)
        root = cache_root()
        records = len(list(root.glob("*.json"))) if root.is_dir() else 0
        what = ", ".join(f"{k} {v}" for k, v in key.items() if k != "device_type")
        return None, f"{root}: {records} record(s); this environment: {what}"

    def where():
        from ..kernels.proof_process import isolation_wanted

        if isolation_wanted(device):
            return None, ("in a spawned child: a kernel that faults refuses its op shape and the build goes on "
                          "(KKDEPLOY_PROOF_PROCESS=0: in the calling process)")
        if device.type == "cuda":
            return ("KKDEPLOY_PROOF_PROCESS=0: proofs run in the calling process, where a kernel that faults ends "
                    "the build; unset it"), ""
        return None, f"in the calling process ({device.type}: no CUDA kernel runs there to fault)"

    return [_asked("proofs", "proof cache", cache), _asked("proofs", "where proofs run", where)]


#: the CUDA driver calls the in-process backend's native route makes (serving/csrc/kkdeploy_backend.cc, CudaDriver)
NATIVE_DRIVER_CALLS = ("cuMemcpyHtoDAsync_v2", "cuMemcpyDtoHAsync_v2", "cuMemsetD8Async", "cuGraphLaunch",
                       "cuStreamSynchronize", "cuMemcpyDtoDAsync_v2")


def serving_checks() -> list[Check]:
    """What `kkdeploy serve` and `kkdeploy loadtest` need: the server binary, a Python the Python-backend stub can
    embed, a compiler for kkdeploy's in-process backend, and the client libraries (tritonclient; our native gRPC
    client's compiler and hpack)."""
    from ..kernels.cuda_build import compiler_version, cxx_compiler
    from ..serving.backend_build import OTHERWISE, WHAT, python_link_flags
    from ..serving.triton_server import INSTALL_COMMAND, find_server, python_library_dir

    def server():
        found = find_server()
        return (None, found.describe()) if found else (f"no tritonserver found: run `{INSTALL_COMMAND}`", "")

    def stub():
        return None, f"this Python embeds (libpython in {python_library_dir()})"

    def inprocess():
        cxx = cxx_compiler(WHAT, OTHERWISE)
        python_link_flags()
        return None, f"compiled on first use by {compiler_version(cxx)} for Python {platform.python_version()}"

    def native():
        """The in-process backend's native route: a captured graph's executable from torch, a GPU, the driver."""
        if not callable(getattr(torch.cuda.CUDAGraph, "raw_cuda_graph_exec", None)):
            return (f"torch {torch.__version__} does not hand out a captured graph's executable "
                    f"(CUDAGraph.raw_cuda_graph_exec): Python's direct route serves instead"), ""
        if not torch.cuda.is_available():
            return "no CUDA device: the route replays captured CUDA graphs; Python's routes serve instead", ""
        import ctypes

        path = os.environ.get("KKDEPLOY_CUDA_DRIVER") or "libcuda.so.1"
        try:
            lib = ctypes.CDLL(path)
        except OSError as exc:
            return f"cannot open {path} ({exc}): Python's direct route serves instead", ""
        missing = [f for f in NATIVE_DRIVER_CALLS if not hasattr(lib, f)]
        if missing:
            return f"{path} has no {', '.join(missing)}: Python's direct route serves instead", ""
        return None, f"the C++ half copies, launches the captured graph and waits by itself ({path})"

    def client():
        from importlib.metadata import PackageNotFoundError, version

        try:
            return None, f"tritonclient {version('tritonclient')}"
        except PackageNotFoundError:
            return "tritonclient is not installed: pip install 'tritonclient[grpc,http]' (kkdeploy loadtest)", ""

    def native_client():
        """`kkdeploy loadtest --client auto` takes our HTTP/2 client where it builds: a compiler and hpack."""
        from ..serving import native_client as nc

        why = nc.unavailable(build=False)
        if why:
            return f"{why}: loadtest sends through grpcio", ""
        cxx = cxx_compiler(nc.WHAT, nc.OTHERWISE)
        return None, f"loadtest's gRPC client by default, compiled on first use by {compiler_version(cxx)}"

    return [_asked("serving", "tritonserver", server), _asked("serving", "Python backend", stub),
            _asked("serving", "in-process backend", inprocess), _asked("serving", "in-process native route", native),
            _asked("serving", "load generator client", client),
            _asked("serving", "native gRPC client", native_client)]


def collect(device: torch.device, dtype: torch.dtype) -> dict:
    """The whole report: the machine, the library versions, and one check per line."""
    info = device_info(device)
    if device.type == "cuda":
        info["memory_gib"] = round(torch.cuda.get_device_properties(device).total_memory / 2**30, 1)
    from ..kernels.proof import triton_version

    versions = dict(library_versions(), triton=triton_version())  # the version a proof's environment key holds
    checks = (validation_checks() + backend_checks(device, dtype) + kernel_checks(device, dtype)
              + proof_checks(device) + serving_checks())
    return {"format": ENV_FORMAT, "device": info, "dtype": str(dtype).removeprefix("torch."),
            "python": platform.python_version(), "platform": platform.platform(), "cpus": os.cpu_count(),
            "versions": versions, "checks": [asdict(c) for c in checks]}


def register(sub):
    p = sub.add_parser("env", help="what this machine can build, prove and serve, and why not where it cannot")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda[:N] (default auto)")
    p.add_argument("--dtype", choices=["float32", "float16"], help="default: float16 on CUDA, float32 on CPU")
    p.add_argument("--json", dest="json_path", help="write the report here as JSON")
    p.set_defaults(func=run)


def run(args) -> int:
    device = resolve_device(args.device)
    dtype = parse_dtype(args.dtype) if args.dtype else default_dtype(device)
    report = collect(device, dtype)
    d = report["device"]
    versions = ", ".join(f"{k} {v}" for k, v in report["versions"].items() if v)
    console.print(f"{d['name']} ({d['type']} {d['capability']}{', %s GiB' % d['memory_gib'] if 'memory_gib' in d else ''})"
                  f", {report['dtype']}; Python {report['python']} on {report['platform']}, {report['cpus']} CPUs",
                  soft_wrap=True)
    console.print(f"versions: {versions}", soft_wrap=True)
    rows = [[c["area"], c["name"], c["status"], c["detail"]] for c in report["checks"]]
    console.print(table("What this machine can do", ["area", "what", "status", "detail or why not"], rows))
    off = sum(c["status"] != OK for c in report["checks"])
    console.print(f"{len(rows) - off} of {len(rows)} ready; every 'off' line says why and what would turn it on")
    if args.json_path:
        write_json(Path(args.json_path), report)
        console.print(f"wrote {args.json_path}")
    return 0
