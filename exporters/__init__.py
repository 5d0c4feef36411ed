"""PyTorch -> ONNX: the faithful graph, its options, the graph check and the dense-attention budget."""

from .budget import (DEFAULT_MEMORY_BUDGET_BYTES, DenseAttentionTooLarge, dense_attention_bytes,
                     dense_attention_bytes_ok, ensure_dense_attention_fits)
from .export import EXPORTER_NAME, export_onnx
from .graph_check import GraphCheckError, check_graph
from .onnx_graph import INPUT_NAMES, OUTPUT_NAMES, build_graph, float16_node_count, op_histogram
from .options import (CUSTOM_DOMAIN, DEFAULT_OPSET, GELU_MODES, LAYER_NORM_MODES, LINEAR_MODES, NAMED_VARIANTS,
                      QKV_MODES, ExportOptions)

__all__ = [
    "CUSTOM_DOMAIN", "DEFAULT_MEMORY_BUDGET_BYTES", "DEFAULT_OPSET", "LAYER_NORM_MODES", "EXPORTER_NAME", "GELU_MODES", "INPUT_NAMES", "LINEAR_MODES", "NAMED_VARIANTS",
    "OUTPUT_NAMES", "QKV_MODES", "DenseAttentionTooLarge", "ExportOptions", "GraphCheckError", "build_graph",
    "check_graph", "dense_attention_bytes", "dense_attention_bytes_ok", "ensure_dense_attention_fits",
    "export_onnx", "float16_node_count", "op_histogram",
]
