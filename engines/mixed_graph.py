"""Mixed-precision ONNX graphs for the graph backends (ORT, TensorRT): ours, calibrated, and AutoCast's.

A float32 build under the judge contract may compute in float16 inside. Two ways to write that
graph, shared by every backend that runs an ONNX file, so ``ort-*-mixed`` and ``trt-mixed`` calibrate the
same way and ``ort-*-autocast`` and ``trt-autocast`` start from the same conversion:

* ``calibrate_graph``: our precision repair. For each block set that the build's calibration
  (``BuildContext.calibrate``: ``kkdeploy.pipeline.calibration``) tries, the mixed export
  (``ExportOptions.fp16_layers``) is built *by the backend itself* and validated on the build's trial plan, so
  what is calibrated is what ships. Only the chosen set's files stay.
* ``autocast_graph``: NVIDIA ModelOpt's AutoCast on the exported float32 graph, the anchor to beat. It keeps a
  node in FP32 by magnitude rules on one calibration batch (the build's all-valid case), not by our accuracy
  rule; validation then judges the result like any candidate. ModelOpt is optional.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Callable, Sequence

import torch

from kkdeploy.errors import KKError

from .base import BuildContext, Runner, import_error_reason

# ModelOpt 0.47 pins onnx~=1.21 and its [onnx] extra pulls a CUDA torch; its AutoCast runs with these alone.
AUTOCAST_INSTALL = "pip install --no-deps nvidia-modelopt onnx_graphsurgeon onnxslim lief nvidia-ml-py tqdm"
# AutoCast's own defaults, written out so the manifest records what ran; float32 inputs and outputs kept.
AUTOCAST_SETTINGS = {"low_precision_type": "fp16", "data_max": 512, "init_max": 65504, "keep_io_types": True}


class AutoCastUnavailable(KKError):
    """ModelOpt's AutoCast cannot be imported here; the message is the candidate's ``unavailable`` reason."""


def check_float32(ctx: BuildContext, candidate: str) -> None:
    if ctx.dtype != torch.float32:
        raise KKError(f"{candidate}: mixed precision applies to float32 builds, not {ctx.dtype}")


def calibrate_graph(ctx: BuildContext, candidate: str, suffixes: Sequence[str],
                    build: Callable[[Path, Path], Runner]) -> tuple[dict, list[Path]]:
    """Precision repair over block sets; returns the calibration record and the chosen set's files.

    ``build(source, stem)`` turns the exported graph ``source`` into a runner, writing its files as
    ``<stem>.<suffix>`` for each of ``suffixes`` (``source`` itself is ``<stem>.onnx``, the first suffix).
    The chosen set's files are renamed ``<candidate>.<suffix>``; every other tried file is removed.
    """
    from exporters import export_onnx

    check_float32(ctx, candidate)
    out = Path(ctx.out_dir)

    def stem(layers) -> Path:
        return out / f".calibrate-{candidate}-{'_'.join(map(str, layers)) or 'none'}"

    def files(base: Path) -> list[Path]:
        return [base.with_name(f"{base.name}.{suffix}") for suffix in suffixes]

    def runner_for(layers):
        base = stem(layers)
        source = files(base)[0]
        export_onnx(ctx.model, ctx.config, torch.float32, source,
                    dataclasses.replace(ctx.export_options, fp16_layers=tuple(layers)))
        return build(source, base)

    start = time.perf_counter()
    try:
        calibration = ctx.calibrate_layers(runner_for)
        kept = [path.replace(out / f"{candidate}.{suffix}")
                for path, suffix in zip(files(stem(calibration["fp16_layers"])), suffixes)]
    finally:
        for leftover in out.glob(f".calibrate-{candidate}-*"):
            leftover.unlink(missing_ok=True)
    calibration["seconds"] = round(time.perf_counter() - start, 3)
    return calibration, kept


def autocast_graph(ctx: BuildContext, candidate: str) -> tuple[Path, dict]:
    """AutoCast's conversion of ``ctx.onnx_path``, written as ``<candidate>.onnx``, and what ran.

    Raises ``AutoCastUnavailable`` (with the install line) when ModelOpt cannot be imported."""
    import logging
    from importlib.metadata import version

    import numpy as np

    from exporters.export import write_atomically
    from kkdeploy.inputs import DEFAULT_SEED, generate_case

    try:
        from modelopt.onnx.autocast import convert_to_mixed_precision
    except Exception as exc:  # absent, or present without what it imports
        raise AutoCastUnavailable(f"{import_error_reason('modelopt.onnx.autocast', exc)}; {AUTOCAST_INSTALL}") from None
    check_float32(ctx, candidate)
    out = Path(ctx.out_dir)
    seed = ctx.validation_plan.get("seed", DEFAULT_SEED)
    x, mask = generate_case(ctx.config, "cpu", torch.float32, seed)
    calibration = out / f".{candidate}-calibration.npz"
    np.savez(calibration, x=x.numpy(), valid_token_mask=mask.numpy())
    logging.disable(logging.WARNING)  # AutoCast logs every node it skips; the manifest keeps the result
    try:
        model = convert_to_mixed_precision(onnx_path=str(ctx.onnx_path), calibration_data=str(calibration),
                                           providers=["cpu"], **AUTOCAST_SETTINGS)
    finally:
        logging.disable(logging.NOTSET)
        calibration.unlink(missing_ok=True)
    source = out / f"{candidate}.onnx"
    write_atomically(model, source)
    return source, {"modelopt": version("nvidia-modelopt"), **AUTOCAST_SETTINGS,
                    "calibration": f"the all-valid case of seed {seed}"}


def graph_record(source: Path) -> dict:
    """What a mixed-precision candidate records of its graph: the file, and ``fp16_nodes`` = [float16 nodes,
    nodes] (Cast not counted), comparable across converters."""
    import onnx

    from exporters import float16_node_count

    return {"source": source.name, "fp16_nodes": list(float16_node_count(onnx.load(str(source))))}
