"""Write a Triton model repository for what ``kkdeploy build`` shipped.

Two topologies (``topology``):

``one-hop`` (the default)::

    REPO/
      README.md  manifest.json  validation.json  serving.json     (Triton ignores top-level files)
      <name>/config.pbtxt   1/model.py   1/artifacts/...          the only model: what clients call

  Triton's dynamic batcher gathers requests (``max_batch_size`` = the largest batch bucket, ``preferred_batch_size``
  = the buckets) into ONE Python-backend model that runs the engine in-process through ``kkdeploy.load``: the
  gathered batch is written straight into the smallest validated bucket that holds it (padding rows fully masked:
  zeros by the model's semantics, never returned), run once, and split back. There is no second model and no BLS
  hop, and on a CUDA artifact the tensors stay on the GPU (DLPack) from the request buffers to the engine and back.

``two-hop`` (``--engine native``, or asked for; what every repository was before the one hop)::

      <name>/config.pbtxt   1/model.py                             the front: gathers, pads to B, one BLS call
      <name>_engine/config.pbtxt   1/<engine files>                the engine at its fixed batch B

  Engines are built for one fixed batch, and Triton cannot pad a batch for an ONNX Runtime or TensorRT model (its
  batcher concatenates requests; it never pads to a fixed size) and an ensemble cannot compute. So serving a
  native engine model needs the Python front. The engine model, by what was shipped (``engine="auto"``): an ONNX
  Runtime candidate -> ``backend: "onnxruntime"`` on the graph the build optimized and validated; a TensorRT
  candidate -> ``backend: "tensorrt"`` on the plan; anything else -> a Python-backend model on ``kkdeploy.load``.
  Native engine models serve the artifact's batch B only (batch buckets are for the one-hop model).

The repository is written to a staging directory and renamed into place: never half a repository.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

from .. import artifacts
from ..config import TransformerConfig
from ..console import console
from ..errors import KKError

# The exported graph's names (exporters.onnx_graph INPUT_NAMES / OUTPUT_NAMES; a test keeps them in step).
INPUT_X, INPUT_MASK, OUTPUT_Y = "x", "valid_token_mask", "y"
REPO_SCHEMA = "kkdeploy.triton-repo/1"
ENGINE_CHOICES = ("auto", "native", "python", "inprocess")
INPROCESS_BACKEND = "kkdeploy"  # backend_build.BACKEND_NAME: kkdeploy's own backend, in tritonserver's process
TOPOLOGIES = ("auto", "one-hop", "two-hop")
OUTPUT_DEVICES = ("cpu", "gpu")
NATIVE_BACKENDS = {"ort": "onnxruntime", "trt": "tensorrt"}  # kkdeploy backend -> Triton backend
TRITON_DTYPES = {"float32": "TYPE_FP32", "float16": "TYPE_FP16", "bfloat16": "TYPE_BF16"}
ORT_DISABLE_ALL = 2  # the onnxruntime backend's ``optimization { graph { level } }``: 2 = ORT_DISABLE_ALL
TEMPLATE = Path(__file__).with_name("triton_model.py")


@dataclass
class RepositoryInfo:
    """What a written repository serves; also written as ``serving.json``."""

    path: str
    model: str
    engine_model: str
    engine_backend: str  # python | onnxruntime | tensorrt
    candidate: str  # the artifact's chosen candidate
    engine_reason: str  # why this engine model
    choice_reason: str  # the build's reason for its choice
    config: dict
    dtype: str
    device_type: str
    max_queue_delay_us: int
    topology: str = "two-hop"  # one-hop | two-hop
    buckets: list = None  # the batch sizes the served model runs (the artifact's batch only, without buckets)
    instances: int = 1
    output_device: str = "cpu"  # one hop on a CUDA artifact: where model.py hands Triton the output (cpu | gpu)

    @property
    def batch_size(self) -> int:
        return int(self.config["batch_size"])

    @property
    def max_batch(self) -> int:
        return max(self.buckets or [self.batch_size])


# -- reading the artifacts -------------------------------------------------------------------------------------
def read_artifacts(root: Path) -> dict:
    """The manifest, after checking that every file it lists is present and unmodified: a repository is a
    deployment, and Triton (unlike ``kkdeploy.load``) has no fallback for a tampered engine."""
    from ..pipeline.runtime import read_manifest, verify_files

    root = Path(root)
    manifest = read_manifest(root)  # a directory, our schema, every key, a readable config: one-line errors
    if str(manifest["dtype"]) not in TRITON_DTYPES:
        raise KKError(f"dtype {manifest['dtype']!r} has no Triton type here; use float32 or float16 artifacts")
    problem = verify_files(root, manifest)
    if problem:
        raise KKError(f"{root}: {problem}; rebuild the artifacts")
    return manifest


def plan_engine(manifest: dict, engine: str = "auto", available: set[str] | None = None) -> tuple[str, str]:
    """``(triton_backend, reason)`` for the engine model. ``available``: the backends of the server that will
    run the repository (None: any Triton, e.g. a repository written for a cluster)."""
    if engine not in ENGINE_CHOICES:
        raise KKError(f"--engine must be one of {', '.join(ENGINE_CHOICES)}, got {engine!r}")
    choice = manifest["choice"]
    native = NATIVE_BACKENDS.get(choice.get("backend"))
    if engine == "python":
        return "python", f"--engine python: {choice['candidate']} is served through kkdeploy.load"
    if native is None or choice.get("all_valid_only"):
        why = ("it passed all-valid inputs only, and the padded batches a dynamic batcher makes need "
               "kkdeploy.load's padded runner" if native else "it has no native Triton backend")
        if engine == "native":
            raise KKError(f"--engine native: the shipped candidate {choice['candidate']} cannot be served by a "
                          f"native Triton backend ({why}); use --engine auto or python")
        return "python", f"{choice['candidate']} is served through kkdeploy.load ({why})"
    if available is not None and native not in available:
        if engine == "native":
            raise KKError(f"--engine native: this tritonserver has no {native} backend "
                          f"(it has: {', '.join(sorted(available)) or 'none'}); use --engine python")
        return "python", (f"this tritonserver has no {native} backend (it has: {', '.join(sorted(available))}), "
                          f"so the shipped {choice['candidate']} engine runs through kkdeploy.load in the "
                          f"Python backend")
    return native, f"the shipped {choice['candidate']} engine, natively on Triton's {native} backend"


def plan_topology(manifest: dict, engine: str = "auto", topology: str = "auto",
                  available: set[str] | None = None) -> tuple[str, str, str]:
    """``(topology, engine_backend, reason)``. One hop unless a native engine model is asked for (``--engine
    native``) or the two-hop layout is (``--topology two-hop``, e.g. to compare against it)."""
    if topology not in TOPOLOGIES:
        raise KKError(f"--topology must be one of {', '.join(TOPOLOGIES)}, got {topology!r}")
    if engine not in ENGINE_CHOICES:
        raise KKError(f"--engine must be one of {', '.join(ENGINE_CHOICES)}, got {engine!r}")
    if topology == "one-hop" and engine == "native":
        raise KKError("--engine native needs the two-hop layout (a native engine has a fixed batch and needs the "
                      "Python front to pad to it); drop --topology one-hop or use --engine auto")
    if engine == "inprocess":
        if topology == "two-hop":
            raise KKError("--engine inprocess is a one-hop model (the engine inside tritonserver's process); drop "
                          "--topology two-hop")
        return "one-hop", INPROCESS_BACKEND, (
            f"one hop, in-process: Triton's batcher feeds kkdeploy's C++ backend, which runs the shipped "
            f"{manifest['choice']['candidate']} through kkdeploy.load inside tritonserver's own process (no stub), on "
            f"the smallest batch bucket holding each gathered batch")
    if topology == "two-hop" or (topology == "auto" and engine == "native"):
        backend, reason = plan_engine(manifest, engine, available)
        return "two-hop", backend, reason
    return "one-hop", "python", (f"one hop: Triton's batcher feeds one Python-backend model that runs the shipped "
                                 f"{manifest['choice']['candidate']} through kkdeploy.load, on the smallest batch "
                                 f"bucket holding each gathered batch")


def auto_engine(manifest: dict) -> tuple[str, str]:
    """``(engine, note)`` for ``--engine auto`` on a repository this machine serves: the in-process backend for a
    CUDA artifact, where it can be built here, else the Python backend (the note says why). Why: on a GPU its native
    route served 2 instances at 101% of the engine's throughput, against 34% for the Python backend, and a batch-1
    request at 0.68 against 1.03 ms p50 (docs/serving.md, session 30). A CPU artifact keeps the Python backend, as
    does a repository for a cluster (the in-process backend is compiled for this machine's Python)."""
    if manifest["environment"]["device"].get("type", "cpu") != "cuda":
        return "auto", ""
    from .backend_build import backend_library

    try:
        backend_library(log=lambda message: console.print(f"[dim]{message}[/]"))
    except KKError as exc:
        return "auto", f" (--engine auto: the in-process backend cannot be built here: {exc})"
    return "inprocess", " (--engine auto on a CUDA artifact; --engine python for the Python backend)"


def artifact_buckets(manifest: dict) -> list[int]:
    """The batch sizes the artifacts were validated at: the buckets, or the artifact's one batch."""
    record = manifest.get("batch_buckets") or {}
    return [int(b) for b in record.get("sizes") or []] or [int(manifest["config"]["batch_size"])]


# -- config.pbtxt -----------------------------------------------------------------------------------------------
def _tensor(name: str, dtype: str, dims: list[int], optional: bool = False) -> str:
    extra = " optional: true" if optional else ""
    return f'  {{ name: "{name}" data_type: {dtype} dims: [ {", ".join(str(d) for d in dims)} ]{extra} }}'


def _params(values: dict[str, str]) -> str:
    return "".join(f'parameters {{ key: "{k}" value: {{ string_value: "{v}" }} }}\n' for k, v in values.items())


def front_config(name: str, engine_model: str, config: TransformerConfig, dtype: str, delay_us: int) -> str:
    t = TRITON_DTYPES[dtype]
    s, d = config.seq_len, config.d_model
    return (
        f'# The front: dynamic batching of 1..{config.batch_size} sequences, padded to the engine\'s fixed batch\n'
        f'# with fully masked rows, one BLS call to "{engine_model}", results split back (see model.py).\n'
        f'name: "{name}"\nbackend: "python"\nmax_batch_size: {config.batch_size}\n'
        f"input [\n{_tensor(INPUT_X, t, [s, d])},\n{_tensor(INPUT_MASK, 'TYPE_BOOL', [s], optional=True)}\n]\n"
        f"output [\n{_tensor(OUTPUT_Y, t, [s, d])}\n]\n"
        f"dynamic_batching {{ max_queue_delay_microseconds: {int(delay_us)} }}\n"
        f"instance_group [ {{ kind: KIND_CPU count: 1 }} ]\n"
        + _params({"kkdeploy_role": "front", "kkdeploy_engine_model": engine_model})
    )


def batched_config(name: str, config: TransformerConfig, dtype: str, device_type: str, buckets: list[int],
                   delay_us: int, instances: int = 1, output_device: str = "cpu", backend: str = "python") -> str:
    """The one-hop model: dynamic batching up to the largest bucket, the buckets as preferred sizes, and the
    engine in the same model (``kkdeploy_role: batched``): Python backend, or kkdeploy's in-process backend
    (``backend="kkdeploy"``); on a GPU, answers handed to Triton in host memory or, with ``output_device="gpu"``,
    as GPU tensors (``triton_model.gpu_outputs_wanted``)."""
    t = TRITON_DTYPES[dtype]
    s, d = config.seq_len, config.d_model
    kind = "KIND_GPU" if device_type == "cuda" else "KIND_CPU"
    params = {"kkdeploy_role": "batched", "kkdeploy_artifacts": "artifacts", "kkdeploy_device_type": device_type}
    if device_type == "cuda":
        if backend == "python":
            # Inputs in GPU memory (CUDA shared memory from a client) reach model.py on the GPU, uncopied.
            params["FORCE_CPU_ONLY_INPUT_TENSORS"] = "no"
        params["kkdeploy_output_device"] = output_device
    where = ("kkdeploy's C++ backend runs kkdeploy.load inside tritonserver's process" if backend != "python"
             else "this model runs kkdeploy.load")
    return (
        f"# One hop: Triton's batcher gathers 1..{max(buckets)} sequences; {where} on\n"
        f"# the smallest validated batch bucket that holds them ({', '.join(map(str, buckets))}), padding inside it\n"
        f"# with fully masked rows, and returns each request its own rows.\n"
        f'name: "{name}"\nbackend: "{backend}"\nmax_batch_size: {max(buckets)}\n'
        f"input [\n{_tensor(INPUT_X, t, [s, d])},\n{_tensor(INPUT_MASK, 'TYPE_BOOL', [s], optional=True)}\n]\n"
        f"output [\n{_tensor(OUTPUT_Y, t, [s, d])}\n]\n"
        f"dynamic_batching {{ preferred_batch_size: [ {', '.join(map(str, buckets))} ] "
        f"max_queue_delay_microseconds: {int(delay_us)} }}\n"
        f"instance_group [ {{ kind: {kind} count: {int(instances)} }} ]\n"
        + _params(params)
    )


def engine_config(name: str, backend: str, config: TransformerConfig, dtype: str, device_type: str,
                  entry: dict | None, op_library: Path | None = None) -> str:
    """The engine model's config.pbtxt. ``op_library``: where the repository will hold the candidate's
    custom-op library (absolute: Triton's onnxruntime backend registers the path as given)."""
    t = TRITON_DTYPES[dtype]
    b, s, d = config.batch_size, config.seq_len, config.d_model
    kind = "KIND_GPU" if device_type == "cuda" else "KIND_CPU"
    head = f'name: "{name}"\nbackend: "{backend}"\n'
    body = (f"max_batch_size: 0\n"
            f"input [\n{_tensor(INPUT_X, t, [b, s, d])},\n{_tensor(INPUT_MASK, 'TYPE_BOOL', [b, s])}\n]\n"
            f"output [\n{_tensor(OUTPUT_Y, t, [b, s, d])}\n]\n"
            f"instance_group [ {{ kind: {kind} count: 1 }} ]\n")
    if backend == "python":
        return (f"# The engine at its fixed batch {b}: kkdeploy.load on 1/artifacts (see model.py).\n" + head + body
                + _params({"kkdeploy_role": "engine", "kkdeploy_artifacts": "artifacts",
                           "kkdeploy_device_type": device_type}))
    options = entry["options"]
    if backend == "onnxruntime":
        level = options.get("graph_optimization_level")
        notes = (f"# {entry['name']}: the graph optimized at build time (level {level}"
                 f", disabled optimizers {options.get('disabled_optimizers') or []}) and validated as saved;\n"
                 f"# it is loaded with optimizations off, as engines/ort.py loads it. Built with onnxruntime "
                 f"{options.get('onnxruntime')}: the backend's ORT should be the same version.\n")
        if options.get("cuda_graph"):
            notes += ("# The build captured CUDA graphs; Triton's onnxruntime backend binds new buffers per request,\n"
                      "# which ORT's CUDA-graph mode forbids, so it runs the same graph on the CUDA EP uncaptured.\n")
        operations = ""
        if options.get("custom_ops_library"):
            if op_library is None:
                raise KKError(f"{entry['name']} needs its custom-op library registered; pass where the repository "
                              f"holds it")
            notes += ("# The graph uses the kkdeploy custom ops: the backend registers their library (copied into\n"
                      "# this version directory) by its absolute path, so a moved repository must be rewritten.\n")
            operations = f'model_operations {{ op_library_filename: "{op_library}" }}\n'
        return (notes + head + f'default_model_filename: "{options["model"]}"\n' + body
                + f"optimization {{ graph {{ level: {ORT_DISABLE_ALL} }} }}\n" + operations
                + _params({"kkdeploy_candidate": entry["name"]}))
    compatible = " (the plan is version compatible)" if options.get("version_compatible") else ""
    notes = (f"# {entry['name']}: a TensorRT {options.get('tensorrt')} plan for one GPU type; the backend's TensorRT "
             f"must be the same version{compatible}.\n")
    return (notes + head + f'default_model_filename: "{options["engine"]}"\n' + body
            + _params({"kkdeploy_candidate": entry["name"]}))


# -- files ------------------------------------------------------------------------------------------------------
def _native_files(root: Path, manifest: dict, entry: dict, backend: str) -> list[str]:
    """The engine files Triton loads: the model or plan, and any external-data file beside it."""
    main = entry["options"]["model" if backend == "onnxruntime" else "engine"]
    return [rel for rel in manifest["files"] if rel == main or rel.startswith(main + ".")] or [main]


def check_onnx_io(path: Path, config: TransformerConfig, dtype: str) -> None:
    """The graph's inputs and outputs are the ones config.pbtxt declares (else Triton refuses to load it)."""
    import onnx

    graph = onnx.load(str(path), load_external_data=False).graph
    b, s, d = config.batch_size, config.seq_len, config.d_model
    expected = {INPUT_X: [b, s, d], INPUT_MASK: [b, s], OUTPUT_Y: [b, s, d]}
    found = {v.name: [dim.dim_value for dim in v.type.tensor_type.shape.dim] for v in [*graph.input, *graph.output]}
    for name, dims in expected.items():
        if found.get(name) != dims:
            raise KKError(f"{path.name}: tensor {name!r} is {found.get(name)}, config.pbtxt needs {dims}; "
                          f"the graph does not match the manifest, rebuild the artifacts")


def render_readme(info: RepositoryInfo, manifest: dict) -> str:
    cfg = TransformerConfig.from_dict(info.config)
    b, s, d = cfg.batch_size, cfg.seq_len, cfg.d_model
    env = manifest.get("environment", {})
    device = env.get("device", {})
    validation = manifest.get("validation") or {}
    chosen = next((c for c in manifest["candidates"] if c.get("name") == info.candidate), {})
    verdict = (chosen.get("validation") or manifest.get("fallback", {}).get("validation") or {})
    versions = env.get("versions", {})
    shape = f"shape {manifest['shape_id']}" if manifest.get("shape_id") else "a custom shape"
    one_hop = info.topology == "one-hop"
    lines = [
        f"# Triton model repository: `{info.model}`",
        "",
        f"Written by `kkdeploy triton-repo` from the artifacts of {shape}: {cfg.describe()}, {info.dtype}, "
        f"built on {device.get('type')} "
        f"`{device.get('name')}` ({device.get('capability')}).",
        "",
        "| model | backend | batch | inputs | output |",
        "|---|---|---|---|---|",
        f"| `{info.model}` (call this one) | "
        f"{info.engine_backend if one_hop else 'python'} "
        f"({'one hop: the engine runs in it' if one_hop else 'front'}) | "
        f"1..{info.max_batch} sequences per request, dynamic batching | "
        f"`x` [n,{s},{d}] {info.dtype}, `valid_token_mask` [n,{s}] bool (optional: all valid) | `y` [n,{s},{d}] |",
        *([] if one_hop else [
            f"| `{info.engine_model}` | {info.engine_backend} | exactly {b} | `x` [{b},{s},{d}], `valid_token_mask` "
            f"[{b},{s}] | `y` [{b},{s},{d}] |"]),
        "",
        f"* Shipped candidate: **{info.candidate}** ({info.choice_reason}).",
        f"* Engine model: {info.engine_reason}.",
        f"* Validation: contract `{validation.get('contract')}` (atol {validation.get('atol')}, rtol "
        f"{validation.get('rtol')}), {validation.get('trials')} trials per mask mode "
        f"({', '.join(validation.get('mask_modes') or [])}), seed {validation.get('seed')}: "
        f"{verdict.get('status', 'unknown')}, {verdict.get('failed_elements', '?')} failed elements "
        f"(max abs {verdict.get('max_abs', '?')}). Full report: `validation.json`; build record: `manifest.json`.",
        "",
        "## Batching",
        "",
        (f"Triton's dynamic batcher gathers requests until they hold at most {info.max_batch} sequences (preferring "
         f"the validated batch buckets {info.buckets}); the model writes them into the smallest bucket that holds "
         "them, padding with zero rows whose mask is all False (the model outputs zeros there; every row is computed "
         "on its own), runs that bucket's engine once in the same process and returns each request its own rows."
         if one_hop else
         f"The front gathers requests until they hold at most {b} sequences, pads the batch to exactly {b} with zero "
         "rows whose mask is all False (the model outputs zeros there; every row is computed on its own), calls the "
         "engine once and returns each request its own rows.")
        + f" Triton answers 400 to a request of more than {info.max_batch} sequences, a wrong width, a wrong dtype "
        "or a mask of the wrong shape.",
        "",
        "## Serving it",
        "",
        "```bash",
        "tritonserver --model-repository $PWD      # any Triton with the backends named above",
        "kkdeploy serve --artifacts <artifact dir>  # or: the bundled server (writes its own copy of this repository)",
        f"curl -s localhost:8000/v2/models/{info.model}/infer -d '{{\"inputs\": [{{\"name\": \"x\", \"shape\": "
        f"[1,{s},{d}], \"datatype\": \"{TRITON_DTYPES[info.dtype][5:]}\", \"data\": [...]}}]}}'",
        "```",
        "",
    ]
    if info.engine_backend != INPROCESS_BACKEND:
        lines.append("Requirements: the Python-backend models run in Triton's Python environment: the front needs "
                     "`torch`; a Python engine model needs `kkdeploy` installed with its dependencies (`kkdeploy.load` "
                     "checks library versions against the manifest). Tensors cross the Python backend as DLPack, so "
                     "numpy 1.x or 2.x both work.")
    if info.engine_backend == INPROCESS_BACKEND:
        import os
        import sys

        from .triton_server import ENV_SITE_DIRS, _site_dirs

        lines.append(f"`{info.model}/1/libtriton_{INPROCESS_BACKEND}.so` is kkdeploy's in-process backend, compiled "
                     f"for the Python that wrote this repository ({sys.executable}, {sys.version.split()[0]}): it "
                     "embeds that interpreter in tritonserver, so its shared libpython, torch and kkdeploy must be there at "
                     "the same paths. For another machine, write the repository there, or use `--engine python`. "
                     "Started by hand, tritonserver needs that Python's site directories (a virtualenv or an editable "
                     "install is not on the embedded interpreter's default path):")
        lines += ["", "```bash", f"{ENV_SITE_DIRS}={os.pathsep.join(_site_dirs())} tritonserver --model-repository "
                  "$PWD", "```", ""]
    if info.engine_backend == "onnxruntime":
        lines.append(f"The onnxruntime backend should carry onnxruntime {versions.get('onnxruntime')}, the version "
                     "this graph was validated with (another version may round differently).")
    elif info.engine_backend == "tensorrt":
        lines.append(f"The plan runs only on `{device.get('name')}` with TensorRT {versions.get('tensorrt')}.")
    else:
        lines.append("`kkdeploy.load` re-checks hashes, device and library versions at load time and serves the "
                     "validated PyTorch fallback, saying why in the server log, if the engine cannot run here.")
    lines.append("")
    return "\n".join(lines)


def write_repository(artifacts_dir, out, model_name: str = "kkdeploy", engine: str = "auto",
                     max_queue_delay_us: int = 0, available_backends: set[str] | None = None,
                     force: bool = False, topology: str = "auto", instances: int = 1,
                     kubernetes: bool = False, parameters: dict[str, str] | None = None,
                     output_device: str = "cpu", served_here: bool = False) -> RepositoryInfo:
    """Write the repository for ``artifacts_dir`` to ``out`` (atomically) and return what it serves.
    ``kubernetes``: also write ``kubernetes/`` manifests for a cluster (``serving.kubernetes``). ``parameters``:
    more ``config.pbtxt`` parameters for every model (``kkdeploy serve`` adds its token and canary file).
    ``output_device``: where the one-hop model of a CUDA artifact hands Triton each answer (docs/serving.md,
    "Outputs in host memory"): ``cpu`` (default; copied once in ``model.py``) or ``gpu`` (for clients that read
    answers through CUDA shared memory). ``served_here``: this machine's tritonserver serves the repository
    (``kkdeploy serve``, ``loadtest --serve``), so ``--engine auto`` on a CUDA artifact takes the in-process backend
    where it can be built (``auto_engine``)."""
    import re

    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}", model_name or ""):
        raise KKError(f"--model-name {model_name!r}: use letters, digits, '_', '.', '-' (64 at most), "
                      f"starting with a letter or digit")
    if int(max_queue_delay_us) < 0:
        raise KKError(f"--max-queue-delay-us must be >= 0, got {max_queue_delay_us}")
    if int(instances) < 1:
        raise KKError(f"--instances must be at least 1, got {instances}")
    if output_device not in OUTPUT_DEVICES:
        raise KKError(f"--output-device must be one of {', '.join(OUTPUT_DEVICES)}, got {output_device!r}")
    if kubernetes and engine == "inprocess":
        raise KKError("--kubernetes with --engine inprocess: the in-process backend is compiled for this machine's "
                      "Python and embeds it, which a cluster's Triton image does not have; use --engine python (or "
                      "auto) for a cluster")
    root = Path(artifacts_dir).resolve()
    manifest = read_artifacts(root)
    auto_note = ""
    if served_here and engine == "auto" and topology != "two-hop":
        engine, auto_note = auto_engine(manifest)
    layout, backend, reason = plan_topology(manifest, engine, topology, available_backends)
    reason += auto_note
    config = TransformerConfig.from_dict(manifest["config"])
    dtype = str(manifest["dtype"])
    device_type = manifest["environment"]["device"].get("type", "cpu")
    choice = manifest["choice"]
    entry = next((c for c in manifest["candidates"] if c.get("name") == choice["candidate"]), None)
    if backend not in ("python", INPROCESS_BACKEND) and entry is None:
        raise KKError(f"the chosen candidate {choice['candidate']!r} is not in the manifest; rebuild the artifacts")
    engine_model = model_name if layout == "one-hop" else f"{model_name}_engine"
    buckets = artifact_buckets(manifest) if layout == "one-hop" else [config.batch_size]
    target = Path(out).resolve()
    if target == root or root in target.parents:
        raise KKError(f"--out {target} is inside the artifact directory; write the repository elsewhere")
    info = RepositoryInfo(path=str(target), model=model_name, engine_model=engine_model, engine_backend=backend,
                          candidate=choice["candidate"], engine_reason=reason, choice_reason=choice.get("reason", ""),
                          config=config.to_dict(), dtype=dtype, device_type=device_type,
                          max_queue_delay_us=int(max_queue_delay_us), topology=layout, buckets=buckets,
                          instances=int(instances),
                          output_device=output_device if layout == "one-hop" and device_type == "cuda" else "cpu")
    extra = _params(parameters or {})
    library = None
    if backend == INPROCESS_BACKEND:  # compiled for this machine's Python before anything is written
        from .backend_build import LIBRARY_NAME, backend_library

        library = backend_library(log=lambda message: console.print(f"[dim]{message}[/]"))
    with artifacts.staged_directory(target, force=force) as stage:
        front = stage / model_name
        (front / "1").mkdir(parents=True)
        if library is not None:  # Triton finds a model's backend library in its version directory first
            shutil.copy2(library, front / "1" / LIBRARY_NAME)
        else:
            shutil.copyfile(TEMPLATE, front / "1" / "model.py")
        if layout == "one-hop":
            (front / "config.pbtxt").write_text(batched_config(model_name, config, dtype, device_type, buckets,
                                                               max_queue_delay_us, instances, info.output_device,
                                                               backend=backend if library is not None else "python")
                                                + extra)
            _copy_artifacts(root, manifest, front / "1" / "artifacts")
        else:
            (front / "config.pbtxt").write_text(front_config(model_name, engine_model, config, dtype,
                                                             max_queue_delay_us) + extra)
            eng = stage / engine_model
            (eng / "1").mkdir(parents=True)
            library = (entry or {}).get("options", {}).get("custom_ops_library") if backend == "onnxruntime" else None
            final_library = target / engine_model / "1" / library if library else None  # its path once renamed in
            (eng / "config.pbtxt").write_text(engine_config(engine_model, backend, config, dtype, device_type, entry,
                                                            final_library) + extra)
            if backend == "python":
                shutil.copyfile(TEMPLATE, eng / "1" / "model.py")
                _copy_artifacts(root, manifest, eng / "1" / "artifacts")
            else:
                for rel in _native_files(root, manifest, entry, backend) + ([library] if library else []):
                    shutil.copy2(root / rel, eng / "1" / Path(rel).name)
                if backend == "onnxruntime":
                    check_onnx_io(eng / "1" / Path(entry["options"]["model"]).name, config, dtype)
        shutil.copy2(root / artifacts.MANIFEST, stage / "manifest.json")
        report = (manifest.get("validation") or {}).get("report")
        if report and (root / report).is_file():
            shutil.copy2(root / report, stage / "validation.json")
        from .. import __version__

        source = {"artifacts": str(root), "manifest_sha256": artifacts.file_sha256(root / artifacts.MANIFEST)}
        artifacts.write_json(stage / "serving.json", {"schema": REPO_SCHEMA, **asdict(info), "path": None,
                                                      "kkdeploy": __version__, "created": artifacts.utc_now(),
                                                      "source": source})
        (stage / "README.md").write_text(render_readme(info, manifest))
        if kubernetes:
            from .kubernetes import write_manifests

            write_manifests(stage / "kubernetes", info, manifest)
    return info


def _copy_artifacts(root: Path, manifest: dict, copy: Path) -> None:
    """A full copy of the artifacts (every hashed file and the manifest) for ``kkdeploy.load`` in the stub."""
    for rel in [*manifest["files"], artifacts.MANIFEST]:
        (copy / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / rel, copy / rel)


def print_summary(info: RepositoryInfo) -> None:
    console.print(f"repository [bold]{info.path}[/]")
    if info.topology == "one-hop":
        console.print(f"  {info.model}: one hop, {info.engine_backend} backend, dynamic batching of "
                      f"1..{info.max_batch} sequences "
                      f"on buckets {info.buckets} — {info.engine_reason}", soft_wrap=True)
        hint = instances_hint(info)
        if hint:
            console.print(f"  [dim]{hint}[/]", soft_wrap=True)
        return
    b = info.batch_size
    console.print(f"  {info.model}: python front, dynamic batching of 1..{b} sequences, padded to {b}")
    console.print(f"  {info.engine_model}: {info.engine_backend} — {info.engine_reason}", soft_wrap=True)


def instances_hint(info: RepositoryInfo) -> str:
    """For one instance of a CUDA engine: what more instances gave. Why not the default: each instance holds its
    own engine and captures in GPU memory (shape 6's build measured a 5 GB peak), and a batch-1 request's latency with
    several instances is not measured yet."""
    if info.device_type != "cuda" or info.instances != 1 or info.topology != "one-hop":
        return ""
    return ("one instance: at saturation, --instances 2 served 101-110% of the engine's throughput on shape 3 (one: "
            "61-66%) and 80% on shape 13 through shared memory (one: 39-45%), --instances 4 up to 127% (H100; each "
            "instance holds its own engine in GPU memory; docs/serving.md)")


def load_info(repository: Path) -> dict:
    """``serving.json`` of a written repository."""
    return json.loads((Path(repository) / "serving.json").read_text())
