"""TensorRT candidates, built through Polygraphy's lazy loaders from the exported ONNX graph.

TensorRT 11 networks are always strongly typed (no FP16 builder flag, no per-layer precision):
the ONNX graph's own types and Casts decide precision, so an FP16 engine is built from the
faithful FP16 export (LayerNorm/softmax/GELU already in FP32 between explicit Casts). We parse
with ``strongly_typed=True`` on TensorRT 10 as well, so both versions build the same program.
That is also why a float32 build under the judge contract gets its float16 through the graph:
``trt-mixed`` is built from our calibrated mixed export (each tried block set built as an engine and
validated) and ``trt-autocast`` from ModelOpt AutoCast's conversion (``engines.mixed_graph``).

TensorRT's builder is not installable on the project's machines; this module is written
against the real API and reports ``unavailable`` with the import error there. It is never mocked.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from kkdeploy.config import TransformerConfig
from kkdeploy.errors import KKError

from .base import (BUILT, UNAVAILABLE, Backend, BuildContext, CandidateResult, Runner, import_error_reason,
                   timed_build)
from .registry import BackendChoice, BackendDescriptor, register

ENGINE_FILE = "engine.plan"
BUILD_LOG = "trt-build.log"
MIXED, AUTOCAST = "trt-mixed", "trt-autocast"
TIMING_CACHE_ENV = "KKDEPLOY_TRT_TIMING_CACHE"


def import_tensorrt():
    import tensorrt  # noqa: F401  (the bindings; the builder library loads on first use)

    return tensorrt


def timing_cache_path(ctx: BuildContext) -> Path:
    """Shared across builds (it only holds kernel timings, no weights), so rebuilds are fast."""
    default = Path(os.environ.get(TIMING_CACHE_ENV, Path.home() / ".cache" / "kkdeploy" / "trt-timing.cache"))
    path = Path(ctx.options.get("trt_timing_cache", default))
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def build_engine(onnx_path: Path, plan_path: Path, log_path: Path, timing_cache: Path,
                 version_compatible: bool = False, builder_optimization_level: int | None = None) -> None:
    """network_from_onnx_path -> engine_from_network -> save_engine, with the build log kept."""
    from polygraphy.backend.trt import CreateConfig, EngineFromNetwork, NetworkFromOnnxPath, SaveEngine
    from polygraphy.logger import G_LOGGER

    previous_log = G_LOGGER.log_file
    G_LOGGER.log_file = str(log_path)
    try:
        network = NetworkFromOnnxPath(str(onnx_path), strongly_typed=True)
        config = CreateConfig(
            load_timing_cache=str(timing_cache) if timing_cache.exists() else None,
            version_compatible=version_compatible or None,
            builder_optimization_level=builder_optimization_level,
        )
        engine = EngineFromNetwork(network, config=config, save_timing_cache=str(timing_cache))
        SaveEngine(engine, path=str(plan_path))()
    finally:
        G_LOGGER.log_file = previous_log


def torch_dtype_of(trt, dtype) -> torch.dtype:
    table = {trt.float32: torch.float32, trt.float16: torch.float16, trt.bool: torch.bool}
    if hasattr(trt, "bfloat16"):
        table[trt.bfloat16] = torch.bfloat16
    return table[dtype]


class TrtRunner(Runner):
    """Executes the deserialized engine on torch-allocated static buffers, on torch's stream."""

    backend = "trt"

    def __init__(self, engine, config: TransformerConfig, dtype: torch.dtype, device: torch.device):
        super().__init__(config, dtype, device)
        trt = import_tensorrt()
        self.engine = engine
        self.context = engine.create_execution_context()
        self.buffers: dict[str, torch.Tensor] = {}
        for i in range(engine.num_io_tensors):
            name = engine.get_tensor_name(i)
            shape = tuple(engine.get_tensor_shape(name))
            if any(d < 0 for d in shape):
                raise KKError(f"engine tensor {name} has dynamic shape {shape}; kkdeploy builds fixed shapes")
            tensor = torch.empty(shape, dtype=torch_dtype_of(trt, engine.get_tensor_dtype(name)), device=self.device)
            self.buffers[name] = tensor
            self.context.set_tensor_address(name, tensor.data_ptr())
        missing = {"x", "valid_token_mask", "y"} - set(self.buffers)
        if missing:
            raise KKError(f"engine is missing I/O tensors {sorted(missing)}; rebuild it from a kkdeploy export")

    def infer(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        self.buffers["x"].copy_(x)
        self.buffers["valid_token_mask"].copy_(mask)
        stream = torch.cuda.current_stream(self.device)
        if not self.context.execute_async_v3(stream.cuda_stream):
            raise RuntimeError("TensorRT execute_async_v3 failed")
        return self.buffers["y"].clone()  # on the same stream: ordered after the engine

    def release(self) -> None:
        self.context = None  # the execution context belongs to the engine and addresses the buffers: first
        self.buffers = {}
        self.engine = None


class TrtBackend(Backend):
    name = "trt"

    def unavailable_reason(self, device: torch.device, dtype: torch.dtype) -> str | None:
        try:
            import_tensorrt()
            import polygraphy.backend.trt  # noqa: F401
        except Exception as exc:
            return import_error_reason("tensorrt", exc)
        if device.type != "cuda":
            return "unavailable: TensorRT engines need a CUDA GPU"
        return None

    def candidates(self, ctx: BuildContext) -> list[str]:
        return ["trt", MIXED, AUTOCAST] if ctx.options.get("mixed_precision") else ["trt"]

    def build(self, ctx: BuildContext, candidate: str) -> CandidateResult:
        if ctx.onnx_path is None:
            raise KKError(f"{candidate} needs the exported model.onnx")
        if candidate == MIXED:
            return self.build_mixed(ctx)
        if candidate == AUTOCAST:
            return self.build_autocast(ctx)
        plan, log = ctx.out_dir / ENGINE_FILE, ctx.out_dir / BUILD_LOG
        result = CandidateResult(name=candidate, backend=self.name, status=BUILT, files=[ENGINE_FILE, BUILD_LOG],
                                 options=self._options(ctx, plan))
        return timed_build(lambda: self._build_engine(ctx, ctx.onnx_path, plan, log), result)

    def build_mixed(self, ctx: BuildContext) -> CandidateResult:
        """Our precision repair: every tried block set is exported, built as an engine and validated."""
        from .mixed_graph import calibrate_graph, graph_record

        def build(source: Path, stem: Path) -> TrtRunner:
            plan = stem.with_name(f"{stem.name}.plan")
            self._build_engine(ctx, source, plan, stem.with_name(f"{stem.name}.build.log"))
            return self._runner(plan, ctx.config, ctx.dtype, ctx.device)

        calibration, (source, plan, log) = calibrate_graph(ctx, MIXED, ("onnx", "plan", "build.log"), build)
        return CandidateResult(
            name=MIXED, backend=self.name, status=BUILT, files=[source.name, plan.name, log.name],
            build_seconds=calibration["seconds"],
            options={**self._options(ctx, plan), **graph_record(source),
                     "fp16_layers": calibration["fp16_layers"], "calibration": calibration})

    def build_autocast(self, ctx: BuildContext) -> CandidateResult:
        """ModelOpt AutoCast's graph as a strongly typed engine; unavailable (with the reason) without ModelOpt."""
        from .mixed_graph import AutoCastUnavailable, autocast_graph, graph_record

        try:
            source, autocast = autocast_graph(ctx, AUTOCAST)
        except AutoCastUnavailable as exc:
            return CandidateResult(AUTOCAST, self.name, UNAVAILABLE, str(exc))
        plan, log = source.with_suffix(".plan"), source.with_suffix(".build.log")
        result = CandidateResult(
            name=AUTOCAST, backend=self.name, status=BUILT, files=[source.name, plan.name, log.name],
            options={**self._options(ctx, plan), **graph_record(source),
                     "autocast": autocast})
        return timed_build(lambda: self._build_engine(ctx, source, plan, log), result)

    def _build_engine(self, ctx: BuildContext, source: Path, plan: Path, log: Path) -> None:
        build_engine(source, plan, log, timing_cache_path(ctx), bool(ctx.options.get("trt_version_compatible", False)),
                     ctx.options.get("trt_builder_optimization_level"))

    def _options(self, ctx: BuildContext, plan: Path) -> dict:
        return {"engine": plan.name, "strongly_typed": True,
                "version_compatible": bool(ctx.options.get("trt_version_compatible", False)),
                "builder_optimization_level": ctx.options.get("trt_builder_optimization_level"),
                "tensorrt": import_tensorrt().__version__}

    @staticmethod
    def _runner(plan: Path, config: TransformerConfig, dtype: torch.dtype, device: torch.device) -> TrtRunner:
        from polygraphy.backend.trt import EngineFromPath  # allows host code for version-compatible plans

        engine = EngineFromPath(str(plan))()
        if engine is None:
            raise KKError(f"TensorRT could not deserialize {plan.name} (built by another TensorRT version or GPU?)")
        return TrtRunner(engine, config, dtype, device)

    def loads_native_code(self, entry: dict) -> bool:
        return True  # deserializing a plan (and any plugin library) runs TensorRT's native code

    def load(self, artifact_dir: Path, entry: dict, config: TransformerConfig, dtype: torch.dtype,
             device: torch.device) -> TrtRunner:
        runner = self._runner(Path(artifact_dir) / entry["options"]["engine"], config, dtype, device)
        runner.backend = entry["name"]
        return runner


BACKEND = TrtBackend()
# Precision comes through the graph: ONNX graphs cannot express half GEMMs (docs/exporter.md).
DESCRIPTOR = register(BackendDescriptor(
    key=TrtBackend.name, module=__name__, recipe_name="trt", libraries=("tensorrt",), needs_onnx=True,
    choices=(BackendChoice("trt", default_on=("cuda",)),),
    precisions=frozenset({"model", "fp16-blocks", "autocast"})))
