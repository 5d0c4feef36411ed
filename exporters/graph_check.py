"""The graph check run after every export: a violation names the node and fails the export."""

from __future__ import annotations

from pathlib import Path

import onnx
import torch
from onnx import TensorProto

from kkdeploy.config import TransformerConfig
from kkdeploy.errors import KKError, first_line

from .onnx_graph import onnx_elem_type
from .options import CUSTOM_DOMAIN

# The standard ONNX domain (both spellings) and exactly our custom-op domain; anything else (com.microsoft,
# another library's ops) would need a runtime this project neither builds nor validates.
ALLOWED_DOMAINS = ("", "ai.onnx", CUSTOM_DOMAIN)
# kkdeploy ops: (inputs, required attributes); engines/custom_ops/kkdeploy_ops.cc implements exactly these.
CUSTOM_OPS = {"Linear": (3, ()), "LayerNorm": (3, ("epsilon",)), "Gelu": (1, ())}

TYPE_NAMES = {v: k for k, v in TensorProto.DataType.items()}


class GraphCheckError(KKError):
    """The exported graph breaks the faithful-graph rules; the message names the node."""


def _load(model_or_path) -> onnx.ModelProto:
    if isinstance(model_or_path, onnx.ModelProto):
        return model_or_path
    path = Path(model_or_path)
    if not path.is_file():
        raise GraphCheckError(f"no ONNX file at {path}; export it first with `kkdeploy export`")
    try:
        return onnx.load(str(path))
    except Exception as exc:
        raise GraphCheckError(f"{path} is not a readable ONNX model: {first_line(exc)}") from None


def _infer(model: onnx.ModelProto) -> onnx.ModelProto:
    """onnx.checker's full check, then strict shape inference with type checks."""
    try:
        onnx.checker.check_model(model, full_check=True)
    except Exception as exc:
        raise GraphCheckError(f"onnx.checker rejects the graph: {first_line(exc)}") from None
    try:
        return onnx.shape_inference.infer_shapes(model, check_type=True, strict_mode=True, data_prop=True)
    except Exception as exc:
        raise GraphCheckError(f"shape inference fails: {first_line(exc)}") from None


def _value_types(model: onnx.ModelProto) -> dict[str, onnx.TypeProto]:
    types = {v.name: v.type for v in list(model.graph.value_info) + list(model.graph.input) + list(model.graph.output)}
    for init in model.graph.initializer:
        types[init.name] = onnx.helper.make_tensor_type_proto(init.data_type, list(init.dims))
    return types


def _dims(type_proto: onnx.TypeProto) -> list | None:
    tensor = type_proto.tensor_type
    if not tensor.HasField("shape"):
        return None
    return [d.dim_value if d.HasField("dim_value") else (d.dim_param or "?") for d in tensor.shape.dim]


def _node_label(node: onnx.NodeProto) -> str:
    return f"node {node.name or '<unnamed>'} ({node.op_type})"


def _check_static(model: onnx.ModelProto, types: dict) -> None:
    for value in list(model.graph.input) + list(model.graph.output):
        dims = _dims(value.type)
        if dims is None or any(not isinstance(d, int) or d <= 0 for d in dims):
            raise GraphCheckError(f"graph {value.name!r} has a dynamic or unknown shape {dims}; export with static dims")
    for node in model.graph.node:
        for out in node.output:
            dims = _dims(types[out]) if out in types else None
            if dims is None or any(not isinstance(d, int) or d <= 0 for d in dims):
                raise GraphCheckError(f"{_node_label(node)} output {out!r} has a dynamic or unknown shape {dims}; "
                                      f"every dim must be static")


def _attr(node: onnx.NodeProto, name: str, default=None):
    for a in node.attribute:
        if a.name == name:
            return onnx.helper.get_attribute_value(a)
    return default


def _elem(types: dict, name: str) -> int | None:
    t = types.get(name)
    return t.tensor_type.elem_type if t is not None else None


def _check_domains(model: onnx.ModelProto) -> None:
    """Only the standard domain and ``kkdeploy``; a kkdeploy node must be one of our ops, well-formed."""
    for opset in model.opset_import:
        if opset.domain not in ALLOWED_DOMAINS:
            raise GraphCheckError(f"the graph imports opset domain {opset.domain!r}; only the standard ONNX domain "
                                  f"and {CUSTOM_DOMAIN!r} (our custom ops) are allowed")
    for node in model.graph.node:
        if node.domain not in ALLOWED_DOMAINS:
            raise GraphCheckError(f"{_node_label(node)} is in domain {node.domain!r}; only the standard ONNX domain "
                                  f"and {CUSTOM_DOMAIN!r} (our custom ops) are allowed")
        if node.domain == CUSTOM_DOMAIN:
            if node.op_type not in CUSTOM_OPS:
                raise GraphCheckError(f"{_node_label(node)} is not a {CUSTOM_DOMAIN} op; the library implements "
                                      f"{', '.join(CUSTOM_OPS)}")
            arity, attrs = CUSTOM_OPS[node.op_type]
            missing = [a for a in attrs if _attr(node, a) is None]
            if len(node.input) != arity or len(node.output) != 1 or missing:
                raise GraphCheckError(f"{_node_label(node)} needs {arity} inputs, 1 output and attributes "
                                      f"{list(attrs)}; got {len(node.input)} inputs, {len(node.output)} outputs"
                                      + (f", missing {missing}" if missing else ""))


def _check_custom_types(model: onnx.ModelProto, types: dict) -> None:
    """A kkdeploy node's inputs and output share one float type (the library registers float32 and float16)."""
    for node in model.graph.node:
        if node.domain != CUSTOM_DOMAIN:
            continue
        elems = [_elem(types, name) for name in (*node.input, *node.output)]
        if len(set(elems)) != 1 or elems[0] not in (TensorProto.FLOAT, TensorProto.FLOAT16):
            raise GraphCheckError(f"{_node_label(node)} mixes or lacks element types "
                                  f"{[TYPE_NAMES.get(e) for e in elems]}; its inputs and output must all be "
                                  f"FLOAT or all FLOAT16")


def _check_numerics(model: onnx.ModelProto, types: dict) -> None:
    for node in model.graph.node:
        op = node.op_type
        if op in ("Tanh", "FastGelu") or (op in ("Gelu", "BiasGelu") and _attr(node, "approximate", b"none") in (b"tanh", "tanh")):
            raise GraphCheckError(f"{_node_label(node)} is a tanh-approximate GELU; the model needs exact erf GELU "
                                  f"(export with gelu='exact')")
        if op == "LayerNormalization":
            stash = _attr(node, "stash_type", 1)
            if _elem(types, node.input[0]) != TensorProto.FLOAT and stash != 1:
                raise GraphCheckError(f"{_node_label(node)} computes its statistics in "
                                      f"{TYPE_NAMES.get(_elem(types, node.input[0]))} (stash_type={stash}); "
                                      f"LayerNorm needs FP32 statistics (stash_type=1 or an FP32 input)")
        if op in ("Softmax", "LogSoftmax") and _elem(types, node.input[0]) != TensorProto.FLOAT:
            raise GraphCheckError(f"{_node_label(node)} runs on {TYPE_NAMES.get(_elem(types, node.input[0]))} "
                                  f"input; softmax must run on FP32 (Cast to FLOAT before it)")


def _check_io(model: onnx.ModelProto, config: TransformerConfig, dtype: torch.dtype) -> None:
    b, s, d = config.batch_size, config.seq_len, config.d_model
    elem = onnx_elem_type(dtype)
    expected_inputs = [("x", elem, [b, s, d]), ("valid_token_mask", TensorProto.BOOL, [b, s])]
    expected_outputs = [("y", elem, [b, s, d])]
    initializers = {i.name for i in model.graph.initializer}
    for kind, values, expected in (("input", [v for v in model.graph.input if v.name not in initializers],
                                    expected_inputs), ("output", list(model.graph.output), expected_outputs)):
        got = [(v.name, v.type.tensor_type.elem_type, _dims(v.type)) for v in values]
        if got != expected:
            fmt = lambda items: ", ".join(f"{n}:{TYPE_NAMES.get(t)}{dims}" for n, t, dims in items)  # noqa: E731
            raise GraphCheckError(f"graph {kind}s are [{fmt(got)}], expected [{fmt(expected)}]")


def check_graph(model_or_path, config: TransformerConfig, dtype: torch.dtype) -> None:
    """Raise ``GraphCheckError`` (naming the node) unless the graph is valid, static and faithful."""
    model = _load(model_or_path)
    _check_io(model, config, dtype)
    _check_domains(model)
    inferred = _infer(model)
    types = _value_types(inferred)
    _check_static(inferred, types)
    _check_custom_types(inferred, types)
    _check_numerics(inferred, types)
