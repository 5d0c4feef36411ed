"""``export_onnx``: budget check, graph, graph check, atomic write, export info."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import onnx
import torch

from kkdeploy.artifacts import file_sha256
from kkdeploy.config import TransformerConfig, dtype_name
from kkdeploy.errors import KKError
from kkdeploy.models.weights import weights_sha256

from .budget import ensure_dense_attention_fits
from .graph_check import check_graph
from .onnx_graph import PRODUCER, build_graph, onnx_elem_type, op_histogram
from .options import ExportOptions

EXPORTER_NAME = f"{PRODUCER} (graph written with onnx.helper)"


def _check_model_matches(model: torch.nn.Module, config: TransformerConfig, dtype: torch.dtype) -> None:
    onnx_elem_type(dtype)  # unsupported dtype: one line
    model_config = getattr(model, "config", None)
    if model_config is not None and model_config != config:
        raise KKError(f"the model was built for {model_config.describe()} but the export asks for "
                      f"{config.describe()}; build the model with the export's config")
    model_dtype = next(model.parameters()).dtype
    if model_dtype != dtype:
        raise KKError(f"the model's weights are {dtype_name(model_dtype)} but the export dtype is "
                      f"{dtype_name(dtype)}; pass model.to(torch.{dtype_name(dtype)})")


def write_atomically(model: onnx.ModelProto, path: Path) -> str:
    """Write next to ``path`` under a temporary name, then rename: a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(model.SerializeToString())
        sha = file_sha256(tmp)
        os.replace(tmp, path)
        return sha
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def tensor_spec(value: onnx.ValueInfoProto) -> dict:
    t = value.type.tensor_type
    return {"name": value.name, "dtype": onnx.helper.tensor_dtype_to_np_dtype(t.elem_type).name,
            "shape": [d.dim_value for d in t.shape.dim]}


def export_onnx(model: torch.nn.Module, config: TransformerConfig, dtype: torch.dtype, path: str | Path,
                options: ExportOptions = ExportOptions(), *, check: bool = True,
                memory_budget_bytes: int | None = None) -> dict:
    """Export ``model`` for one static shape to ``path``; return the export info written to export.json."""
    ensure_dense_attention_fits(config, memory_budget_bytes)  # before anything is built
    _check_model_matches(model, config, dtype)
    graph = build_graph(model, config, dtype, options)
    if check:
        check_graph(graph, config, dtype)  # a failing graph never reaches ``path``
    try:
        sha = write_atomically(graph, Path(path))
    except OSError as exc:
        raise KKError(f"cannot write {path}: {exc.strerror or exc}; choose a writable --out") from None
    return {
        "opset": options.opset,
        "exporter": EXPORTER_NAME,
        "onnx_version": onnx.__version__,
        "options": options.to_dict(),
        "op_histogram": op_histogram(graph),
        "sha256": sha,
        "weights_sha256": weights_sha256(model),
        "config": config.to_dict(),
        "dtype": dtype_name(dtype),
        "inputs": [tensor_spec(v) for v in graph.graph.input],
        "outputs": [tensor_spec(v) for v in graph.graph.output],
        "graph_checked": bool(check),
        "file": Path(path).name,
    }
