"""ONNX Runtime candidates: CPU EP everywhere, CUDA EP (optionally with CUDA graphs) on a GPU.

The builder optimizes the exported graph once at the requested level and saves the optimized
model, so loading does not re-optimize (and cannot silently optimize differently than what
was validated). Levels and disabled optimizers are recorded with the candidate.

``<name>-mixed`` and ``<name>-autocast`` candidates (float32 builds under the judge contract) run a
mixed-precision graph: ours, its float16 blocks calibrated by exporting, optimizing and validating each tried
set on the build's trial plan, or ModelOpt AutoCast's conversion, the anchor to beat (``engines.mixed_graph``).

A graph exported with our custom ops (``--linear custom`` / ``--layer-norm custom``: ``kkdeploy``-domain
nodes) needs our custom-op library in every session: the builder compiles it on demand
(``engines.custom_op_library``), copies it into the artifact (so the manifest hashes it), records it as
``options["custom_ops_library"]`` and registers it at build and at load. It is native code, so the build and
``kkdeploy.load`` first load the candidate in a fresh process (``loads_native_code``).
"""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from kkdeploy.config import TransformerConfig
from kkdeploy.errors import KKError

from .base import (BUILT, SKIPPED, UNAVAILABLE, Backend, BuildContext, CandidateResult, Runner, import_error_reason,
                   timed_build)
from .recipe import parse as parse_recipe
from .registry import BackendChoice, BackendDescriptor, register

OPT_LEVELS = ("disabled", "basic", "extended", "all")
# Level "all" adds layout transforms tied to this machine's CPU features; "extended" stays portable.
DEFAULT_LEVEL = {"cpu": "extended", "cuda": "basic"}
CANDIDATES = {
    "ort-cpu": {"provider": "CPUExecutionProvider", "cuda_graph": False},
    "ort-cuda": {"provider": "CUDAExecutionProvider", "cuda_graph": False},
    "ort-cuda-graph": {"provider": "CUDAExecutionProvider", "cuda_graph": True},
}
_NP_DTYPES = {torch.float32: np.float32, torch.float16: np.float16, torch.bool: np.bool_}
_cuda_dlls_loaded = False


def import_ort():
    """Import onnxruntime, loading the pip-packaged CUDA libraries once where they exist."""
    global _cuda_dlls_loaded
    import onnxruntime as ort

    if not _cuda_dlls_loaded and "CUDAExecutionProvider" in ort.get_available_providers():
        preload = getattr(ort, "preload_dlls", None)
        if preload is not None:
            preload()
        _cuda_dlls_loaded = True
    return ort


def session_options(ort, level: str, optimized_path: Path | None = None, threads: int | None = None,
                    custom_ops_library: Path | None = None):
    if level not in OPT_LEVELS:
        raise KKError(f"unknown ONNX Runtime optimization level {level!r}; use one of {', '.join(OPT_LEVELS)}")
    levels = {
        "disabled": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
        "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
        "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
        "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
    }
    options = ort.SessionOptions()
    options.graph_optimization_level = levels[level]
    options.log_severity_level = 3
    if threads:  # a shared machine: a fixed thread count and no busy-waiting between ops
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if optimized_path is not None:
        options.optimized_model_filepath = str(optimized_path)
    if custom_ops_library is not None:
        from .custom_op_library import register

        register(options, custom_ops_library)
    return options


def providers_for(name: str, device: torch.device, use_tf32: bool | None = None) -> list:
    """The provider list of a base candidate. ``use_tf32`` is the CUDA EP's ``use_tf32`` option: the build
    sets it to its own ``--tf32`` and records it, so ORT's float32 GEMMs round as the reference's do
    (ORT's default is on, PyTorch's is off). ``None`` (an artifact from before it was recorded) leaves
    ORT's default."""
    spec = CANDIDATES[name]
    if spec["provider"] == "CPUExecutionProvider":
        return ["CPUExecutionProvider"]
    cuda_options = {"device_id": device.index or 0}
    if spec["cuda_graph"]:
        cuda_options["enable_cuda_graph"] = "1"
    if use_tf32 is not None:
        cuda_options["use_tf32"] = "1" if use_tf32 else "0"
    return [("CUDAExecutionProvider", cuda_options)]


def recorded_tf32(options: dict) -> bool | None:
    """The ``use_tf32`` a candidate was built and validated with (None: not recorded, or a CPU session)."""
    value = options.get("cuda_ep_use_tf32")
    return None if value is None else bool(value)


def default_variants(device: torch.device, dtype: torch.dtype = torch.float32, contract: str = "strict") -> list[str]:
    """The session settings of this device's EP: CPU, or CUDA with and without CUDA-graph replay."""
    return ["ort-cpu"] if torch.device(device).type == "cpu" else ["ort-cuda", "ort-cuda-graph"]


class OrtRunner(Runner):
    """CPU: numpy in/out (ORT returns a fresh array each call). CUDA: IO binding on torch buffers."""

    backend = "ort"

    def __init__(self, session, config: TransformerConfig, dtype: torch.dtype, device: torch.device,
                 cuda_graph: bool = False):
        super().__init__(config, dtype, device)
        self.session = session
        self.cuda_graph = cuda_graph
        self._binding = None
        if self.device.type == "cuda":
            self._bind_static_buffers()

    def _bind_static_buffers(self):
        b, s, d = self.config.batch_size, self.config.seq_len, self.config.d_model
        self._x = torch.empty(b, s, d, dtype=self.dtype, device=self.device)
        self._mask = torch.empty(b, s, dtype=torch.bool, device=self.device)
        self._y = torch.empty(b, s, d, dtype=self.dtype, device=self.device)
        binding = self.session.io_binding()
        dev_id = self.device.index or 0
        for name, t in (("x", self._x), ("valid_token_mask", self._mask)):
            binding.bind_input(name, "cuda", dev_id, _NP_DTYPES[t.dtype], list(t.shape), t.data_ptr())
        binding.bind_output("y", "cuda", dev_id, _NP_DTYPES[self._y.dtype], list(self._y.shape), self._y.data_ptr())
        self._binding = binding

    def infer(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        if self._binding is None:
            (y,) = self.session.run(["y"], {"x": x.detach().numpy(), "valid_token_mask": mask.numpy()})
            return torch.from_numpy(y)
        self._x.copy_(x)
        self._mask.copy_(mask)
        torch.cuda.current_stream(self.device).synchronize()  # ORT runs on its own stream
        self.session.run_with_iobinding(self._binding)
        return self._y.clone()

    def release(self) -> None:
        self._binding = None  # it points into the session and the buffers: first
        self.session = None
        self._x = self._mask = self._y = None


def base_candidate(name: str) -> str:
    """``ort-cpu-mixed`` / ``ort-cpu-autocast`` -> ``ort-cpu``: the session settings a variant shares."""
    return replace(parse_recipe(name), precision="model").name


def optimizer_settings(ctx: BuildContext, candidate: str) -> tuple[str, list]:
    """The graph optimization level (per device type, from the build options or the default) and the
    disabled optimizers for a base candidate name."""
    device_type = "cpu" if CANDIDATES[candidate]["provider"] == "CPUExecutionProvider" else "cuda"
    return (ctx.options.get(f"ort_level_{device_type}", DEFAULT_LEVEL[device_type]),
            list(ctx.options.get("ort_disabled_optimizers", [])))


class OrtBackend(Backend):
    name = "ort"

    def unavailable_reason(self, device: torch.device, dtype: torch.dtype) -> str | None:
        try:
            ort = import_ort()
        except Exception as exc:  # ImportError or a broken install
            return import_error_reason("onnxruntime", exc)
        if device.type == "cuda" and "CUDAExecutionProvider" not in ort.get_available_providers():
            return ("unavailable: onnxruntime has no CUDAExecutionProvider "
                    f"(providers: {', '.join(ort.get_available_providers())}); pip install onnxruntime-gpu")
        return None

    def candidates(self, ctx: BuildContext) -> list[str]:
        wanted = ctx.candidate_filter
        names = [n for n in default_variants(ctx.device) if wanted is None or n in wanted]
        if ctx.options.get("mixed_precision"):
            names += [replace(parse_recipe(n), precision=p).name for n in names for p in ("fp16-blocks", "autocast")]
        return names

    def _optimize(self, ort, candidate: str, device: torch.device, source: Path, optimized: Path, level: str,
                  disabled: list, library: Path | None = None):
        options = session_options(ort, level, optimized, custom_ops_library=library)
        return ort.InferenceSession(str(source), sess_options=options,
                                    providers=providers_for(candidate, device, tf32_option(candidate)),
                                    disabled_optimizers=disabled)

    def build(self, ctx: BuildContext, candidate: str) -> CandidateResult:
        ort = import_ort()
        if ctx.onnx_path is None:
            raise KKError(f"{candidate} needs the exported model.onnx")
        try:
            library = custom_ops_library(ctx)
        except KKError as exc:  # no compiler, headers unreachable, compile error: recorded, not raised
            return CandidateResult(candidate, self.name, UNAVAILABLE, f"unavailable: {exc}")
        proofs = None
        if library is not None and CANDIDATES[base_candidate(candidate)]["provider"] != "CPUExecutionProvider":
            proofs, refusal = custom_op_proofs(ctx, library)
            if refusal:
                return CandidateResult(candidate, self.name, SKIPPED, f"skipped: {refusal}",
                                       options={"custom_op_proofs": proofs})
        result = self._build(ort, ctx, candidate, library)
        if library is not None and result.status == BUILT:
            result.files.append(library.name)
            result.options["custom_ops_library"] = library.name
            result.options["custom_ops_build"] = json.loads(library_record_path(library).read_text())
            if proofs is not None:
                result.options["custom_op_proofs"] = proofs
        return result

    def _build(self, ort, ctx: BuildContext, candidate: str, library: Path | None) -> CandidateResult:
        precision = parse_recipe(candidate).precision
        if precision == "fp16-blocks":
            return self.build_mixed(ort, ctx, candidate, library)
        if precision == "autocast":
            if library is not None:
                return CandidateResult(candidate, self.name, UNAVAILABLE,
                                       "unavailable: ModelOpt AutoCast cannot run a graph with kkdeploy custom ops")
            return self.build_autocast(ort, ctx, candidate)
        level, disabled = optimizer_settings(ctx, candidate)
        optimized = ctx.out_dir / f"{candidate}.optimized.onnx"
        result = CandidateResult(
            name=candidate, backend=self.name, status=BUILT,
            files=[optimized.name],
            options={"provider": CANDIDATES[candidate]["provider"], "cuda_graph": CANDIDATES[candidate]["cuda_graph"],
                     "cuda_ep_use_tf32": tf32_option(candidate),
                     "graph_optimization_level": level, "disabled_optimizers": disabled,
                     "model": optimized.name, "onnxruntime": ort.__version__},
        )

        return timed_build(lambda: self._optimize(ort, candidate, ctx.device, ctx.onnx_path, optimized, level,
                                                  disabled, library), result)

    def build_mixed(self, ort, ctx: BuildContext, candidate: str, library: Path | None = None) -> CandidateResult:
        """Calibrate the float16 blocks against the validator, keep the chosen graph, record every try."""
        from .mixed_graph import calibrate_graph

        base = base_candidate(candidate)
        level, disabled = optimizer_settings(ctx, base)

        def build(source: Path, stem: Path) -> OrtRunner:
            optimized = stem.with_name(f"{stem.name}.optimized.onnx")
            self._optimize(ort, base, ctx.device, source, optimized, level, disabled, library)
            return self._runner(ort, base, optimized, ctx.config, ctx.dtype, ctx.device, library,
                                use_tf32=tf32_option(base))

        calibration, (source, optimized) = calibrate_graph(ctx, candidate, ("onnx", "optimized.onnx"), build)
        result = CandidateResult(
            name=candidate, backend=self.name, status=BUILT, files=[source.name, optimized.name],
            build_seconds=calibration["seconds"],
            options={**mixed_graph_options(ort, base, level, disabled, source, optimized),
                     "fp16_layers": calibration["fp16_layers"], "calibration": calibration})
        if not calibration["passed"]:
            result.reason = "even the all-float32 graph failed calibration; validation decides"
        return result

    def build_autocast(self, ort, ctx: BuildContext, candidate: str) -> CandidateResult:
        """ModelOpt AutoCast's graph, optimized like ours; unavailable (with the reason) without ModelOpt."""
        from .mixed_graph import AutoCastUnavailable, autocast_graph

        start = time.perf_counter()
        try:
            source, autocast = autocast_graph(ctx, candidate)
        except AutoCastUnavailable as exc:
            return CandidateResult(candidate, self.name, UNAVAILABLE, str(exc))
        base = base_candidate(candidate)
        level, disabled = optimizer_settings(ctx, base)
        optimized = source.with_name(f"{candidate}.optimized.onnx")
        self._optimize(ort, base, ctx.device, source, optimized, level, disabled)
        return CandidateResult(
            name=candidate, backend=self.name, status=BUILT, files=[source.name, optimized.name],
            build_seconds=round(time.perf_counter() - start, 3),
            options={**mixed_graph_options(ort, base, level, disabled, source, optimized), "autocast": autocast})

    def loads_native_code(self, entry: dict) -> bool:
        """A session with a custom-op library runs that library's native code; stock ORT kernels do not."""
        return bool((entry.get("options") or {}).get("custom_ops_library"))

    def load(self, artifact_dir: Path, entry: dict, config: TransformerConfig, dtype: torch.dtype,
             device: torch.device) -> OrtRunner:
        model = Path(artifact_dir) / entry["options"]["model"]
        library = entry["options"].get("custom_ops_library")
        runner = self._runner(import_ort(), base_candidate(entry["name"]), model, config, dtype, device,
                              Path(artifact_dir) / library if library else None,
                              use_tf32=recorded_tf32(entry["options"]))
        runner.backend = entry["name"]
        return runner

    @staticmethod
    def _runner(ort, base: str, optimized: Path, config: TransformerConfig, dtype: torch.dtype,
                device: torch.device, library: Path | None = None, use_tf32: bool | None = None) -> OrtRunner:
        """A session on a graph optimized at build time (so: no optimization now), on ``base``'s provider
        with the TF32 setting it was built with, and the artifact's custom-op library when it has one."""
        options = session_options(ort, "disabled", custom_ops_library=library)
        session = ort.InferenceSession(str(optimized), sess_options=options,
                                       providers=providers_for(base, device, use_tf32))
        if device.type == "cuda" and "CUDAExecutionProvider" not in session.get_providers():
            raise KKError(f"{optimized.name}: the CUDA EP did not load (providers {session.get_providers()})")
        return OrtRunner(session, config, dtype, device, cuda_graph=CANDIDATES[base]["cuda_graph"])


def tf32_option(candidate: str) -> bool | None:
    """What a CUDA candidate built now records and runs with: the build's TF32 (the pipeline runs every builder
    inside ``config.tf32_mode(--tf32)``); None on the CPU EP."""
    if CANDIDATES[candidate]["provider"] == "CPUExecutionProvider":
        return None
    return bool(torch.backends.cuda.matmul.allow_tf32)


def custom_ops_library(ctx: BuildContext) -> Path | None:
    """The custom-op library inside the artifact when the exported graph uses kkdeploy ops, else None.

    Compiled (or taken from the cache) once per build and copied next to the graph, so the artifact carries
    the exact bytes that were validated; raises a one-line ``KKError`` when it cannot be built here."""
    from .custom_op_library import LIBRARY_NAME, build_library, build_record, graph_uses_custom_ops

    uses = (ctx.export_options.uses_custom_ops if ctx.export_options is not None
            else graph_uses_custom_ops(ctx.onnx_path))
    if not uses:
        return None
    target = ctx.out_dir / LIBRARY_NAME
    if not target.is_file():  # once per build; the record of how it was built goes beside it
        import shutil

        built = build_library(ctx.device)
        shutil.copyfile(built, target)
        library_record_path(target).write_text(json.dumps(build_record(built), indent=1))
    return target


def custom_op_proofs(ctx: BuildContext, library: Path) -> tuple[list | None, str | None]:
    """(the records, why the candidate may not be built) of the library's ops at this model's op shapes, proven once
    per build (``engines.custom_op_proof``); (None, None) where nothing is proven (the CPU, float32)."""
    from kkdeploy.kernels.proof_process import isolation_wanted

    from .custom_op_proof import ops_in_graph, proof_refusal, prove_library_ops, refusal_of

    if proof_refusal(ctx.device, ctx.dtype) is not None or ctx.export_options is None:
        return None, None
    if ctx.custom_op_proofs is None:
        plan = ctx.validation_plan or {}
        args = {"library": str(library), "seed": plan.get("seed", 1234),
                "padding_ratio": plan.get("padding_ratio", 0.25), "packed_qkv": ctx.export_options.qkv == "packed",
                "ops": ops_in_graph(ctx.export_options)}
        ctx.custom_op_proofs = prove_library_ops_isolated(ctx, args) if isolation_wanted(ctx.device) else \
            prove_library_ops(ctx.model, ctx.config, ctx.dtype, ctx.device, args)
    return [r.to_dict() for r in ctx.custom_op_proofs], refusal_of(ctx.custom_op_proofs)


def prove_library_ops_isolated(ctx: BuildContext, args: dict) -> list:
    """The library's proof in a spawned child (``kkdeploy.kernels.proof_process``): a CUDA kernel of ours that faults
    ends the child, and the op shape it was proving gets a record saying so (the candidates that use it are skipped;
    the build goes on). The build's process adopts the records the child made."""
    from kkdeploy.kernels.proof import ProofRecord
    from kkdeploy.kernels.proof_process import OK, adopt_records, run_proof_child

    outcome = run_proof_child("engines.custom_op_proof:library_proof_task", ctx.model, ctx.config, ctx.dtype,
                              ctx.device, args)
    if outcome.status != OK:
        shape = json.loads(outcome.culprit) if outcome.culprit else {"op": "+".join(args["ops"]) or "op"}
        return [ProofRecord(op=f"custom-op {shape.get('op')}", shape=shape, environment={},
                            reason=f"its proof {outcome.reason} in a fresh process")]
    return adopt_records(outcome.answer["records"])


def library_record_path(library: Path) -> Path:
    """``<library>.build.json`` beside the artifact's copy: ``custom_op_library.build_record`` of it."""
    return library.with_name(library.name + ".build.json")


def mixed_graph_options(ort, base: str, level: str, disabled: list, source: Path, optimized: Path) -> dict:
    """What a mixed-precision candidate records: its session settings, both graphs, and how much of the
    graph computes in float16 (``fp16_nodes``)."""
    from .mixed_graph import graph_record

    return {"provider": CANDIDATES[base]["provider"], "cuda_graph": CANDIDATES[base]["cuda_graph"],
            "cuda_ep_use_tf32": tf32_option(base), "graph_optimization_level": level,
            "disabled_optimizers": disabled, "model": optimized.name, "onnxruntime": ort.__version__,
            **graph_record(source)}


BACKEND = OrtBackend()
# Precision comes through the graph: ONNX graphs cannot express half GEMMs (docs/exporter.md).
DESCRIPTOR = register(BackendDescriptor(
    key=OrtBackend.name, module=__name__, recipe_name="ort", libraries=("onnxruntime",), needs_onnx=True,
    choices=(BackendChoice("ort-cuda", ("ort-cuda", "ort-cuda-graph"), default_on=("cuda",)),
             BackendChoice("ort-cpu", ("ort-cpu",), default_on=("cpu",))),
    default_variants=default_variants, precisions=frozenset({"model", "fp16-blocks", "autocast"})))
