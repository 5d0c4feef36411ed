"""What ONNX Runtime really runs: the exported nodes it executes in FP32 for lack of a float16 kernel.

ONNX Runtime does not refuse a float16 node its EP has no kernel for: its InsertCastTransformer wraps
the node in Casts named ``InsertedPrecisionFreeCast_*`` and runs it in FP32, even at
ORT_DISABLE_ALL. That changes where the graph rounds, so a parity result has to say so.
"""

from __future__ import annotations

import tempfile
from collections import defaultdict
from pathlib import Path

import onnx


def session_options(level: str = "disabled", threads: int | None = None, optimized_path: str | None = None):
    """SessionOptions for one of the level names used in tables: disabled, basic, extended, all."""
    import onnxruntime as ort

    from engines.ort import session_options as engine_session_options

    return engine_session_options(ort, level, optimized_path, threads)


def optimized_graph(model_path: str | Path, level: str = "disabled",
                    providers: tuple[str, ...] = ("CPUExecutionProvider",)) -> onnx.ModelProto:
    """The graph ONNX Runtime executes after its transformers, as it serializes it."""
    import onnxruntime as ort

    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "optimized.onnx")
        ort.InferenceSession(str(model_path), session_options(level, optimized_path=out), providers=list(providers))
        return onnx.load(out)


def _input_types(model: onnx.ModelProto) -> dict[str, int]:
    inferred = onnx.shape_inference.infer_shapes(model)
    types = {v.name: v.type.tensor_type.elem_type for v in
             list(inferred.graph.value_info) + list(inferred.graph.input) + list(inferred.graph.output)}
    types.update({i.name: i.data_type for i in inferred.graph.initializer})
    return types


def float32_fallback_nodes(model_path: str | Path, level: str = "disabled",
                           providers: tuple[str, ...] = ("CPUExecutionProvider",)) -> dict[str, list[str]]:
    """{op_type: [node names]} of exported float16 nodes that ONNX Runtime runs on FP32 inputs.

    Compared by node name: a node whose first input is FLOAT16 in the export and FLOAT in the graph
    ONNX Runtime executes was moved to FP32 behind inserted Casts.
    """
    exported = onnx.load(str(model_path))
    executed = optimized_graph(model_path, level, providers)
    before, after = _input_types(exported), _input_types(executed)
    executed_nodes = {n.name: n for n in executed.graph.node}
    found: dict[str, list[str]] = defaultdict(list)
    for node in exported.graph.node:
        twin = executed_nodes.get(node.name)
        if twin is None or not node.input or not twin.input:
            continue
        if before.get(node.input[0]) == onnx.TensorProto.FLOAT16 and after.get(twin.input[0]) == onnx.TensorProto.FLOAT:
            found[node.op_type].append(node.name)
    return dict(sorted(found.items()))
